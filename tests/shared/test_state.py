"""The sequence state (shared/state.py): saved, restored and copied without changing a
result; snapshot slots that restore a state continuing bit for bit; the KV cache's dtype."""
from __future__ import annotations

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.model import Model
from shared.state import (SequenceState, StateError, kv_slot_nbytes, recurrent_nbytes, restore_snapshots,
                          state_slot_nbytes, write_snapshot)
from tests.shared.test_reference import PROMPT


@pytest.fixture(scope="module")
def engine(tiny_path):
    return ReferenceEngine(Model(tiny_path))


def test_state_save_restore_continues_identically(engine, tmp_path):
    state = engine.new_state()
    engine.forward(PROMPT[:12], state)
    state.save(tmp_path / "seq.state")
    straight = engine.forward(PROMPT[12:], state)

    cfg, fp = engine.model.config, engine.model.fingerprint
    restored = SequenceState.load(tmp_path / "seq.state", cfg, fp)
    assert restored.position == 12
    np.testing.assert_array_equal(engine.forward(PROMPT[12:], restored), straight)


def test_copy_is_independent(engine):
    state = engine.new_state()
    engine.forward(PROMPT[:10], state)
    fork = state.copy()
    a = engine.forward([5, 6], state)
    engine.forward([200, 201, 202], fork)          # the fork moves on; the original must not see it
    state2 = engine.new_state()
    engine.forward(PROMPT[:10], state2)
    np.testing.assert_array_equal(engine.forward([5, 6], state2), a)


def test_state_refuses_another_model(engine, tmp_path):
    state = engine.new_state()
    engine.forward(PROMPT[:3], state)
    state.save(tmp_path / "seq.state")
    with pytest.raises(StateError, match="belongs to model"):
        SequenceState.load(tmp_path / "seq.state", engine.model.config, "0123456789abcdef")
    data = (tmp_path / "seq.state").read_bytes()
    (tmp_path / "cut.state").write_bytes(data[:-10])
    with pytest.raises(StateError, match="expected"):
        SequenceState.load(tmp_path / "cut.state", engine.model.config, engine.model.fingerprint)
    (tmp_path / "junk.state").write_bytes(b"x" * len(data))
    with pytest.raises(StateError, match="magic"):
        SequenceState.load(tmp_path / "junk.state", engine.model.config, engine.model.fingerprint)


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_snapshots_restore_a_state_that_continues_identically(tiny_path, kv):
    """A chain of KV slots (each block's KV) and the state slot of its last snapshot
    restore to a state whose continuation is bitwise the original's; the KV links are
    written from the pages after the prompt passed them, with no state of their own."""
    engine = ReferenceEngine(Model(tiny_path), kv_cache_dtype=kv)
    cfg, fp, block = engine.model.config, engine.model.fingerprint, 8
    state = engine.new_state()
    engine.forward(PROMPT[:19], state)
    kv_slots = [bytearray(kv_slot_nbytes(cfg, block, kv)) for _ in range(3)]
    for slot, position in zip(kv_slots, (8, 16)):    # two full blocks: links, written past them
        write_snapshot(state, slot, None, block, position)
    state_slot = bytearray(state_slot_nbytes(cfg))
    write_snapshot(state, kv_slots[2], state_slot, block)          # the partial one, and the state
    assert len(state_slot) == recurrent_nbytes(cfg)
    restored = restore_snapshots(cfg, fp, kv_slots, state_slot, block, kv)
    assert restored.position == 19 and restored.kv.dtype == state.kv.dtype
    spare = bytearray(b"\xff") * len(restored.buffer)           # a finished sequence's buffer, reused
    again = restore_snapshots(cfg, fp, kv_slots, state_slot, block, kv, buffer=spare)
    assert again.buffer is spare and bytes(spare) == bytes(restored.buffer)
    np.testing.assert_array_equal(engine.forward(PROMPT[19:], restored), engine.forward(PROMPT[19:], state))
    other = "f32" if kv == "f16" else "f16"
    with pytest.raises(StateError, match=f"expected {other}"):
        restore_snapshots(cfg, fp, kv_slots, state_slot, block, other)


