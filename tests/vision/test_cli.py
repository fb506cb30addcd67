"""--mmproj as a user gives it: `fermoe synth` and `fermoe convert` write the tower beside the
model, the commands that open a model check the tower against it, `fermoe bench vision`
prints its JSON."""
from __future__ import annotations

import json

import pytest

from shared.vision.mmproj import Mmproj
from modeltools.vision.synth import preset_config, synth_mmproj
from tests.support.bench_keys import assert_keys_documented
from tests.support.serving_harness import fermoe


def test_synth_writes_a_tower_for_the_model(tmp_path):
    model, tower = tmp_path / "m.gguf", tmp_path / "mmproj.gguf"
    fermoe("synth", model, "--layers", 2, "--mmproj", tower, "--mmproj-type", "q8_0")
    mm = Mmproj(tower)
    assert mm.config == preset_config("tiny", projection_dim=256)
    out = tmp_path / "logits.npy"
    fermoe("logits", model, "--mmproj", tower, "--tokens", "1,2,3", "--out", out, "--engine", "reference")


def test_a_tower_that_is_not_the_model_s_is_one_error(tiny_path, tmp_path):
    other = tmp_path / "other.gguf"
    synth_mmproj(other, preset_config("tiny", projection_dim=64))
    run = fermoe("generate", tiny_path, "--mmproj", other, "-p", "hi", "-n", 1, check=False)
    assert run.returncode == 1
    assert run.stderr.strip().endswith(f"embedding_length 256: not its vision tower")
    assert run.stderr.count("\n") == 1 and "projection_dim is 64" in run.stderr
    run = fermoe("logits", tiny_path, "--mmproj", tiny_path, "--tokens", "1", "--out", tmp_path / "x.npy",
                 check=False)
    assert run.returncode == 1 and "not 'clip': not an mmproj (vision) file" in run.stderr
    run = fermoe("generate", tiny_path, "--mmproj", tmp_path / "absent.gguf", "-p", "hi", check=False)
    assert run.returncode == 1 and "absent.gguf: cannot open" in run.stderr


@pytest.mark.oracle
def test_convert_writes_the_tower_beside_the_model(tmp_path):
    vo = pytest.importorskip("tests.support.vision_oracle")
    d = tmp_path / "hf"
    vo.save_multimodal(d, seed=2)
    text, tower = tmp_path / "m.gguf", tmp_path / "mmproj.gguf"
    fermoe("convert", d, text, "--type", "q8_0", "--mmproj", tower)
    assert Mmproj(tower).config.projection_dim == 64
    fermoe("logits", text, "--mmproj", tower, "--tokens", "1,2", "--out", tmp_path / "l.npy", "--engine", "reference")
    (d / "preprocessor_config.json").unlink()
    run = fermoe("convert", d, tmp_path / "again.gguf", "--mmproj", tmp_path / "t2.gguf", check=False)
    assert run.returncode == 1 and "no preprocessor_config.json" in run.stderr
    assert not (tmp_path / "again.gguf").exists()       # refused before the text model is written


def test_bench_vision_prints_json():
    import bench.vision
    out = json.loads(fermoe("bench", "vision", "--preset", "tiny", "--sizes", "96x64", "-t", 1,
                            env={"FERMOE_GPU": None}).stdout)
    (image,) = out["images"]
    assert out["threads"] == 1 and image["grid"] == [14, 20] and image["tokens"] == 70 and image["encode_s"] > 0
    if isinstance(out["gpu"], str):                 # no pycuda or no CUDA device: said so
        assert out["gpu"].startswith("not measured: no GPU here (")
    else:
        assert out["gpu"]["device"] != "host emulation" and out["gpu"]["images"][0]["encode_s"] > 0
    assert_keys_documented(out, bench.vision)
    emulated = json.loads(fermoe("bench", "vision", "--preset", "tiny", "--sizes", "96x64", "-t", 1, "--repeat", 1,
                                 env={"FERMOE_GPU": "emulate"}).stdout)["gpu"]
    (image,) = emulated["images"]
    assert emulated["device"] == "host emulation" and emulated["matrix_types"] == ["f32"]
    assert image["size"] == "96x64" and image["encode_s"] > 0 and image["max_diff_vs_cpu"] < 1e-4
    assert {"upload", "gemm", "attention", "layernorm", "qkv_rope", "bias_act", "download"} == set(image["kernel_ms"])
    assert_keys_documented(emulated, bench.vision, prefix="gpu")
    off = json.loads(fermoe("bench", "vision", "--preset", "tiny", "--sizes", "64x64", "--gpu", "off").stdout)
    assert off["gpu"] == "not measured: --gpu off"
    run = fermoe("bench", "vision", "--sizes", "big", check=False)
    assert run.returncode == 2 and "expected WIDTHxHEIGHT" in run.stderr


def _png(path, seed: int, size=(256, 256)):
    from PIL import Image
    import numpy as np
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, size + (3,), dtype=np.uint8)).save(path)
    return path


