"""fermoe beside llama.cpp on the same machine, the same GGUF file: the GPU prefill at each
prompt length, and the decode (fermoe's hybrid and CPU-only beside llama.cpp's hybrid),
alternated in one run, as JSON.

llama.cpp runs as `llama-bench -ngl 99 -ot exps=CPU`: every layer on the GPU but the routed
experts, which stay in page-locked host memory (fermoe's own arrangement under --gpu-mem):
for a prompt they cross PCIe for each ubatch, for a decoded token they run on the CPU (its
hybrid decode). Each prompt length runs at several ubatch sizes and the fastest counts ("its
best ubatch"); llama.cpp has no memory cap, so its compute buffers may take what a budget
like fermoe's 6 GiB would not allow.

    python3 scripts/llama_cpp_compare.py prepare            # here, with network: the source
    python3 scripts/llama_cpp_compare.py run MODEL --prompt 947,8192,32768 --gpu-mem 6GiB --decode 64
    python3 scripts/llama_cpp_compare.py build              # llama-bench alone, ahead of `run`

`prepare` downloads the llama-cpp-python 0.3.36 sdist (`pip download --no-binary :all:`)
and keeps the llama.cpp it vendors, without its test models and documents, as
.llama-src/llama.cpp.tar.gz (git-ignored: a few MB, small enough to travel with the
working tree to a machine without network). `run` builds only the `llama-bench` target
with CUDA for the device's architecture, in the background while fermoe's first round
runs, then alternates llama.cpp and fermoe for --rounds rounds; with --decode N, then
N-token decodes: llama-bench's at one sequence, fermoe's `bench hybrid` at one and four.

JSON keys:
  model, gpu_mem, prompts       what was asked
  device                        the GPU's name (nvidia-smi)
  llama_cpp_build_s             s: building llama-bench (0 when the build was already there)
  rounds[]                      per round, per prompt length:
    .prompt_tokens
    .fermoe_s                   s: `fermoe bench prefill`'s prefill_s (median of its --reps)
    .fermoe                     that run's JSON (kernel families, memory plan, phases...)
    .llama_cpp_s                s: the fastest ubatch's mean prompt time
    .llama_cpp_ubatch           that ubatch
    .llama_cpp_by_ubatch        {ubatch: s} of every ubatch tried
    .ratio                      llama_cpp_s / fermoe_s (above 1: fermoe is faster)
  best                          per prompt length, the best of the rounds of each: fermoe_s,
                                llama_cpp_s, ratio
  decode                        with --decode N: tokens (N), llama_cpp_tok_s (llama-bench's mean
                                at one sequence), fermoe_batch_1 and fermoe_batch_4 (`fermoe bench
                                hybrid` at one and four sequences), hybrid_ratio_1 (fermoe's hybrid
                                tok/s at one sequence over llama.cpp's), hybrid_ratio_4 (fermoe's
                                four sequences' tok/s in all over llama.cpp's one)
  llama_cpp_error               only when llama-bench could not be built: why (the build log's
                                tail); rounds then holds fermoe's first round alone
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / ".llama-src" / "llama.cpp.tar.gz"
# not needed to build llama-bench: test vocabularies (75 MB), documents, the web UI, tests
DROP = ("models", "docs", "media", "benches", "tests", "gguf-py", "conversion", ".devops", ".github", "tools/ui",
        "examples", "pocs", "app")


def prepare(out: Path = SOURCE) -> Path:
    """The sdist's vendored llama.cpp, stripped, as a tar.gz at `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        return strip_sdist(next(Path(tmp).glob("llama_cpp_python-*.tar.gz")), out)


def strip_sdist(sdist: Path, out: Path) -> Path:
    """vendor/llama.cpp of the sdist, as llama.cpp/..., without DROP's folders or links."""
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz") as dst:
        for member in src.getmembers():
            if not member.name.startswith(prefix) or member.issym() or member.islnk():
                continue
            rel = member.name[len(prefix):]
            if not rel or any(rel == d or rel.startswith(d + "/") for d in DROP):
                continue
            data = src.extractfile(member) if member.isfile() else None
            member.name = "llama.cpp/" + rel
            member.pax_headers.pop("path", None)      # a long name's pax header would win over the new one
            dst.addfile(member, data)
    return out


def cuda_arch() -> str:
    """The device's compute capability as CMake spells it ("90" for an H100)."""
    cap = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                         text=True, check=True).stdout.split()[0]
    return cap.replace(".", "")


def device_name() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip().splitlines()[0]


