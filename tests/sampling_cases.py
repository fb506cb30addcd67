"""For each sampling option of `fermoe generate` and `fermoe submit`, a value at which
it changes what is sampled, found with the sampler itself (shared.generate in this
process) rather than hard-coded: a command that dropped or mixed up the option would
print what the defaults give, or what another option gives, instead."""
from __future__ import annotations

from dataclasses import replace

from shared.sampling import SamplingParams

SEED = 5
# option -> (SamplingParams field, values tried in turn)
TRIES = {
    "--temp": ("temperature", (0.0, 1.5, 0.3)),
    "--top-k": ("top_k", (1, 2, 4, 8)),
    "--top-p": ("top_p", (0.2, 0.5, 0.8)),
    "--min-p": ("min_p", (0.5, 0.3, 0.15)),
    "--repeat-penalty": ("repeat_penalty", (1.8, 1.4, 1.15)),
    "--seed": ("seed", (SEED + 1, SEED + 2, SEED + 3)),
}


def option_cases(sample) -> dict[str, tuple[list, list]]:
    """option -> (its command-line arguments, what sample(params) gives with them), for
    every option at the first value whose sample differs from the defaults' (and from
    every other case's); "defaults" -> the defaults with --seed SEED. sample maps
    SamplingParams to a list of token ids."""
    base = SamplingParams(seed=SEED)
    cases = {"defaults": (["--seed", SEED], sample(base))}
    for option, (field, values) in TRIES.items():
        for value in values:
            out = sample(replace(base, **{field: value}))
            if all(out != seen for _, seen in cases.values()):
                args = [option, value] if option == "--seed" else ["--seed", SEED, option, value]
                cases[option] = ([str(a) for a in args], out)
                break
        else:
            raise AssertionError(f"no value of {option} in {values} changes what is sampled")
    return cases
