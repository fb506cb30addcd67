"""--mmproj as a user gives it: `fermoe synth` and `fermoe convert` write the tower beside the
model, the commands that open a model check the tower against it, `fermoe bench vision`
prints its JSON."""
from __future__ import annotations

import json

import pytest

from shared.vision.mmproj import Mmproj
from shared.vision.synth import preset_config, synth_mmproj
from tests.serving_harness import fermoe


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
    vo = pytest.importorskip("tests.vision_oracle")
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
    out = json.loads(fermoe("bench", "vision", "--preset", "tiny", "--sizes", "96x64", "-t", 1).stdout)
    (image,) = out["images"]
    assert out["threads"] == 1 and image["grid"] == [14, 20] and image["tokens"] == 70 and image["encode_s"] > 0
    run = fermoe("bench", "vision", "--sizes", "big", check=False)
    assert run.returncode == 2 and "expected WIDTHxHEIGHT" in run.stderr
