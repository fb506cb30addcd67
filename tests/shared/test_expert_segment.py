"""One copy of the experts in host RAM (shared/expert_segment.py): packed once into
shared memory, read from there by the CPU engine and streamed from there by the GPU
engine, with results bit for bit those of each engine reading the file."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from coordinator.memory import GPU_WORKER_SEQUENCES, host_footprint
from coordinator.placement import GPU_QUEUE
from cpu_worker.native_engine import NativeEngine
from shared.errors import FermoeError
from shared.expert_segment import (EXPERT_TENSORS, ExpertSegment, RecordLayout, expert_nbytes, expert_tensor_names,
                                   unshareable)
from shared.ggml_types import GGMLType
from shared.model import Model

PROMPT = [3 + (7 * i) % 200 for i in range(37)]


@pytest.fixture
def model(tiny_q4_path):
    return Model(str(tiny_q4_path))


@pytest.fixture
def segment(model):
    seg = ExpertSegment.create(model)
    yield seg
    seg.close()
    seg.unlink()


def test_each_layer_holds_every_expert_as_a_gate_up_down_record(model, segment):
    other = ExpertSegment.attach(segment.name, model)
    lay = RecordLayout.of(model.layers[0])
    for L in (0, len(model.layers) - 1):
        for name in EXPERT_TENSORS:
            w = getattr(model.layers[L], name)
            per = len(w.raw) // w.shape[0]
            packed, stride = other.matrix(L, name)
            assert stride == lay.record_bytes
            for e in (0, 1, w.shape[0] - 1):
                assert np.array_equal(packed[e * stride:e * stride + per], w.raw[e * per:(e + 1) * per]), (L, name, e)
    assert expert_nbytes(model) == len(model.layers) * model.config.n_expert * lay.record_bytes
    other.close()


def test_the_cpu_engine_reading_the_segment_computes_what_it_computes_from_the_file(model, segment):
    own = NativeEngine(model, threads=1)
    shared = NativeEngine(model, threads=1, experts=ExpertSegment.attach(segment.name, model))
    try:
        assert np.array_equal(own.forward(PROMPT, own.new_state()), shared.forward(PROMPT, shared.new_state()))
    finally:
        own.close()
        shared.close()


@pytest.mark.parametrize("resident", [True, False])
def test_the_gpu_engine_streaming_from_the_segment_computes_what_it_computes_from_its_copy(model, segment,
                                                                                          monkeypatch, resident):
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    from gpu_worker.engine import GPUEngine
    own = GPUEngine(model, gpu_mem=128 << 20, resident=resident)
    shared = GPUEngine(model, gpu_mem=128 << 20, resident=resident,
                       shared_experts=ExpertSegment.attach(segment.name, model))
    try:
        assert np.array_equal(own.forward(PROMPT, own.new_state()), shared.forward(PROMPT, shared.new_state()))
        assert shared.experts.host_bytes == 0                   # no page-locked copy of its own
        assert own.experts.host_bytes == (0 if resident else expert_nbytes(model))
    finally:
        own.close()
        shared.close()


def test_a_worker_skips_the_files_expert_pages(model):
    """populate(skip) leaves out whole pages of the experts, and reads every page holding
    anything else."""
    names = expert_tensor_names(model)
    ranges = model.file._ranges_without(names)
    page = mmap.PAGESIZE
    covered = np.zeros(-(-len(model.file._mm) // page), bool)
    for start, length in ranges:
        assert start % page == 0
        covered[start // page:-(-(start + length) // page)] = True
    for name, t in model.file.tensors.items():
        pages = covered[t.offset // page:-(-(t.offset + t.nbytes) // page)]
        if name in names:
            assert not pages[1:-1].any(), name                  # its inner pages are never read
        else:
            assert pages.all(), name
    assert model.file.populate(skip=names) in (True, False)


def test_what_cannot_be_shared_is_named(model, monkeypatch):
    assert unshareable(model) is None
    gate = model.layers[1].ffn_gate_exps
    monkeypatch.setattr(gate, "qtype", GGMLType.Q4_K)
    assert "Q4_K" in unshareable(model)
    with pytest.raises(FermoeError, match="cannot be shared between workers"):
        ExpertSegment.create(model)


def test_the_memory_plan_counts_a_gpu_workers_host_memory():
    """Its prompts' state and landing rows as sequences; its page-locked experts unless shared."""
    file, experts = 10 << 30, 9 << 30
    assert host_footprint(file, experts, 4, 0, shared_experts=False) == (file, 4)
    assert host_footprint(file, experts, 4, 1, shared_experts=True) == (file, 4 + GPU_WORKER_SEQUENCES)
    assert host_footprint(file, experts, 4, 2, shared_experts=False) == (file + 2 * experts,
                                                                          4 + 2 * GPU_WORKER_SEQUENCES)
    store = 8 << 30                  # page-locked whole by a GPU worker; filled as used without one
    assert host_footprint(file, experts, 4, 1, shared_experts=True, snapshot_bytes=store)[0] == file + store
    assert host_footprint(file, experts, 4, 0, shared_experts=False, snapshot_bytes=store)[0] == file
    # a batch of GPU_QUEUE prompts: each past the first adds its recurrent state and its landing
    state = 7 << 20
    assert host_footprint(file, experts, 4, 2, shared_experts=True, state_bytes=state)[0] == (
        file + 2 * (GPU_QUEUE - 1) * 2 * state)
