"""What a JSON-schema constraint costs a decoding step (`fermoe bench decode --json-schema FILE`).

Two sets of the same sequences decode in alternating blocks of steps, so that drift (heat,
other load) falls on both alike: one with the default sampler alone, one with the sampler behind
the grammar's token mask, as a CPU worker runs a constrained request (shared/generate.Decoder
with shared/token_mask.TokenMask): the mask computed, applied as -inf logits, the sampled token
consumed. The schema applies from the first token (no reasoning before it): every step pays for
a mask, the worst case. A sequence whose value is complete (only end-of-generation is allowed)
starts the schema again, so every timed step is constrained.

JSON keys (of the object `fermoe bench decode` prints under "json_schema"):
  file                    the schema file given (--json-schema; bench decode adds it)
  schema_bytes            bytes of the schema's grammar text
  vocabulary_build_s      s: building the grammar engine's view of the vocabulary (once a model)
  steps                   tokens decoded a sequence, in each of the two sets (--tokens)
  decode_tok_s_free       tokens/s of the sampler alone: the batch over the median step
  decode_tok_s_constrained  tokens/s with the mask: the same
  slowdown                the constrained median step over the free one, minus 1
  mask_ms_per_token       ms: the median, over tokens, of computing, applying and advancing the mask
  values_completed        schema values the constrained set completed (each began the schema again)
"""
from __future__ import annotations

import json
import time

import numpy as np

from shared.errors import GrammarError
from shared.grammar import full_grammar, json_schema_text
from shared.sampling import Sampler, SamplingParams
from shared.token_mask import TokenMask, ll_tokenizer

BLOCK_STEPS = 4


def load_schema(path: str) -> str:
    """The schema file as a checked grammar body's text; a clear error for a bad one."""
    try:
        with open(path) as f:
            schema = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object")
    return json_schema_text(schema)


def compare(engine, model, states, logits: np.ndarray, schema_text: str, steps: int, seed: int = 0) -> dict:
    """Decode `steps` tokens per sequence of `states` (one row of `logits` each) free and constrained."""
    tok = model.tokenizer
    grammar = full_grammar("json_schema", schema_text, reasoning=False)
    t0 = time.perf_counter()
    lltok = ll_tokenizer(tok, model.config.n_vocab)
    vocab_s = time.perf_counter() - t0
    try:
        masks = [TokenMask(lltok, grammar) for _ in states]
    except GrammarError as e:
        raise ValueError(f"--json-schema: {e}") from None
    runs = {
        "free": {"states": [s.copy() for s in states], "rows": logits.copy(), "masks": None, "step_s": []},
        "constrained": {"states": [s.copy() for s in states], "rows": logits.copy(), "masks": masks,
                        "step_s": [], "mask_s": [], "values": 0},
    }
    for run in runs.values():
        run["samplers"] = [Sampler(SamplingParams(seed=seed + i)) for i in range(len(states))]
    done = 0
    while done < steps:
        n = min(BLOCK_STEPS, steps - done)
        for name, run in runs.items():
            for _ in range(n):
                _step(engine, tok, run)
        done += n
    free, constrained = (float(np.median(runs[k]["step_s"])) for k in ("free", "constrained"))
    batch = len(states)
    return {
        "schema_bytes": len(schema_text),
        "vocabulary_build_s": round(vocab_s, 3),
        "steps": steps,
        "decode_tok_s_free": round(batch / free, 2),
        "decode_tok_s_constrained": round(batch / constrained, 2),
        "slowdown": round(constrained / free - 1, 4),
        "mask_ms_per_token": round(1000 * float(np.median(runs["constrained"]["mask_s"])), 3),
        "values_completed": runs["constrained"]["values"],
    }


def _step(engine, tok, run) -> None:
    t0 = time.perf_counter()
    tokens = []
    for i, row in enumerate(run["rows"]):
        if run["masks"] is not None:
            m0 = time.perf_counter()
            mask = run["masks"][i]
            if mask.matcher.is_stopped():          # the value is complete: begin another
                mask.matcher.reset()
                run["values"] += 1
            row = mask.apply(row)
            masked_s = time.perf_counter() - m0
            token = run["samplers"][i].sample(row)
            m1 = time.perf_counter()
            mask.consume(token)
            run["mask_s"].append(masked_s + time.perf_counter() - m1)
        else:
            token = run["samplers"][i].sample(row)
        tokens.append(token)
    states = run["states"]
    if len(states) == 1:
        run["rows"] = engine.forward(tokens, states[0], all_logits=False)
    else:
        run["rows"] = engine.decode_batch(tokens, states)
    run["step_s"].append(time.perf_counter() - t0)
