"""Images into the text model: the expanded prompt's logits at every position against Hugging
Face's Qwen3_5MoeForConditionalGeneration (tiny random model, converted by `fermoe convert`),
for the reference and the CPU engine; the M-RoPE positions against HF's get_rope_index; a
text-only prompt bit for bit as before; chunks and decoding after an image as one pass."""
from __future__ import annotations

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from shared.model import Model
from shared.reference import text_positions
from shared.vision.mmproj import Mmproj
from shared.vision.prompt import TokenMedia, build, expand, positions
from shared.vision.reference import encode_image
from tests.support.bad_media import assert_refuses_bad_media

vo = pytest.importorskip("tests.support.vision_oracle")
torch = vo.torch

IMAGES = [(64, 96), (96, 64)]           # (H, W): merged grids 2x3 and 3x2
LOGIT_RTOL = 1e-4                       # of max |logit|, as the text oracle (f32 file and KV cache)


@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    return Model(tiny_path)


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """(HF model, text Model, its Mmproj) of one tiny multimodal checkpoint, converted to f32."""
    from modeltools.convert import convert
    from modeltools.vision.convert import convert_mmproj
    d = tmp_path_factory.mktemp("mm")
    hf = vo.save_multimodal(d / "hf", seed=3)
    convert(d / "hf", d / "m.gguf", "f32", progress=False)
    convert_mmproj(d / "hf", d / "mmproj.gguf", "f32")
    return hf, Model(d / "m.gguf"), Mmproj(d / "mmproj.gguf")


