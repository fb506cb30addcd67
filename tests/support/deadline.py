"""A deadline for code that could loop forever (a state machine whose step makes no progress):
the test fails at once naming the cause, instead of hanging until an outer timeout (mutation
testing's, CI's) stops it without one. Main thread only (SIGALRM)."""
import contextlib
import signal

LOOPING_PARSER = "the parser loops: a step returned True (go on) without consuming its buffer"


@contextlib.contextmanager
def deadline(seconds: float, cause: str):
    def expire(signum, frame):
        raise AssertionError(f"still running after {seconds} s: {cause}")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
