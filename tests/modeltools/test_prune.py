"""`fermoe prune` on synthetic models: the written file's layout, size and behaviour,
the REAP saliency against its definition computed token by token, REAP against
frequency on a model with experts made useless, and the refusals."""
from __future__ import annotations

import os

import numpy as np
import pytest

from shared import reference
from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from modeltools.expert_saliency import expert_stats
from shared.gguf_file import GGUFFile, GGUFValueType
from modeltools.gguf_writer import GGUFWriter
from shared.model import Model
from modeltools.prune import EXPERT_TENSORS, check_seen, prune, write_pruned
from shared.state import SequenceState
from tests.support.gguf_edit import DROP, rewrite_gguf
from tests.support.native_tolerance import PROMPT_RTOL, rel_error
from tests.support.serving_harness import fermoe

CALIB = [(7 * i * i + 3 * i + 11) % 500 for i in range(400)]      # any ids of the 512 in the synth vocabulary
PROMPT = [3, 17, 250, 9, 77, 100, 4, 5, 300, 31, 42, 8, 16, 23, 99, 101]
# Two float32 computations of the same sums in another order (the pruned file's
# softmax runs over fewer experts before the top-k renormalisation), in units of the
# largest |logit|.
SAME_MATH_RTOL = 1e-5
N_USELESS = 2                    # experts made nearly useless in every layer
DOWN_SCALE = 1e-3                # their down projections' new scale


def test_pruned_file_keeps_exactly_the_kept_experts(tiny_f32_path, tmp_path):
    # keys of types a writer would not infer (llama.cpp's files have some) must keep theirs
    model = tmp_path / "typed.gguf"
    rewrite_gguf(tiny_f32_path, model, meta={"general.size_label": 7, "general.score": -1.5},
                 types={"general.size_label": GGUFValueType.UINT8, "general.score": GGUFValueType.FLOAT64})
    out = tmp_path / "pruned.gguf"
    kept, _ = prune(model, out, 5, "random", seed=3, progress=False)
    with GGUFFile(model) as src, GGUFFile(out) as dst:
        assert list(dst.tensors) == list(src.tensors)
        changed = {k for k in src.metadata if src.metadata[k] != dst.metadata.get(k)}
        assert changed == {"qwen35moe.expert_count"} and dst.metadata["qwen35moe.expert_count"] == 5
        assert dst.metadata_types == src.metadata_types and dst.metadata.keys() == src.metadata.keys()
        removed = 0
        for name, info in src.tensors.items():
            got, raw = dst.tensors[name], np.asarray(src.raw(name))
            assert got.qtype == info.qtype
            parts = name.split(".")
            if parts[0] == "blk" and parts[2] in EXPERT_TENSORS:
                rows = kept[int(parts[1])]
                assert got.shape == (5,) + info.shape[1:]
                want = raw.reshape(info.shape[0], -1)[rows].reshape(-1)
                removed += raw.nbytes - want.nbytes
            else:
                assert got.shape == info.shape
                want = raw
            assert np.array_equal(np.asarray(dst.raw(name)), want), name
    # each expert's bytes are a multiple of the alignment here: the file shrinks by exactly them
    assert os.path.getsize(out) == os.path.getsize(model) - removed


def test_pruned_model_runs_as_the_original_restricted_to_the_kept_experts(tiny_f32_path, tmp_path, monkeypatch):
    """The pruned file's logits are the original model's with routing confined to the
    kept experts (the pruned experts' router logits at -inf), so slices and router rows
    belong together; and the native engine runs the pruned file."""
    pytest.importorskip("native", reason="the native extension is not built", exc_type=ImportError)
    from cpu_worker.native_engine import NativeEngine
    out = tmp_path / "pruned.gguf"
    kept, _ = prune(tiny_f32_path, out, 4, "random", seed=1, progress=False)
    pruned = ReferenceEngine(Model(out), kv_cache_dtype="f32")
    got = pruned.forward(PROMPT, pruned.new_state())
    native = NativeEngine(Model(out), threads=1, kv_cache_dtype="f32")
    assert rel_error(native.forward(PROMPT, native.new_state()), got) <= PROMPT_RTOL["f32"]
    native.close()

    route = reference.route

    def confined(layer, x, cfg):
        logits = reference.linear(x, layer.ffn_gate_inp)
        mask = np.full(cfg.n_expert, -np.inf, np.float32)
        mask[kept[layer.index]] = 0
        probs = reference.softmax(logits + mask)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :cfg.n_expert_used]
        w = np.take_along_axis(probs, top, axis=-1)
        return top, w / w.sum(axis=-1, keepdims=True)

    monkeypatch.setattr(reference, "route", confined)
    original = ReferenceEngine(Model(tiny_f32_path), kv_cache_dtype="f32")
    want = original.forward(PROMPT, original.new_state())
    monkeypatch.setattr(reference, "route", route)
    assert rel_error(got, want) <= SAME_MATH_RTOL
    unconfined = original.forward(PROMPT, original.new_state())
    assert rel_error(unconfined, want) > 100 * SAME_MATH_RTOL     # the pruning did change the model