def test_generate_and_logits_take_images(tmp_path):
    import numpy as np
    model, tower = tmp_path / "m.gguf", tmp_path / "mmproj.gguf"
    fermoe("synth", model, "--layers", 2, "--mmproj", tower, "--mmproj-type", "f32")
    a, b = _png(tmp_path / "a.png", 1), _png(tmp_path / "b.png", 2)
    out = tmp_path / "l.npy"
    fermoe("logits", model, "--mmproj", tower, "--chat", "--image", a, "--image", b, "--prompt", "hi",
           "--out", out, "-t", 1)
    text_only = tmp_path / "t.npy"
    fermoe("logits", model, "--chat", "--prompt", "hi", "--out", text_only, "-t", 1)
    # 256 x 256 (the fewest pixels taken as they are): 16 x 16 patches, 64 merged tokens; each
    # image adds <|vision_start|>, them and <|vision_end|> to the text-only prompt
    assert np.load(out).shape[0] == np.load(text_only).shape[0] + 2 * (1 + 64 + 1)
    fermoe("logits", model, "--mmproj", tower, "--chat", "--image", b, "--image", b, "--prompt", "hi",
           "--out", tmp_path / "bb.npy", "-t", 1)
    ab, bb = np.load(out), np.load(tmp_path / "bb.npy")
    from shared.model import Model
    tok = Model(model).tokenizer                # the first image token: after the user turn's opening
    first_image_pad = tok.encode(tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])) \
        .index(tok.token_to_id["<|image_pad|>"])
    np.testing.assert_array_equal(ab[:first_image_pad], bb[:first_image_pad])
    assert np.abs(ab[first_image_pad:] - bb[first_image_pad:]).max(axis=1).min() > 0   # every later position
    run = fermoe("generate", model, "--mmproj", tower, "--chat", "--image", a, "-p", "hi", "-n", 4, "--temp", 0,
                 "--ignore-eos", "-t", 1)
    assert run.stdout.strip()


def test_engine_gpu_takes_images(tmp_path):
    """`--engine gpu` (the host emulation) prefills an image prompt: the reference's logits,
    and generate's tokens those of the CPU engine."""
    import numpy as np
    from tests.gpu_worker.test_engine import GPU_RTOL, close
    model, tower = tmp_path / "m.gguf", tmp_path / "mmproj.gguf"
    fermoe("synth", model, "--layers", 2, "--mmproj", tower, "--type", "f32", "--mmproj-type", "f32")
    args = ("--mmproj", tower, "--chat", "--image", _png(tmp_path / "a.png", 1), "-t", 1, "--kv-cache-dtype", "f32")
    emulate = {"FERMOE_GPU": "emulate"}
    for engine in ("gpu", "reference"):
        fermoe("logits", model, *args, "--prompt", "hi", "--out", tmp_path / f"{engine}.npy", "--engine", engine,
               env=emulate)
    close(np.load(tmp_path / "gpu.npy"), np.load(tmp_path / "reference.npy"), GPU_RTOL)
    gen = ("generate", model, *args, "-p", "hi", "-n", 6, "--temp", 0, "--ignore-eos")
    on_gpu = fermoe(*gen, "--engine", "gpu", env=emulate)
    assert on_gpu.stdout.strip() and on_gpu.stdout == fermoe(*gen, "--engine", "cpu").stdout


def test_engine_gpu_runs_the_tower_on_its_device(tmp_path, monkeypatch):
    """With --engine gpu and images, the tower goes on the prefill engine's device (and is
    what encodes them); without images no tower is put there."""
    from fermoe.cli import build_parser
    from fermoe.commands.common import image_encoder, open_model
    from gpu_worker.vision import GPUVisionEngine
    model, tower = tmp_path / "m.gguf", tmp_path / "mmproj.gguf"
    fermoe("synth", model, "--layers", 1, "--mmproj", tower)
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    base = ["generate", str(model), "--mmproj", str(tower), "--chat", "-p", "hi", "--engine", "gpu", "-t", "1"]
    args = build_parser().parse_args(base + ["--image", str(_png(tmp_path / "a.png", 1))])
    m, engine = open_model(args)
    encoder, close = image_encoder(args, m)
    assert isinstance(m.gpu_vision, GPUVisionEngine) and m.gpu_vision.device is engine.device
    assert encoder.forward == m.gpu_vision.encode
    close()
    engine.close()
    m, engine = open_model(build_parser().parse_args(base))
    assert m.gpu_vision is None
    engine.close()


@pytest.mark.parametrize("args, problem", [
    (["--image", "{a}", "-p", "hi"], "--image needs --chat"),
    (["--chat", "--image", "{a}", "-p", "hi"], "--image needs --mmproj FILE"),
    (["--chat", "--mmproj", "{t}", "--image", "{missing}", "-p", "hi"], "missing.png: No such file"),
    (["--chat", "--mmproj", "{t}", "--image", "{bad}", "-p", "hi"], "image 1: not a PNG or JPEG image"),
])
def test_bad_image_options_are_one_error(tmp_path, args, problem):
    model, tower = tmp_path / "m.gguf", tmp_path / "mmproj.gguf"
    fermoe("synth", model, "--layers", 1, "--mmproj", tower)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    paths = dict(a=_png(tmp_path / "a.png", 1), t=tower, missing=tmp_path / "missing.png", bad=tmp_path / "bad.png")
    run = fermoe("generate", model, *[str(x).format(**paths) for x in args], "-n", 1, check=False)
    assert run.returncode == 1 and problem in run.stderr and run.stderr.count("\n") == 1, run.stderr
