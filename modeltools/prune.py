"""`fermoe prune`: keep K experts a layer and write the smaller GGUF.

Methods: `reap` keeps the K experts of highest REAP saliency (modeltools/expert_saliency.py),
`frequency` the K the router chose most often over the calibration text, `random` K
drawn with a seed (no calibration). The written file is the input with, in every
block, the kept experts' slices of ffn_gate_exps, ffn_up_exps and ffn_down_exps and
the matching rows of the router ffn_gate_inp (kept in their original order), and
`{arch}.expert_count` = K; every other tensor's bytes, every type and all other
metadata are unchanged, so llama.cpp's loader (which checks those shapes against
expert_count) takes it as it takes the original. The file is written under a
temporary name and renamed: a failure leaves no partial output.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.errors import FermoeError
from shared.gguf_file import ALIGNMENT_KEY, GGUFFile
from .gguf_writer import GGUFWriter

METHODS = ("reap", "frequency", "random")
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp")


@dataclass
class ExpertLayout:
    """What of a GGUF pruning touches: its architecture, experts and blocks."""
    arch: str
    n_expert: int
    n_expert_used: int
    blocks: list[int]            # blocks holding expert tensors


def expert_layout(f: GGUFFile) -> ExpertLayout:
    """The experts of a GGUF, or one clear error for a model without them."""
    arch = f.metadata.get("general.architecture")
    n_expert = f.metadata.get(f"{arch}.expert_count") or 0
    blocks = sorted({int(name.split(".")[1]) for name in f.tensors
                     if name.startswith("blk.") and name.split(".")[2] == "ffn_gate_exps"})
    if not n_expert or not blocks:
        raise FermoeError(f"{f.path}: the model has no experts to prune ({arch}.expert_count "
                          f"{'missing' if not n_expert else n_expert}, {len(blocks)} blocks with ffn_gate_exps)")
    nextn = f.metadata.get(f"{arch}.nextn_predict_layers") or 0
    if nextn:
        raise FermoeError(f"{f.path}: the model has {nextn} MTP block(s) ({arch}.nextn_predict_layers), whose "
                          "experts the calibration pass does not run; pruning such files is not supported")
    return ExpertLayout(arch, int(n_expert), int(f.metadata.get(f"{arch}.expert_used_count") or 0), blocks)


def check_keep(layout: ExpertLayout, keep: int) -> None:
    if keep > layout.n_expert:
        raise FermoeError(f"--keep {keep}: the model has only {layout.n_expert} experts a layer")
    if keep < layout.n_expert_used:
        raise FermoeError(f"--keep {keep}: below the {layout.n_expert_used} experts each token is routed to "
                          f"(expert_used_count); keep at least {layout.n_expert_used}")


def check_seen(stats) -> None:
    """A saliency is a mean over the tokens routed to an expert: every one must have some."""
    unseen = stats.unseen()
    if unseen:
        where = "; ".join(f"layer {layer}: experts {', '.join(map(str, e))}" for layer, e in unseen.items())
        raise FermoeError(f"the calibration text ({stats.tokens} tokens) never routed a token to {where}: "
                          "give a longer --calib text or more --calib-tokens (or --allow-unseen, if they are "
                          "experts the router never picks, to prune them first)")


def kept_by_score(scores: np.ndarray, keep: int) -> list[np.ndarray]:
    """Per layer the `keep` highest-scoring experts (ties: the lower index), ascending."""
    return [np.sort(np.argsort(-row, kind="stable")[:keep]) for row in scores]


def kept_at_random(n_layer: int, n_expert: int, keep: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(n_expert, keep, replace=False)) for _ in range(n_layer)]


def _expert_rows(name: str, kept: dict[int, np.ndarray]) -> np.ndarray | None:
    """The kept experts of an expert tensor (its outermost rows), None for any other tensor."""
    parts = name.split(".")
    return kept[int(parts[1])] if parts[0] == "blk" and parts[2] in EXPERT_TENSORS else None


def _pruned_bytes(info, raw: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    if rows is None:
        return raw
    return raw.reshape(info.shape[0], -1)[rows].reshape(-1)     # one tensor's copy at a time


@contextmanager
def _atomic(path: Path):
    """A temporary name beside `path`, renamed to it once the body has written it; on any
    failure it is removed and nothing at `path` changes."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_pruned(src: GGUFFile, out, kept: dict[int, np.ndarray], progress: bool = True) -> None:
    """Write `out`: `src` with, in each block b, only the experts kept[b]."""
    from tqdm import tqdm

    layout = expert_layout(src)
    n_keep = {len(k) for k in kept.values()}
    if set(kept) != set(layout.blocks) or len(n_keep) != 1:
        raise FermoeError("every block with experts needs the same number of kept experts")
    out = Path(out)
    with _atomic(out) as tmp, GGUFWriter(tmp, alignment=src.alignment) as w:
        for key, value in src.metadata.items():
            if key == ALIGNMENT_KEY:
                continue                     # the writer adds it from its alignment
            if key == f"{layout.arch}.expert_count":
                value = n_keep.pop()
            w.add(key, value, src.metadata_types[key])
        rows = {name: _expert_rows(name, kept) for name in src.tensors}
        for name, info in src.tensors.items():
            shape = info.shape if rows[name] is None else (len(rows[name]),) + tuple(info.shape[1:])
            w.add_tensor(name, shape, info.qtype)
        for name, info in tqdm(src.tensors.items(), desc=f"writing {out.name}", unit="tensor",
                               disable=not progress):
            w.write_tensor(name, _pruned_bytes(info, src.raw(name), rows[name]))


