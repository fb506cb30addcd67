"""Images through the GPU prefill engine (host emulation): the multimodal logits of the tiny
random Qwen3_5MoeForConditionalGeneration (tests/vision_oracle.py) against the reference
engine's, whole and in passes that cut an image, in a batch beside a text prompt, the
state's rope delta and snapshots handed on; a text prompt bit for bit as without media."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.batch import PrefillJob
from gpu_worker.emulator import EmulatedDevice
from gpu_worker.engine import GPUEngine
from shared.engine import ReferenceEngine
from shared.reference import text_positions
from shared.vision.prompt import TokenMedia
from tests.gpu_worker.test_engine import close
from tests.support.bad_media import assert_refuses_bad_media
from tests.vision.test_prompt import LOGIT_RTOL, _check, _images, _prompt, mm  # noqa: F401 (a fixture)

vo = pytest.importorskip("tests.support.vision_oracle")


def gpu(model, **kw) -> GPUEngine:
    return GPUEngine(model, device=EmulatedDevice(), kv_cache_dtype="f32", **kw)


def reference(model, ids, media, state=None):
    ref = ReferenceEngine(model, kv_cache_dtype="f32")
    state = state or ref.new_state()
    return ref.forward(ids, state, media=media), state


@pytest.mark.parametrize("pass_tokens, gdn", [(None, "auto"), (7, "chunked"), (5, "recurrent")])
def test_multimodal_logits_match_the_reference(mm, pass_tokens, gdn):
    """Every position's logits, the prompt whole or in passes that cut its images; the state's
    rope delta and the snapshots' (inside an image, after it) are the reference's."""
    hf, model, tower = mm
    images = _images()
    ids, media = _prompt(model, tower, images)
    want, want_state = reference(model, ids, media)
    engine = gpu(model, max_pass_tokens=pass_tokens, gdn=gdn)
    state = engine.new_state()
    cuts = [int(media.rows[2]), int(media.rows[-1]) + 2, len(ids) - 1]
    logits, snaps = engine.prefill(ids, state, snapshot_at=cuts, all_logits=True, media=media)
    close(logits, want)
    _check(logits, vo.hf_multimodal_logits(hf, ids, images), LOGIT_RTOL)
    assert state.position == len(ids) and state.rope_delta == want_state.rope_delta < 0
    for q, snap in snaps.items():
        at, at_state = reference(model, ids[:q], media.slice(0, q))
        assert snap.position == q and snap.rope_delta == at_state.rope_delta
        close(snap.logits, at[-1])
        close(snap.ssm, at_state.ssm, floor=0.1)
    engine.close()


def test_text_after_an_image_goes_on_from_the_rope_delta(mm):
    """A prompt's last tokens prefilled as text after its image part (no media: positions
    from the state's rope delta), on the GPU and from a state the reference made."""
    _, model, tower = mm
    ids, media = _prompt(model, tower, _images())
    want, _ = reference(model, ids, media)
    n = int(media.rows[-1]) + 1             # the text after the last image
    engine = gpu(model)
    state = engine.new_state()
    engine.forward(ids[:n], state, media=media.slice(0, n))
    close(engine.forward(ids[n:], state), want[n:])
    _, resumed = reference(model, ids[:n], media.slice(0, n))
    close(engine.forward(ids[n:], resumed), want[n:])
    assert resumed.rope_delta == state.rope_delta != 0
    engine.close()


@pytest.mark.parametrize("pass_tokens", [None, 9])
def test_a_batch_mixing_text_and_image_prompts(mm, pass_tokens):
    """A text prompt, an image prompt and a resumed text-after-image one prefilled together:
    each gets its own logits, as the reference alone."""
    _, model, tower = mm
    ids, media = _prompt(model, tower, _images())
    text = list(range(5, 30))
    n = int(media.rows[-1]) + 1
    engine = gpu(model, max_pass_tokens=pass_tokens)
    _, resumed = reference(model, ids[:n], media.slice(0, n))
    jobs = [PrefillJob(text, engine.new_state()), PrefillJob(ids, engine.new_state(), media=media),
            PrefillJob(ids[n:], resumed)]
    results = engine.prefill_batch(jobs, all_logits=True)
    whole, _ = reference(model, ids, media)
    close(results[0][0], reference(model, text, None)[0])
    close(results[1][0], whole)
    close(results[2][0], whole[n:])
    assert jobs[1].state.rope_delta == jobs[2].state.rope_delta != 0
    assert jobs[0].state.rope_delta == 0
    engine.close()


def test_text_through_the_image_path_is_bit_for_bit_plain_text(mm):
    """Text positions and no image rows as media, alone and beside an image prompt: the
    text prompt's logits are those of the text path, bitwise."""
    _, model, tower = mm
    ids = list(range(5, 45))
    as_media = TokenMedia(text_positions(0, len(ids)), np.zeros(0, np.int64),
                          np.zeros((0, model.config.n_embd), np.float32))
    engine = gpu(model)
    plain = engine.forward(ids, engine.new_state())
    np.testing.assert_array_equal(engine.forward(ids, engine.new_state(), media=as_media), plain)
    img_ids, media = _prompt(model, tower, _images())
    both = engine.prefill_batch([PrefillJob(ids, engine.new_state()),
                                 PrefillJob(img_ids, engine.new_state(), media=media)], all_logits=True)
    np.testing.assert_array_equal(both[0][0], plain)
    engine.close()


def test_bad_media_is_refused(mm):
    _, model, _ = mm
    engine = gpu(model)
    assert_refuses_bad_media(engine)
    engine.close()


def test_snapshot_slots_carry_the_rope_delta(mm):
    """As a GPU worker prefills: snapshots into arena slots, block by block. A chain restored
    up to the prompt's text end decodes on (the reference) at the positions after the image;
    one restored inside an image resumes on the GPU with the rest of its media."""
    from shared.state import kv_slot_nbytes, restore_snapshots, state_slot_nbytes, write_snapshot_kv
    _, model, tower = mm
    cfg, block = model.config, 4
    ids, media = _prompt(model, tower, _images())
    whole, _ = reference(model, ids, media)
    n = int(media.rows[-1]) + 2
    engine = gpu(model)
    at = list(range(block, n, block)) + [n]
    states = {p: bytearray(state_slot_nbytes(cfg)) for p in at}
    state = engine.new_state()
    engine.prefill_batch([PrefillJob(ids[:n], state, into=states, block=block, media=media.slice(0, n))])
    kv = {p: bytearray(kv_slot_nbytes(cfg, block, "f32")) for p in at}
    for p in at:                                   # each block's KV from the prompt's, as the worker copies it
        write_snapshot_kv(state, kv[p], block, p)

    def chain(q):
        return restore_snapshots(cfg, model.fingerprint, [kv[p] for p in at if p <= q], states[q], block, "f32")
    ended = chain(n)
    assert ended.rope_delta == reference(model, ids[:n], media.slice(0, n))[1].rope_delta != 0
    close(reference(model, ids[n:], None, ended)[0], whole[n:])
    inside = max(p for p in at if media.rows[0] < p < media.rows[-1])
    close(engine.forward(ids[inside:], chain(inside), media=media.slice(inside, len(ids))), whole[inside:])
    engine.close()
