"""What the HTTP tests share: a daemon with its HTTP front end on the tiny model (a module
that needs other options defines its own `daemon`), the official `openai` client on it, and
`front`: the front end alone, in this process, against a scripted coordinator."""
from __future__ import annotations

import pytest

from tests.support.http_server import HttpDaemon


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    d = HttpDaemon(tiny_q4_path, "--max-sequences", "2")
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def client(daemon):
    from openai import OpenAI
    return OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def front():
    """The front end in this process against a scripted coordinator (tests/support/inprocess_frontend.py)."""
    from tests.support.inprocess_frontend import InProcessFrontend
    with InProcessFrontend() as fe:
        yield fe