def _saliency_by_definition(model: Model, tokens, ctx: int):
    """S_j and counts computed token by token: each layer's MoE input captured from a
    plain reference forward, then for each token and each expert of its top-k,
    g_j(x) * ||f_j(x)||_2 with f_j run on that token alone."""
    cfg = model.config
    total, count = np.zeros((cfg.n_layer, cfg.n_expert)), np.zeros((cfg.n_layer, cfg.n_expert), int)
    inputs = {}
    moe = reference.moe

    def capture(layer, x, c):
        inputs[layer.index] = x.copy()
        return moe(layer, x, c)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "moe", capture)
        for start in range(0, len(tokens), ctx):
            reference.forward(model, tokens[start:start + ctx], SequenceState(cfg, model.fingerprint, kv_dtype="f32"))
            for layer in model.layers:
                x = inputs[layer.index]
                probs = reference.softmax(reference.linear(x, layer.ffn_gate_inp))
                for t in range(len(x)):
                    top = np.argsort(-probs[t])[:cfg.n_expert_used]
                    g = probs[t, top] / probs[t, top].sum()
                    for e, ge in zip(top, g):
                        f = reference.swiglu(x[t:t + 1], layer.ffn_gate_exps, layer.ffn_up_exps,
                                             layer.ffn_down_exps, expert=e)
                        total[layer.index, e] += ge * np.linalg.norm(f)
                        count[layer.index, e] += 1
    return total / np.maximum(count, 1), count


def test_saliency_is_reaps_definition(tiny_f32_path):
    model = Model(tiny_f32_path)
    tokens = CALIB[:96]
    stats = expert_stats(model, tokens, ctx=40, progress=False)       # windows of 40, 40 and 16 tokens
    # the pass keeps no layer's float32 weights once past it (its memory bound)
    weights = [w for layer in model.layers for w in vars(layer).values() if hasattr(w, "_f32")]
    assert weights and all(w._f32 is None for w in weights)
    want, count = _saliency_by_definition(model, tokens, ctx=40)
    assert stats.tokens == len(tokens) and np.array_equal(stats.count, count)
    seen = count > 0
    np.testing.assert_allclose(stats.saliency[seen], want[seen], rtol=1e-5)
    assert np.isnan(stats.saliency[~seen]).all()


@pytest.fixture(scope="module")
def useless_experts(tiny_f32_path, tmp_path_factory):
    """tiny with, in every layer, the N_USELESS experts the router picks most often over
    the calibration text nearly silenced (down projections scaled by DOWN_SCALE; the
    router untouched): (path, {layer: those experts}, the calibration text)."""
    path = tmp_path_factory.mktemp("prune") / "useless.gguf"
    model = Model(tiny_f32_path)
    text = model.tokenizer.decode(CALIB)
    count = expert_stats(model, model.tokenizer.encode(text), progress=False).count
    useless = {i: np.argsort(-row, kind="stable")[:N_USELESS] for i, row in enumerate(count)}
    changes = {}
    with GGUFFile(tiny_f32_path) as f:
        for i, experts in useless.items():
            name = f"blk.{i}.ffn_down_exps.weight"
            info = f.tensors[name]
            w = np.frombuffer(f.raw(name), np.float32).reshape(info.shape).copy()
            w[experts] *= DOWN_SCALE
            changes[name] = (info.shape, info.qtype, w)
    rewrite_gguf(tiny_f32_path, path, tensors=changes)
    return path, useless, text


def test_reap_removes_the_useless_experts_and_frequency_keeps_them(useless_experts, tmp_path):
    path, useless, text = useless_experts
    keep = 8 - N_USELESS
    reap_kept, stats = prune(path, tmp_path / "reap.gguf", keep, "reap", text, progress=False)
    # the precondition: the router still picks them more often than the average expert
    for layer, experts in useless.items():
        assert (stats.count[layer, experts] > stats.count[layer].mean()).all(), stats.count
    for layer, kept in enumerate(reap_kept):
        assert set(range(8)) - set(kept.tolist()) == set(useless[layer].tolist())
    freq_kept, _ = prune(path, tmp_path / "freq.gguf", keep, "frequency", text, progress=False)
    for layer, kept in enumerate(freq_kept):
        assert set(useless[layer].tolist()) <= set(kept.tolist())


def test_an_interrupted_write_leaves_no_file(tiny_f32_path, tmp_path, monkeypatch):
    """Nothing new is left, and a file already at the output path is left as it was."""
    out = tmp_path / "out" / "pruned.gguf"
    out.parent.mkdir()
    out.write_bytes(b"an earlier file")
    write = GGUFWriter.write_tensor
    calls = []

    def failing(self, name, data):
        calls.append(name)
        if len(calls) == 20:
            raise OSError(28, "No space left on device")
        write(self, name, data)

    monkeypatch.setattr(GGUFWriter, "write_tensor", failing)
    with GGUFFile(tiny_f32_path) as src, pytest.raises(OSError):
        write_pruned(src, out, {i: np.arange(4) for i in range(4)}, progress=False)
    assert len(calls) == 20 and list(out.parent.iterdir()) == [out] and out.read_bytes() == b"an earlier file"


