"""The engines a CPU worker runs: the native W4A8 engine, or the numpy reference."""
from __future__ import annotations

from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from shared.model import Model
from shared.state import DEFAULT_KV_DTYPE

CPU_ENGINES = ("cpu", "reference")


def cpu_engine(name: str, model: Model, threads: int | None = None, cpus: list[int] | None = None,
               kv_cache_dtype: str = DEFAULT_KV_DTYPE, experts=None):
    """experts: an ExpertSegment the native engine reads the routed experts from (the
    reference reads the file's)."""
    if name == "reference":
        return ReferenceEngine(model, kv_cache_dtype=kv_cache_dtype)
    if name == "cpu":
        from .native_engine import NativeEngine
        return NativeEngine(model, threads=threads, cpus=cpus, kv_cache_dtype=kv_cache_dtype, experts=experts)
    raise FermoeError(f"--engine {name!r}: a CPU worker runs {' or '.join(CPU_ENGINES)}")