def test_snapshot_slots_of_the_wrong_geometry_are_refused(engine):
    """A chain with a gap, a state at another position, slots too small, a state slot
    missing, a state written away from its own position: each a StateError naming it."""
    cfg, fp, block = engine.model.config, engine.model.fingerprint, 8
    state = engine.new_state()
    engine.forward(PROMPT[:19], state)
    kv_slots = [bytearray(kv_slot_nbytes(cfg, block)) for _ in range(3)]
    for slot, position in zip(kv_slots, (8, 16, 19)):
        write_snapshot(state, slot, None, block, position)
    state_slot = bytearray(state_slot_nbytes(cfg))
    write_snapshot(state, None, state_slot, block)
    with pytest.raises(StateError, match="chain broken: a page starts at 16, expected 8"):
        restore_snapshots(cfg, fp, [kv_slots[0], kv_slots[2]], state_slot, block)
    with pytest.raises(StateError, match="cover 16 positions, the state is at 19"):
        restore_snapshots(cfg, fp, kv_slots[:2], state_slot, block)
    with pytest.raises(StateError, match="a resume needs its KV slots and a state slot"):
        restore_snapshots(cfg, fp, kv_slots, None, block)
    with pytest.raises(StateError, match="state slot of 100 bytes"):
        restore_snapshots(cfg, fp, kv_slots, state_slot[:100], block)
    with pytest.raises(StateError, match="a KV slot of 100 bytes"):
        restore_snapshots(cfg, fp, [kv_slots[0][:100]], state_slot, block)
    with pytest.raises(StateError, match="state slot at position 16 written from a state at 19"):
        write_snapshot(state, kv_slots[1], state_slot, block, 16)
    with pytest.raises(StateError, match="KV slot of .* bytes; .* block of 16"):
        write_snapshot(state, kv_slots[0], None, 16)


def test_f16_kv_cache_holds_rounded_values_and_halves_the_snapshot(tiny_path):
    model = Model(tiny_path)
    f16, f32 = (ReferenceEngine(model, kv_cache_dtype=kv) for kv in ("f16", "f32"))
    a, b = f16.new_state(), f32.new_state()
    f16.forward(PROMPT, a)
    f32.forward(PROMPT, b)
    assert a.kv.k_pages[0][0].dtype == np.float16 and b.kv.k_pages[0][0].dtype == np.float32
    k16, k32 = a.kv.view(0)[0], b.kv.view(0)[0]
    np.testing.assert_array_equal(k16, k16.astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(k16, k32, rtol=2e-3, atol=1e-3 * np.abs(k32).max())
    cfg = model.config
    kv_bytes = {kv: kv_slot_nbytes(cfg, 8, kv) - kv_slot_nbytes(cfg, 0, kv) for kv in ("f16", "f32")}
    assert kv_bytes["f32"] == 2 * kv_bytes["f16"] > 0
    with pytest.raises(Exception, match="KV cache dtype 'bf16'"):
        ReferenceEngine(model, kv_cache_dtype="bf16")


@pytest.mark.parametrize("n", [0, 5, 8, 13, 16])
def test_a_cache_takes_anothers_prefix_a_page_at_a_time(engine, n):
    """take_prefix gives the rows the other cache holds, in its dtype, whatever the page
    boundaries, and is refused what the other does not hold or a cache of another shape."""
    state = SequenceState(engine.model.config, engine.model.fingerprint, kv_block=8)
    engine.forward(PROMPT[:16], state)
    taken = SequenceState(engine.model.config, engine.model.fingerprint, kv_block=8)
    taken.kv.take_prefix(state.kv, n)
    for layer in range(len(engine.model.config.attention_layers)):
        k, v = taken.kv.view(layer)
        want_k, want_v = state.kv.view(layer)
        np.testing.assert_array_equal(k, want_k[:n])
        np.testing.assert_array_equal(v, want_v[:n])
        assert len(taken.kv.k_pages[layer]) == -(-n // 8)
    with pytest.raises(StateError, match="17 positions asked"):
        SequenceState(engine.model.config, engine.model.fingerprint, kv_block=8).kv.take_prefix(state.kv, 17)
    with pytest.raises(StateError, match="same block and dtype"):
        SequenceState(engine.model.config, engine.model.fingerprint, kv_block=4).kv.take_prefix(state.kv, 4)


def test_the_header_is_read_and_written_by_name(engine):
    state = engine.new_state()
    engine.forward(PROMPT[:3], state)
    state.rope_delta = -7
    assert state.position == 3 and state.rope_delta == -7 and state.logits_valid
    copy = SequenceState(engine.model.config, engine.model.fingerprint, bytearray(state.buffer))
    assert (copy.position, copy.rope_delta, copy.fingerprint()) == (3, -7, engine.model.fingerprint)