def _no_experts(src, path):
    drop = {name: DROP for name in GGUFFile(src).tensors if "_exps" in name or "ffn_gate_inp." in name}
    rewrite_gguf(src, path, meta={"qwen35moe.expert_count": DROP}, tensors=drop)
    return path


@pytest.mark.parametrize("args, message", [
    (["--keep", 9], "--keep 9: the model has only 8 experts a layer"),
    (["--keep", 1], "--keep 1: below the 2 experts each token is routed to"),
    (["--keep", 4, "--calib-tokens", 6], "never routed a token to layer 0: experts"),
    (["--keep", 4, "--method", "frequency"], "--method frequency needs a calibration text"),
    (["--keep", 4, "--method", "best"], "--method 'best': choose one of reap, frequency, random"),
    (["--keep", 4, "--model-is-out"], "the output must not be the model it is pruned from"),
    (["--keep", 4, "--no-experts"], "the model has no experts to prune"),
])
def test_refusals_are_one_line_and_leave_no_file(tiny_f32_path, tmp_path, args, message):
    model, out, extra = tiny_f32_path, tmp_path / "out.gguf", []
    calib = tmp_path / "calib.txt"
    calib.write_text(Model(tiny_f32_path).tokenizer.decode(CALIB))
    if "--model-is-out" in args:
        out = tmp_path / "same.gguf"
        out.write_bytes(tiny_f32_path.read_bytes())
        model = out
    if "--no-experts" in args:
        model = _no_experts(tiny_f32_path, tmp_path / "dense.gguf")
    if "--method" not in args:
        extra = ["--calib", calib]
    args = [a for a in args if a not in ("--model-is-out", "--no-experts")]
    before = set(tmp_path.iterdir())
    run = fermoe("prune", model, "-o", out, "--scores", tmp_path / "s.json", *extra, *args, check=False)
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1].startswith("fermoe: error: ")
    assert message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert set(tmp_path.iterdir()) == before                 # no output, no scores, no temporary file


def test_unseen_experts_are_named(tiny_f32_path):
    model = Model(tiny_f32_path)
    stats = expert_stats(model, CALIB[:6], progress=False)
    with pytest.raises(FermoeError) as e:
        check_seen(stats)
    unseen = stats.unseen()
    assert unseen and "6 tokens" in str(e.value)           # 6 tokens x top-2 cannot reach 8 experts everywhere
    for layer, experts in unseen.items():
        assert set(experts) == set(np.flatnonzero(stats.count[layer] == 0))
        assert f"layer {layer}: experts {', '.join(map(str, experts))}" in str(e.value)


def test_allow_unseen_prunes_the_unseen_experts_first(tiny_f32_path, tmp_path):
    model = Model(tiny_f32_path)
    text = model.tokenizer.decode(CALIB)
    few = 6                      # 6 tokens x top-2: some experts of some layer are never reached
    stats = expert_stats(model, model.tokenizer.encode(text)[:few], progress=False)
    unseen = stats.unseen()
    assert unseen
    keep = 8 - max(len(e) for e in unseen.values())
    kept, _ = prune(tiny_f32_path, tmp_path / "p.gguf", keep, "reap", text, calib_tokens=few, progress=False,
                    allow_unseen=True)
    for layer, experts in unseen.items():
        assert not set(experts) & set(kept[layer].tolist())


def test_the_cli_writes_the_scores(tiny_f32_path, tmp_path):
    import json
    calib = tmp_path / "calib.txt"
    calib.write_text(Model(tiny_f32_path).tokenizer.decode(CALIB))
    run = fermoe("prune", tiny_f32_path, "--keep", 6, "-o", tmp_path / "p.gguf", "--calib", calib,
                 "--scores", tmp_path / "s.json", check=False)
    assert run.returncode == 0, run.stderr
    doc = json.loads((tmp_path / "s.json").read_text())
    model = Model(tiny_f32_path)
    stats = expert_stats(model, model.tokenizer.encode(calib.read_text()), progress=False)
    assert doc["method"] == "reap" and doc["calibration_tokens"] == stats.tokens
    for layer in doc["layers"]:
        np.testing.assert_allclose(layer["saliency"], stats.saliency[layer["layer"]], rtol=1e-6)
        assert layer["frequency"] == stats.count[layer["layer"]].tolist()
        assert layer["kept"] == sorted(np.argsort(-stats.saliency[layer["layer"]], kind="stable")[:6].tolist())
    assert Model(tmp_path / "p.gguf").config.n_expert == 6
