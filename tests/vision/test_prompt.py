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
from shared.vision.image import ImageLimits
from shared.vision.mmproj import Mmproj
from shared.vision.prompt import ImageSpan, TokenMedia, build, expand, media_for, positions, prompt_media
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
    with pytest.raises(FermoeError, match=r"^the prompt has 1 image placeholder\(s\) \(<\|image_pad\|>\) for 2 image\(s\): the "
                                          r"chat template must place each image once \(as Qwen3.5's does\)$"):
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


def _media(n_tokens, rows, n_embd=2):
    rows = np.asarray(rows, np.int64)
    return TokenMedia(text_positions(0, n_tokens), rows, np.zeros((len(rows), n_embd), np.float32))


def test_image_rows_must_lie_in_the_run():
    """Fault guarded: a row check off by one at either end (row -1 or row n_tokens taken,
    an embedding written outside the run) or one that refuses the first or last token."""
    _media(4, [0, 3]).check(4, 2)
    _media(4, []).check(4, 2)
    for rows in ([-1, 2], [1, 4]):
        with pytest.raises(FermoeError, match="^image token rows outside the tokens they belong to$"):
            _media(4, rows).check(4, 2)
    with pytest.raises(FermoeError, match=r"^image embeddings of shape \(2, 2\): expected \(2, 3\), one row"):
        _media(4, [0, 3]).check(4, 3)
    with pytest.raises(FermoeError, match=r"^image positions of shape \(4, 3\) for 5 tokens$"):
        _media(4, [0]).check(5, 2)


def test_a_slice_renumbers_its_rows_and_the_next_position():
    """Fault guarded: a slice that keeps the rows' absolute numbers or takes the wrong rows'
    embeddings (a chunk that cuts an image), and a next position not one past the largest of
    the last token's three (the text after an image starts from it)."""
    spans = [ImageSpan(2, 2, 3)]
    media = prompt_media(10, spans, [np.arange(12, dtype=np.float32).reshape(6, 2)], 2)
    part = media.slice(4, 9)
    assert part.rows.tolist() == [0, 1, 2, 3] and part.embeds[:, 0].tolist() == [4.0, 6.0, 8.0, 10.0]
    np.testing.assert_array_equal(part.positions, positions(10, spans)[4:9])
    assert media.slice(0, 2).rows.tolist() == [] and media.slice(8, 10).rows.tolist() == []
    assert media.next_position() == 7                   # text 0, 1; image 2..(2+1, 2+2); text 5, 6
    assert TokenMedia(np.array([[3, 9, 4]]), np.zeros(0, np.int64), np.zeros((0, 2))).next_position() == 10


