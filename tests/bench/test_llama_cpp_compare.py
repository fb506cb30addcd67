"""scripts/llama_cpp_compare.py's parts that need no GPU: the source it keeps of the
sdist, the ubatches it tries, how it reads llama-bench's report and picks the best."""
from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("llama_cpp_compare", ROOT / "scripts" / "llama_cpp_compare.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def _tar(path: Path, files: dict[str, bytes], links: dict[str, str] = {}) -> None:
    with tarfile.open(path, "w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for name, target in links.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            t.addfile(info)


def test_the_source_keeps_vendored_llama_cpp_without_its_test_models(tmp_path):
    """Guards the carried source: llama.cpp's build files stay (CMakeLists, ggml, tools), the
    75 MB of test vocabularies, docs, the web UI and links go, the rest of the sdist too."""
    top = f"llama_cpp_python-{script.VERSION}"
    vendored = f"{top}/vendor/llama.cpp"
    _tar(tmp_path / "sdist.tar.gz", {
        f"{top}/pyproject.toml": b"x", f"{vendored}/CMakeLists.txt": b"cmake", f"{vendored}/ggml/src/a.cu": b"cu",
        f"{vendored}/tools/llama-bench/llama-bench.cpp": b"bench", f"{vendored}/models/ggml-vocab.gguf": b"big",
        f"{vendored}/docs/build.md": b"doc", f"{vendored}/tools/ui/index.html": b"ui",
        f"{vendored}/modelsnot/kept.txt": b"kept", f"{vendored}/ggml/{'t' * 120}.cu": b"long"},
        links={f"{vendored}/link": "CMakeLists.txt"})
    out = script.strip_sdist(tmp_path / "sdist.tar.gz", tmp_path / "out" / "llama.cpp.tar.gz")
    with tarfile.open(out) as t:
        names = sorted(t.getnames())
        assert t.extractfile("llama.cpp/tools/llama-bench/llama-bench.cpp").read() == b"bench"
    # a name past tar's 100 characters travels in a pax header, which must be renamed too
    assert names == ["llama.cpp/CMakeLists.txt", "llama.cpp/ggml/src/a.cu", f"llama.cpp/ggml/{'t' * 120}.cu",
                     "llama.cpp/modelsnot/kept.txt", "llama.cpp/tools/llama-bench/llama-bench.cpp"]


def test_ubatches_reach_one_ubatch_for_the_prompt():
    assert script.ubatches(947) == [947]
    assert script.ubatches(8192) == [2048, 8192]
    assert script.ubatches(131072) == [2048, 8192, 16384]


def test_the_report_and_the_best_of_the_rounds():
    """Guards against timing the wrong test of a report (a generation test, another prompt)
    and against a best that mixes up the two sides."""
    report = json.dumps([
        {"n_prompt": 8192, "n_gen": 0, "n_ubatch": 2048, "avg_ns": 1_500_000_000},
        {"n_prompt": 8192, "n_gen": 0, "n_ubatch": 8192, "avg_ns": 1_000_000_000},
        {"n_prompt": 0, "n_gen": 128, "n_ubatch": 8192, "avg_ns": 9_000_000_000},
        {"n_prompt": 947, "n_gen": 0, "n_ubatch": 947, "avg_ns": 250_000_000}])
    assert script.prompt_seconds(report, 8192) == {2048: 1.5, 8192: 1.0}
    rounds = [[{"prompt_tokens": 8192, "fermoe_s": 1.2, "llama_cpp_s": 1.1}],
              [{"prompt_tokens": 8192, "fermoe_s": 0.9, "llama_cpp_s": 1.05}]]
    assert script.best_of(rounds) == {"8192": {"fermoe_s": 0.9, "llama_cpp_s": 1.05, "ratio": 1.167}}


def test_the_decode_rate_is_read_from_llama_benchs_generation_test():
    """Guards the decode figure: the n-token generation row's mean tokens/s, not a prompt row's;
    a report without that row is an error naming it."""
    report = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ns": 1e9, "avg_ts": 512.0},
                         {"n_prompt": 0, "n_gen": 64, "avg_ns": 1.2e9, "avg_ts": 53.3}])
    assert script.generation_tok_s(report, 64) == 53.3
    try:
        script.generation_tok_s(report, 128)
    except RuntimeError as e:
        assert "no 128-token generation test" in str(e)
    else:
        raise AssertionError("a missing generation test passed")


def test_the_decode_comparison_divides_fermoes_hybrid_by_llama_cpps():
    """Guards the ratios: the hybrid across processes (what serving runs), one sequence's rate
    and four sequences' rate in all, each over llama.cpp's one sequence."""
    one = {"hybrid_process": {"tok_s": 80.0, "tok_s_aggregate": 80.0}}
    four = {"hybrid_process": {"tok_s": 40.0, "tok_s_aggregate": 160.0}}
    row = script.decode_rows(50.0, one, four, 64)
    assert (row["hybrid_ratio_1"], row["hybrid_ratio_4"], row["tokens"]) == (1.6, 3.2, 64)
