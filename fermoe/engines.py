"""`--engine NAME`: the engines by name (shared/engine.py declares their interface).

cpu and reference run in the CPU workers (cpu_worker.engines); gpu is the GPU
prefill engine, whose states the CPU engine decodes on from; hybrid prefills on the GPU
and decodes with each token's dense part there and its routed experts on the CPU engine
(gpu_worker/hybrid.py), going on on the CPU alone if a step fails."""
from __future__ import annotations

from cpu_worker.engines import CPU_ENGINES, cpu_engine
from shared.errors import FermoeError
from shared.model import Model
from shared.state import DEFAULT_KV_DTYPE

ENGINES = (*CPU_ENGINES, "gpu", "hybrid")


def load_engine(name: str, model: Model, threads: int | None = None, cpus: list[int] | None = None,
                kv_cache_dtype: str = DEFAULT_KV_DTYPE, gpu_mem: int | None = None, gpu: int = 0, **gpu_options):
    """An engine whose new states keep their KV cache in `kv_cache_dtype` (f16, f32)."""
    if name == "gpu":
        from gpu_worker.engine import GPUEngine
        return GPUEngine(model, gpu_mem=gpu_mem, gpu=gpu, kv_cache_dtype=kv_cache_dtype, **gpu_options)
    if name == "hybrid":
        from gpu_worker.engine import GPUEngine
        from gpu_worker.hybrid import HybridEngine, HybridWithFallback
        cpu = cpu_engine("cpu", model, threads=threads, cpus=cpus, kv_cache_dtype=kv_cache_dtype)
        try:
            device = GPUEngine(model, gpu_mem=gpu_mem, gpu=gpu, kv_cache_dtype=kv_cache_dtype, **gpu_options)
        except BaseException:
            cpu.close()
            raise
        return HybridWithFallback(HybridEngine(device, cpu.routed_experts), cpu)
    if name in CPU_ENGINES:
        return cpu_engine(name, model, threads=threads, cpus=cpus, kv_cache_dtype=kv_cache_dtype)
    raise FermoeError(f"--engine {name!r}: not available; choose one of {', '.join(ENGINES)}")