def test_prompt_media_places_each_images_rows():
    """Fault guarded: embeddings of a wrong shape taken (another image's size, another width),
    rows not where each span lies, or the empty case of the wrong shape or dtype."""
    spans = [ImageSpan(1, 1, 2), ImageSpan(5, 2, 1)]
    e = [np.ones((2, 3), np.float64), np.full((2, 3), 2.0)]
    media = prompt_media(8, spans, e, 3)
    assert media.rows.tolist() == [1, 2, 5, 6] and media.embeds.dtype == np.float32
    assert media.embeds[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    with pytest.raises(FermoeError, match=r"^an image of 2x1 merged tokens got embeddings of shape \(2, 4\), "
                                          r"expected \(2, 3\)$"):
        prompt_media(8, spans, [e[0], np.zeros((2, 4))], 3)
    with pytest.raises(FermoeError, match=r"^an image of 1x2 merged tokens got embeddings of shape \(3, 3\)"):
        prompt_media(8, spans, [np.zeros((3, 3)), e[1]], 3)
    with pytest.raises(ValueError):                      # an image without its embeddings
        prompt_media(8, spans, e[:1], 3)
    empty = prompt_media(3, [], [], 5)
    assert empty.rows.dtype == np.int64 and empty.rows.shape == (0,)
    assert empty.embeds.dtype == np.float32 and empty.embeds.shape == (0, 5)
    np.testing.assert_array_equal(empty.positions, text_positions(0, 3))


def test_positions_of_two_images_in_any_order():
    """Fault guarded: spans taken in the order given rather than the prompt's, or the text
    after a tall image going on from its columns (max(rows, cols) read as one of them)."""
    spans = [ImageSpan(5, 1, 2), ImageSpan(1, 3, 1)]     # a 3x1 image at 1, a 1x2 image at 5
    np.testing.assert_array_equal(positions(8, spans).T, [[0, 1, 1, 1, 4, 5, 5, 7],
                                                          [0, 1, 2, 3, 4, 5, 5, 7],
                                                          [0, 1, 1, 1, 4, 5, 6, 7]])


def test_media_for_text_after_an_image():
    """Fault guarded: media dropped when given, text after an image run without positions
    (the state's rope delta ignored) or from the wrong one, plain text sent the image path."""
    from types import SimpleNamespace
    given = _media(2, [])
    state = SimpleNamespace(rope_delta=0, position=7, cfg=SimpleNamespace(n_embd=4))
    assert media_for(state, 2, given) is given and media_for(state, 2, None) is None
    state.rope_delta = -3
    m = media_for(state, 2, None)
    np.testing.assert_array_equal(m.positions, [[4, 4, 4], [5, 5, 5]])
    assert m.rows.dtype == np.int64 and m.rows.shape == (0,)
    assert m.embeds.dtype == np.float32 and m.embeds.shape == (0, 4)
    m.check(2, 4)


def test_an_image_that_ends_the_prompt_is_inside_it():
    """Fault guarded: the bounds check of media_of_images off by one (an image whose last token
    is the prompt's last refused, or one that starts before the prompt taken)."""
    from shared import protocol as P
    from shared.vision.prompt import media_of_images

    def encode(data, name):
        return np.ones((2, 3), np.float32), (1, 2)
    assert media_of_images(4, [P.ImageInput(data=b"x", start=2, rows=1, cols=2)], 3, encode).rows.tolist() == [2, 3]
    with pytest.raises(FermoeError, match=r"^an image's tokens \[3, 5\) lie outside the prompt's 4$"):
        media_of_images(4, [P.ImageInput(data=b"x", start=3, rows=1, cols=2)], 3, encode)
    names = []

    def named(data, name):
        names.append(name)
        return encode(data, name)
    first = media_of_images(4, [P.ImageInput(data=b"x", start=0, rows=1, cols=2)] * 2, 3, named)
    assert first.rows.tolist() == [0, 1, 0, 1] and first.embeds.shape == (4, 3) and names == ["image 1", "image 2"]
    one = media_of_images(4, [P.ImageInput(data=b"x", start=0, rows=1, cols=1)], 3, lambda d, n: (np.ones((1, 3)), (1, 1)))
    assert one.rows.tolist() == [0]                       # not resumed: from token 0
    with pytest.raises(FermoeError, match=r"^image 2: a 1x2 merged grid, but the prompt holds 2x1 tokens for it$"):
        media_of_images(4, [P.ImageInput(data=b"x", start=0, rows=1, cols=2),
                            P.ImageInput(data=b"x", start=2, rows=2, cols=1)], 3, encode)
    with pytest.raises(FermoeError, match=r"^an image's tokens \[-1, 1\) lie outside the prompt's 4$"):
        media_of_images(4, [P.ImageInput(data=b"x", start=-1, rows=1, cols=2)], 3, encode)
    empty = media_of_images(4, [], 3, encode)
    assert empty.rows.dtype == np.int64 and empty.embeds.shape == (0, 3) and empty.embeds.dtype == np.float32


def test_expand_two_images_and_a_merge_size():
    """Fault guarded: the text between two images dropped (the output restarted at each image),
    the merge size ignored, or positions of another dtype than int64."""
    ids, spans = expand([1, 9, 2, 3, 9, 4], [(2, 4), (6, 3)], image_pad_id=9, merge=1)
    assert ids == [1] + [9] * 8 + [2, 3] + [9] * 18 + [4]
    assert spans == [ImageSpan(1, 2, 4), ImageSpan(11, 6, 3)]
    assert positions(len(ids), spans).dtype == np.int64


def test_build_encodes_each_image_at_its_span():
    """Fault guarded: build() passing the wrong pixels or grid to the tower, the wrong merge
    size or width, or media for other ids than those it returns."""
    calls = []

    def encode(pixels, grid):
        calls.append((pixels, grid))
        return np.full((grid[0] * grid[1] // 4, 3), float(pixels))
    ids, media = build([5, 9, 6, 9], [(1, (2, 2)), (2, (2, 4))], encode, 9, 3)
    assert calls == [(1, (2, 2)), (2, (2, 4))]
    assert ids == [5, 9, 6, 9, 9] and media.rows.tolist() == [1, 3, 4]
    assert media.embeds[:, 0].tolist() == [1.0, 2.0, 2.0] and media.positions.shape == (5, 3)
    ids, media = build([9], [(7, (2, 2))], lambda p, g: np.zeros((4, 3)), 9, 3, merge=1)
    assert ids == [9] * 4 and media.rows.tolist() == [0, 1, 2, 3]


def test_the_image_encoder_counts_what_it_encodes(monkeypatch):
    """Fault guarded: the encoder's grid, output dtype or running totals (the rate a worker
    reports) wrong: tokens counted unmerged or overwritten, time not summed."""
    import io
    from modeltools.vision.synth import preset_config
    from shared.vision import prompt as prompt_module
    from shared.vision.prompt import ImageEncoder
    Image = pytest.importorskip("PIL.Image")
    cfg = preset_config("tiny")
    out = io.BytesIO()
    Image.fromarray(np.zeros((64, 96, 3), np.uint8)).save(out, "PNG")
    seen = []

    def forward(pixels, grid):
        seen.append((pixels.shape, grid))
        return [[1, 2]] * (grid[0] * grid[1] // 4)
    enc = ImageEncoder(cfg, forward)
    clock = iter([10.0, 10.5, 20.0, 20.25])
    monkeypatch.setattr(prompt_module.time, "perf_counter", lambda: next(clock))
    e, grid = enc(out.getvalue())
    assert seen == [((280, 1536), (14, 20))] and e.dtype == np.float32 and e.shape == (70, 2)
    assert grid == (7, 10) and [type(x) for x in grid] == [int, int]
    enc(out.getvalue(), "second")
    monkeypatch.undo()
    assert enc.seconds == 0.75 and enc.tokens == 140 and type(enc.tokens) is int
    with pytest.raises(FermoeError, match="^pic: corrupt or truncated PNG image"):
        ImageEncoder(cfg, forward, enc.limits)(out.getvalue()[:-30], "pic")
    with pytest.raises(FermoeError, match="^image: corrupt"):
        enc(out.getvalue()[:-30])
    small = ImageEncoder(cfg, forward, ImageLimits(min_pixels=1024, max_pixels=4096))
    assert small(out.getvalue())[1] == (1, 2)