def _prompt(model, tower, images, text=(("a", "b"), ("c",), ("d", "e", "f"))):
    """ids: text, <|vision_start|><|image_pad|><|vision_end|> per image, text; expanded with media."""
    tok = model.tokenizer
    pieces = [tok.encode(" ".join(text[0]))]
    for i in range(len(images)):
        pieces.append(tok.encode("<|vision_start|><|image_pad|><|vision_end|>"))
        pieces.append(tok.encode(" ".join(text[min(i + 1, len(text) - 1)])))
    ids = [t for p in pieces for t in p]
    pad = tok.encode("<|image_pad|>")[0]
    pix = [(vo.hf_patchify(im), (im.shape[1] // 16, im.shape[2] // 16)) for im in images]
    return build(ids, pix, lambda p, g: encode_image(tower, p, g).astype(np.float32), pad, model.config.n_embd)


def _images(seed=0):
    return [vo.random_image(h, w, seed=seed + i) for i, (h, w) in enumerate(IMAGES)]


def _check(ours, theirs, rtol):
    scale, err = np.abs(theirs).max(), np.abs(ours - theirs).max()
    assert scale > 1.0, "activations collapsed: the oracle would test nothing"
    assert err <= rtol * scale, f"max |diff| {err:.3g} > {rtol} x {scale:.3g}"


def _cpu(model, **kw):
    from cpu_worker.native_engine import NativeEngine
    return NativeEngine(model, threads=2, kv_cache_dtype="f32", **kw)


@pytest.mark.oracle
def test_positions_are_hf_s(mm):
    hf, model, tower = mm
    ids, media = _prompt(model, tower, _images())
    t = torch.tensor([ids])
    thw = torch.tensor([[1, h // 16, w // 16] for h, w in IMAGES])
    want, delta = hf.model.get_rope_index(t, (t == hf.config.image_token_id).long(), image_grid_thw=thw)
    np.testing.assert_array_equal(media.positions, want[:, 0].numpy().T)
    assert media.next_position() - len(ids) == int(delta)


@pytest.mark.oracle
@pytest.mark.parametrize("engine", ["reference", "cpu"])
def test_multimodal_logits_match_hf(mm, engine):
    hf, model, tower = mm
    images = _images()
    ids, media = _prompt(model, tower, images)
    assert len(media.rows) == 12 and len(ids) > 12
    eng = ReferenceEngine(model, kv_cache_dtype="f32") if engine == "reference" else _cpu(model)
    try:
        state = eng.new_state()
        ours = eng.forward(ids, state, media=media)
    finally:
        eng.close()
    _check(ours, vo.hf_multimodal_logits(hf, ids, images), LOGIT_RTOL)
    assert state.rope_delta == media.next_position() - len(ids) < 0


@pytest.mark.oracle
def test_two_images_give_different_continuations(mm):
    from shared.generate import generate
    from shared.sampling import SamplingParams
    hf, model, tower = mm
    eng, greedy = _cpu(model), SamplingParams(temperature=0.0)
    try:
        out = []
        for seed in (0, 10):
            ids, media = _prompt(model, tower, _images(seed))
            out.append(list(generate(eng, ids, 8, greedy, media=media)))
    finally:
        eng.close()
    assert out[0] != out[1]


@pytest.mark.oracle
def test_chunks_and_decoding_after_an_image_are_one_pass(mm):
    """A prompt in chunks that cut an image, and its last tokens decoded one by one after the
    image (positions from the state's rope delta), give the logits of one whole pass."""
    _, model, tower = mm
    ids, media = _prompt(model, tower, _images())
    whole_eng, chunk_eng = _cpu(model), _cpu(model, max_batch=5)
    try:
        whole = whole_eng.forward(ids, whole_eng.new_state(), media=media)
        np.testing.assert_array_equal(chunk_eng.forward(ids, chunk_eng.new_state(), media=media), whole)
        n = len(ids) - 3
        state = whole_eng.new_state()
        whole_eng.forward(ids[:n], state, media=media.slice(0, n))
        steps = [whole_eng.forward(ids[i:i + 1], state)[0] for i in range(n, len(ids))]
        np.testing.assert_array_equal(np.array(steps), whole[n:])
        ref = ReferenceEngine(model, kv_cache_dtype="f32")
        state = ref.new_state()
        ref.forward(ids[:n], state, media=media.slice(0, n))
        steps = [ref.forward(ids[i:i + 1], state)[0] for i in range(n, len(ids))]
        np.testing.assert_allclose(np.array(steps), ref.forward(ids, ref.new_state(), media=media)[n:],
                                   rtol=0, atol=1e-5 * np.abs(whole).max())
    finally:
        whole_eng.close()
        chunk_eng.close()


@pytest.mark.parametrize("engine", ["reference", "cpu"])
def test_text_given_as_media_is_bit_for_bit_plain_text(tiny_model, engine):
    """Text positions and no image through the image path: the logits of the text path, bitwise."""
    eng = ReferenceEngine(tiny_model) if engine == "reference" else _cpu(tiny_model)
    ids = list(range(5, 45))
    text = TokenMedia(text_positions(0, len(ids)), np.zeros(0, np.int64),
                      np.zeros((0, tiny_model.config.n_embd), np.float32))
    try:
        plain = eng.forward(ids, eng.new_state())
        np.testing.assert_array_equal(eng.forward(ids, eng.new_state(), media=text), plain)
    finally:
        eng.close()


def test_expand_and_positions():
    ids, spans = expand([1, 2, 3, 9, 4, 5, 6], [(4, 6)], image_pad_id=9)
    assert ids == [1, 2, 3] + [9] * 6 + [4, 5, 6]
    # an example: 3 text tokens, an image of 2x3 merged tokens, 3 text tokens
    np.testing.assert_array_equal(positions(len(ids), spans).T, [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8],
                                                                 [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8],
                                                                 [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(FermoeError, match="1 image placeholder.* for 2 image"):
        expand([9, 1], [(4, 4), (4, 4)], image_pad_id=9)
    with pytest.raises(FermoeError, match="not a multiple of the merge size"):
        expand([9], [(4, 5)], image_pad_id=9)


def test_bad_media_is_refused(tiny_model):
    assert_refuses_bad_media(ReferenceEngine(tiny_model))


def test_only_images_past_the_resume_point_are_encoded():
    from shared import protocol as P
    from shared.vision.prompt import media_of_images
    calls = []

    def encode(data, name):
        calls.append(data)
        return np.full((6, 4), float(data[0]), np.float32), (2, 3)
    images = [P.ImageInput(data=b"\1", start=2, rows=2, cols=3), P.ImageInput(data=b"\2", start=10, rows=2, cols=3)]
    whole = media_of_images(20, images, 4, encode)
    assert calls == [b"\1", b"\2"] and whole.rows.tolist() == list(range(2, 8)) + list(range(10, 16))
    calls.clear()
    resumed = media_of_images(20, images, 4, encode, start=8)          # the first image is in the snapshot
    assert calls == [b"\2"] and (resumed.embeds == 2).all()
    np.testing.assert_array_equal(resumed.slice(8, 20).positions, whole.positions[8:])
    calls.clear()
    assert len(media_of_images(20, images, 4, encode, start=20).rows) == 0 and calls == []   # a repeated prompt
    with pytest.raises(FermoeError, match="a 2x3 merged grid, but the prompt holds 3x2"):
        media_of_images(20, [P.ImageInput(data=b"\1", start=2, rows=3, cols=2)], 4, encode)
    with pytest.raises(FermoeError, match="outside the prompt"):
        media_of_images(5, images, 4, encode)


def test_cache_keys_follow_the_pixels():
    from shared.vision.chat import ChatPrompt, PromptImage
    from shared.vision.prompt import ImageSpan
    spans = [ImageSpan(2, 2, 3)]
    tokens = [1, 2] + [9] * 6 + [3]
    key = lambda digest: ChatPrompt(tokens, spans, [PromptImage(b"", (4, 6), digest)]).cache_key()
    a, a2, b = key(b"a" * 16), key(b"a" * 16), key(b"b" * 16)
    assert a == a2 and a[:2] == b[:2] == [1, 2] and a[-1] == b[-1] == 3
    assert all(x != y for x, y in zip(a[2:8], b[2:8])) and len(set(a[2:8])) == 6
    assert min(a[2:8]) >= 1 << 30 and max(a[2:8]) < 1 << 31


def test_a_second_image_keys_its_own_tokens_and_every_later_key():
    """Fault guarded: the image part of the key drawn for the first image only (one
    generator seeded from the first image's hash, the loop cut to the first span, or the
    second span's slice misplaced), so that two prompts sharing the first image and
    differing in the second got one key past the second and the second resumed from the
    first's snapshots, the wrong image in its state. The two keys agree up to the second
    image's start and differ at each of its tokens; the index resumes the second prompt at
    the last block boundary before it (12 of 23), never further."""
    from coordinator.snapshots import SnapshotIndex
    from shared.vision.chat import ChatPrompt, PromptImage
    from shared.vision.prompt import ImageSpan
    spans = [ImageSpan(3, 2, 3), ImageSpan(14, 2, 3)]              # tokens [3, 9) and [14, 20)
    tokens = [1, 2, 3] + [9] * 6 + [4, 5, 6, 7, 8] + [9] * 6 + [10, 11, 12]

    def key(*digests):
        return ChatPrompt(tokens, spans, [PromptImage(b"", (4, 6), d) for d in digests]).cache_key()
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    ab, ac, ba = key(a, b), key(a, c), key(b, a)
    assert ab[:14] == ac[:14] and ab[20:] == ac[20:] == [10, 11, 12]
    assert all(x != y for x, y in zip(ab[14:20], ac[14:20]))
    assert min(ab[14:20] + ac[14:20]) >= 1 << 30                  # no image token keyed as its placeholder
    assert ab[:3] == ba[:3] and all(x != y for x, y in zip(ab[3:9], ba[3:9]))
    idx = SnapshotIndex(64, block=4)
    idx.commit(idx.plan(ab, 0))                                   # every block boundary with a state
    assert idx.cached(ab + [13]) == 23
    assert idx.cached(ac) == 12 and idx.cached(ba) == 0
