"""For each sampling parameter of a request (and each option of `fermoe generate` and
`fermoe submit`), a value at which it changes what is sampled, found with the sampler
itself (shared.generate in this process) rather than hard-coded: a command or a daemon
that dropped or mixed up the parameter would give what the defaults give, or what
another parameter gives, instead."""
from __future__ import annotations

from shared.sampling import SamplingParams

SEED = 5
# SamplingParams field (= the protocol's sampling field) -> values tried in turn
TRIES = {
    "temperature": (0.0, 1.5, 0.3),
    "top_k": (1, 2, 4, 8),
    "top_p": (0.2, 0.5, 0.8),
    "min_p": (0.5, 0.3, 0.15),
    "repeat_penalty": (1.8, 1.4, 1.15),
    "frequency_penalty": (2.0, 1.0, 0.5),
    "presence_penalty": (2.0, 1.0, 0.5, 1.5, 0.75, -1.0),
    "seed": (SEED + 1, SEED + 2, SEED + 3),
}
# the fields the commands take, by option
OPTIONS = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
           "repeat_penalty": "--repeat-penalty", "frequency_penalty": "--frequency-penalty",
           "presence_penalty": "--presence-penalty", "seed": "--seed"}


def field_cases(sample, fields=tuple(TRIES)) -> dict[str, tuple[object, list]]:
    """field -> (the first value whose sample differs from the defaults' and from every
    other case's, that sample); "defaults" -> (None, the defaults' sample with seed SEED).
    sample maps SamplingParams to a list of token ids."""
    base = SamplingParams(seed=SEED)
    cases = {"defaults": (None, sample(base))}
    for field in fields:
        for value in TRIES[field]:
            out = sample(base.replace(**{field: value}))
            if all(out != seen for _, seen in cases.values()):
                cases[field] = (value, out)
                break
        else:
            raise AssertionError(f"no value of {field} in {TRIES[field]} changes what is sampled")
    return cases


def option_cases(sample) -> dict[str, tuple[list[str], list]]:
    """The same for the command-line options: option -> (its arguments, the sample)."""
    cases = {}
    for field, (value, out) in field_cases(sample, tuple(OPTIONS)).items():
        if field == "defaults":
            args = ["--seed", SEED]
        elif field == "seed":
            args = ["--seed", value]
        else:
            args = ["--seed", SEED, OPTIONS[field], value]
        cases[OPTIONS.get(field, field)] = ([str(a) for a in args], out)
    return cases