def write_scores(path, method: str, kept: list[np.ndarray], stats=None) -> None:
    """The per-layer saliencies and frequencies (and what was kept) as JSON, atomically."""
    layers = []
    for i, k in enumerate(kept):
        entry = {"layer": i, "kept": k.tolist()}
        if stats is not None:
            entry["saliency"] = [None if np.isnan(s) else float(s) for s in stats.saliency[i]]
            entry["frequency"] = stats.count[i].tolist()
        layers.append(entry)
    doc = {"method": method, "calibration_tokens": stats.tokens if stats is not None else 0, "layers": layers}
    with _atomic(Path(path)) as tmp:
        tmp.write_text(json.dumps(doc, indent=1))


def reap_scores(stats) -> np.ndarray:
    """The saliencies to rank by: an expert no calibration token reached scores 0 (it
    contributed nothing to that text), ranked below every expert that was seen."""
    return np.nan_to_num(stats.saliency, nan=0.0)


def prune(model_path, out, keep: int, method: str = "reap", calib_text: str | None = None,
          calib_tokens: int | None = None, ctx: int = 512, seed: int = 0, scores_path=None, progress: bool = True,
          allow_unseen: bool = False):
    """Choose `keep` experts a layer by `method` and write `out`; returns (kept, stats or None).
    reap and frequency calibrate on the first `calib_tokens` tokens of `calib_text` (all by
    default); an expert that text never reaches is an error unless `allow_unseen`."""
    if method not in METHODS:
        raise FermoeError(f"--method {method!r}: choose one of {', '.join(METHODS)}")
    if Path(out).resolve() == Path(model_path).resolve():
        raise FermoeError(f"-o {out}: the output must not be the model it is pruned from")
    with GGUFFile(model_path) as src:
        layout = expert_layout(src)
        check_keep(layout, keep)
        stats = None
        if method == "random":
            kept = kept_at_random(len(layout.blocks), layout.n_expert, keep, seed)
        else:
            if calib_text is None:
                raise FermoeError(f"--method {method} needs a calibration text (--calib FILE)")
            if calib_tokens is not None and calib_tokens < 1:
                raise FermoeError(f"--calib-tokens {calib_tokens}: must be at least 1")
            from .expert_saliency import expert_stats
            from shared.model import Model
            model = Model(model_path)
            try:
                stats = expert_stats(model, model.tokenizer.encode(calib_text)[:calib_tokens], ctx, progress)
            finally:
                model.close()
            if not allow_unseen:
                check_seen(stats)
            kept = kept_by_score(reap_scores(stats) if method == "reap" else stats.count, keep)
        write_pruned(src, out, dict(zip(layout.blocks, kept)), progress)
    if scores_path is not None:
        write_scores(scores_path, method, kept, stats)
    return kept, stats