def start_build(source: Path, build: Path) -> tuple[subprocess.Popen | None, Path]:
    """Configure and build llama-bench in the background; (None, binary) when built already."""
    binary = build / "bin" / "llama-bench"
    if binary.exists():
        return None, binary
    tree = build.parent / "llama.cpp"
    if not tree.exists():
        with tarfile.open(source) as t:
            t.extractall(build.parent, filter="data")
    configure = ["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch()}", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]
    script = f"{' '.join(configure)} && cmake --build {build} --target llama-bench -j {os.cpu_count()}"
    # at the lowest priority: fermoe's first round runs beside it and is timed
    build.mkdir(parents=True, exist_ok=True)
    log = open(build / "build.log", "w")
    return subprocess.Popen(["nice", "-n", "19", "bash", "-c", script], stdout=log, stderr=subprocess.STDOUT), binary


def ubatches(T: int) -> list[int]:
    """The ubatch sizes tried at T tokens, up to one ubatch for the prompt (the fastest at
    947 and 8192 tokens on an H100; llama.cpp's default of 512 re-streams the experts for
    every 512 tokens)."""
    return sorted({min(T, u) for u in (2048, 8192, 16384)})


def llama_bench(binary: Path, model: str, T: int, reps: int) -> dict[int, float]:
    """{ubatch: mean seconds} of T-token prompts, experts page-locked in host memory."""
    sizes = ubatches(T)
    cmd = [str(binary), "-m", model, "-ngl", "99", "-ot", "exps=CPU", "-lm", "none", "-p", str(T), "-n", "0",
           "-b", str(max(sizes)), "-ub", ",".join(map(str, sizes)), "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    return prompt_seconds(out.stdout, T)


def prompt_seconds(report: str, T: int) -> dict[int, float]:
    """{ubatch: mean seconds} of the T-token prompt tests in llama-bench's `-o json` report."""
    return {int(r["n_ubatch"]): r["avg_ns"] / 1e9 for r in json.loads(report)
            if r["n_prompt"] == T and r["n_gen"] == 0}


def llama_decode(binary: Path, model: str, n: int, reps: int) -> float:
    """llama-bench's tokens/s generating n tokens at one sequence, experts page-locked in host memory."""
    cmd = [str(binary), "-m", model, "-ngl", "99", "-ot", "exps=CPU", "-p", "0", "-n", str(n), "-r", str(reps),
           "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    return generation_tok_s(out.stdout, n)


def generation_tok_s(report: str, n: int) -> float:
    """The mean tokens/s of the n-token generation test in llama-bench's `-o json` report."""
    rows = [r for r in json.loads(report) if r["n_prompt"] == 0 and r["n_gen"] == n]
    if not rows:
        raise RuntimeError(f"llama-bench reported no {n}-token generation test")
    return float(rows[0]["avg_ts"])


def fermoe_decode(model: str, n: int, batch: int, gpu_mem: str) -> dict:
    cmd = [sys.executable, "-m", "fermoe.cli", "bench", "hybrid", model, "--tokens", str(n), "--batch", str(batch),
           "--gpu-mem", gpu_mem]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"fermoe bench hybrid failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def decode_rows(llama_tok_s: float, one: dict, four: dict, n: int) -> dict:
    """The decode comparison from llama.cpp's rate and fermoe's `bench hybrid` at one and four sequences."""
    return {"tokens": n, "llama_cpp_tok_s": round(llama_tok_s, 2), "fermoe_batch_1": one, "fermoe_batch_4": four,
            "hybrid_ratio_1": round(one["hybrid_process"]["tok_s"] / llama_tok_s, 3),
            "hybrid_ratio_4": round(four["hybrid_process"]["tok_s_aggregate"] / llama_tok_s, 3)}


def fermoe_prefill(model: str, T: int, gpu_mem: str, reps: int, profile: bool) -> dict:
    cmd = [sys.executable, "-m", "fermoe.cli", "bench", "prefill", model, "--prompt", str(T), "--gpu-mem", gpu_mem,
           "--reps", str(reps)] + ([] if profile else ["--no-profile"])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"fermoe bench prefill failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def run(model: str, prompts: list[int], gpu_mem: str, rounds: int, reps: int, source: Path, build: Path,
        profile_below: int, decode: int = 0) -> dict:
    t0 = time.perf_counter()
    builder, binary = start_build(source, build)
    results = {"model": model, "gpu_mem": gpu_mem, "prompts": prompts, "device": device_name(), "rounds": []}
    build_s = 0.0
    for r in range(rounds):
        rows = {T: {"prompt_tokens": T} for T in prompts}
        for T in prompts:        # fermoe first: the build runs beside the first round
            f = fermoe_prefill(model, T, gpu_mem, reps, profile=T <= profile_below)
            rows[T].update(fermoe_s=f["prefill_s"], fermoe=f)
            progress(fermoe_prefill=T, s=f["prefill_s"])
        if decode and r == 0:
            fermoe_decodes = [fermoe_decode(model, decode, b, gpu_mem) for b in (1, 4)]
            progress(fermoe_decode=fermoe_decodes)
        if builder is not None:
            if builder.wait():            # fermoe's figures still count: report them with the failure
                results["rounds"].append(list(rows.values()))
                results["llama_cpp_error"] = f"building llama-bench failed: {_tail(build / 'build.log')}"
                if decode:
                    results["decode"] = {"tokens": decode, "fermoe_batch_1": fermoe_decodes[0],
                                         "fermoe_batch_4": fermoe_decodes[1]}
                return results
            build_s, builder = time.perf_counter() - t0, None
        for T in prompts:
            by_ub = llama_bench(binary, model, T, reps)
            progress(llama_cpp_prefill=T, s_by_ubatch=by_ub)
            best = min(by_ub, key=by_ub.get)
            rows[T].update(llama_cpp_s=round(by_ub[best], 4), llama_cpp_ubatch=best,
                           llama_cpp_by_ubatch={str(k): round(v, 4) for k, v in by_ub.items()},
                           ratio=round(by_ub[best] / rows[T]["fermoe_s"], 3))
        results["rounds"].append(list(rows.values()))
        print(json.dumps({"round": r, "rows": [{k: v for k, v in row.items() if k != "fermoe"}
                                               for row in rows.values()]}), file=sys.stderr, flush=True)
    results["llama_cpp_build_s"] = round(build_s, 1)
    results["best"] = best_of(results["rounds"])
    if decode:
        results["decode"] = decode_rows(llama_decode(binary, model, decode, reps), *fermoe_decodes, decode)
    return results


def progress(**figures) -> None:
    """A figure as soon as it is measured, on stderr: a run cut short still tells what it had."""
    print(json.dumps(figures), file=sys.stderr, flush=True)


def _tail(log: Path, lines: int = 8) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def best_of(rounds: list[list[dict]]) -> dict[str, dict]:
    """Per prompt length, each side's fastest over the rounds and their ratio."""
    best = {}
    for row in (r for rnd in rounds for r in rnd):
        b = best.setdefault(str(row["prompt_tokens"]), {"fermoe_s": row["fermoe_s"], "llama_cpp_s": row["llama_cpp_s"]})
        b["fermoe_s"], b["llama_cpp_s"] = min(b["fermoe_s"], row["fermoe_s"]), min(b["llama_cpp_s"], row["llama_cpp_s"])
        b["ratio"] = round(b["llama_cpp_s"] / b["fermoe_s"], 3)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="download the llama.cpp source (needs network)")
    prep.add_argument("--out", type=Path, default=SOURCE)
    tree = argparse.ArgumentParser(add_help=False)          # where llama.cpp's source is and builds
    tree.add_argument("--source", type=Path, default=SOURCE)
    tree.add_argument("--build", type=Path, default=Path(tempfile.gettempdir()) / "llama-cpp" / "build")
    sub.add_parser("build", parents=[tree], help="only build llama-bench (ahead of `run`: start `run` once it "
                                                 "has finished, or `run` builds it again)")
    r = sub.add_parser("run", parents=[tree], help="build llama-bench and alternate it with fermoe's bench prefill")
    r.add_argument("model")
    r.add_argument("--prompt", default="947,8192,32768")
    r.add_argument("--gpu-mem", default="6GiB", help="fermoe's budget (llama.cpp has none)")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--reps", type=int, default=2, help="timed prefills a prompt length and round, each side")
    r.add_argument("--decode", type=int, default=0, metavar="N",
                   help="then N-token decodes: llama.cpp's hybrid at one sequence, fermoe's bench hybrid at 1 and 4")
    r.add_argument("--profile-below", type=int, default=32768,
                   help="fermoe's timing by phase and kernel for prompts up to N tokens (it costs two prefills)")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        print(prepare(args.out))
        return
    if shutil.which("nvidia-smi") is None:
        p.error(f"{args.cmd} needs an NVIDIA GPU (nvidia-smi)")
    if args.cmd == "build":
        t0 = time.perf_counter()
        builder, binary = start_build(args.source, args.build)
        if builder is not None and builder.wait():
            sys.exit(f"building llama-bench failed: {_tail(args.build / 'build.log')}")
        print(json.dumps({"binary": str(binary), "build_s": round(time.perf_counter() - t0, 1)}))
        return
    if not args.source.exists() and not (args.build / "bin" / "llama-bench").exists():
        p.error(f"{args.source} is missing: run `prepare` where there is network")
    prompts = [int(x) for x in args.prompt.split(",") if x]         # --prompt "": the decode alone
    if args.rounds < 1 or args.decode < 0:
        p.error("--rounds must be at least 1, --decode 0 or more")
    print(json.dumps(run(args.model, prompts, args.gpu_mem, args.rounds, args.reps, args.source, args.build,
                         args.profile_below, args.decode), indent=2))


if __name__ == "__main__":
    main()
