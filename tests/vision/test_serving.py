"""Images served: chat messages with images through the coordinator and a CPU worker give
what `fermoe generate --image` gives locally; the prefix cache keys each image by its
pixels (the same image and text resume whole, another image never shares past its start);
bad images are one clear error each and the daemon serves on."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest

import httpx

from coordinator.client import Client
from fermoe.engines import load_engine
from shared import protocol as P
from shared.errors import FermoeError
from shared.generate import generate
from shared.model import Model
from shared.sampling import SamplingParams
from shared.vision.chat import chat_prompt
from shared.vision.mmproj import Mmproj
from shared.vision.prompt import ImageEncoder, media_of_images
from tests.support.http_server import HttpDaemon
from tests.support.vision_model import TEXT, chat, vision_model
from tests.support.serving_harness import streamed_ids

PIL = pytest.importorskip("PIL.Image")


def png(seed: int, size=(96, 64)) -> bytes:
    """A PNG of size (w, h) (a multiple of 32 each: the tower sees it as it is)."""
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.fromarray(rgb).save(out, "PNG")
    return out.getvalue()




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return vision_model(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def daemon(files):
    """The coordinator with the tower, its ZeroMQ endpoint (addr) and its HTTP API (url)."""
    d = HttpDaemon(files[0], "--mmproj", files[1])
    yield d
    d.stop()


def local_ids(files, messages, n: int, seed: int | None, temperature: float = 0.8) -> list[int]:
    """What `fermoe generate --image ... --chat` samples, in this process."""
    from cpu_worker.vision_engine import VisionEngine
    model, tower = Model(files[0]), Mmproj(files[1])
    prompt = chat_prompt(model.tokenizer, messages, vision=tower.config)
    vision = VisionEngine(tower, threads=1)
    inputs = [P.ImageInput(data=im.data, start=s.start, rows=s.rows, cols=s.cols)
              for im, s in zip(prompt.images, prompt.spans)]
    try:
        media = media_of_images(len(prompt.tokens), inputs, model.config.n_embd, ImageEncoder(tower.config,
                                                                                              vision.encode))
    finally:
        vision.close()
    eng = load_engine("cpu", model, threads=1)
    try:
        return list(generate(eng, prompt.tokens, n, SamplingParams(temperature=temperature, seed=seed), media=media))
    finally:
        eng.close()


def served(addr, messages, n: int, seed: int):
    with Client(addr, timeout_s=120) as c:
        msgs = list(c.generate(messages=messages, max_tokens=n, ignore_eos=True, seed=seed, temperature=0.8))
    assert isinstance(msgs[-1], P.Done), msgs[-1]
    return streamed_ids(msgs), msgs[-1]


def test_an_image_served_is_the_local_run_and_cached_by_its_pixels(daemon, files):
    a, b = png(1), png(2)
    ids_a, done_a = served(daemon.addr, chat(a), 10, seed=5)
    assert done_a.finish_reason == "length", done_a.error
    assert ids_a == local_ids(files, chat(a), 10, seed=5)
    # the same image and text: resumed whole (no prefill, no vision pass), the same tokens
    again, done = served(daemon.addr, chat(a), 10, seed=5)
    assert done.cached_prompt_tokens == done.prompt_tokens == done_a.prompt_tokens and done.prefill_ms == 0
    assert again == ids_a
    # another image of the same size, the same text: nothing shared past where the image starts
    model = Model(files[0])
    start = chat_prompt(model.tokenizer, chat(b), vision=Mmproj(files[1]).config).spans[0].start
    ids_b, done_b = served(daemon.addr, chat(b), 10, seed=5)
    assert done_b.prompt_tokens == done_a.prompt_tokens and done_b.cached_prompt_tokens <= start
    assert ids_b == local_ids(files, chat(b), 10, seed=5) and ids_b != ids_a
    # two images; then one more turn resumes after the images
    ids_ab, done_ab = served(daemon.addr, chat(a, b), 6, seed=2)
    assert ids_ab == local_ids(files, chat(a, b), 6, seed=2)


@pytest.mark.parametrize("data, problem", [
    (b"", "image 1: the image is empty"),
    (b"GIF89a" + bytes(40), "image 1: GIF images are not supported"),     # named by its first bytes alone
    (png(3)[:60], "image 1: corrupt or truncated PNG"),
    (bytes(P.MAX_IMAGE_BYTES + 1), f"over the limit of {P.MAX_IMAGE_BYTES} bytes"),
])
def test_bad_images_are_one_error_and_the_daemon_serves_on(daemon, data, problem):
    with Client(daemon.addr, timeout_s=60) as c:
        with pytest.raises(FermoeError, match="refused: ") as e:
            list(c.generate(messages=chat(png(4), data), max_tokens=2))
        assert problem.replace("image 1", "image 2") in str(e.value)
        assert isinstance(list(c.generate(messages=chat(png(4)), max_tokens=2))[-1], P.Done)


def test_images_need_a_tower(files):
    model = Model(files[0])
    with pytest.raises(FermoeError, match=r"hold 1 image\(s\), but no vision tower is loaded \(start with --mmproj"):
        chat_prompt(model.tokenizer, chat(png(1)))


def _http_chat(daemon, parts, **kw):
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 10, **kw}
    return httpx.post(f"{daemon.url}/v1/chat/completions", json=body, timeout=120)


def test_a_worker_reports_its_towers_rate(daemon):
    """The first token of an image prompt carries the tower's tokens and time: the coordinator
    learns the worker's vision rate (what placement weighs images by), shown in the status."""
    served(daemon.addr, chat(png(11, (64, 64))), 2, seed=1)
    with Client(daemon.addr) as c:
        assert max(w.vision_tok_s for w in c.status().workers) > 0


def test_props_report_vision(daemon):
    """llama-server's /props: modalities.vision with a tower (test_http_llama_server_api: without)."""
    assert httpx.get(f"{daemon.url}/props", timeout=30).json()["modalities"] == {"vision": True, "audio": False}
    with Client(daemon.addr) as c:
        assert c.status().vision


def test_openai_image_url_data_urls(daemon, files):
    a = png(1)
    url = "data:image/png;base64," + base64.b64encode(a).decode()
    r = _http_chat(daemon, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": TEXT}],
                   seed=5, temperature=0.8, ignore_eos=True)
    assert r.status_code == 200, r.text
    want = Model(files[0]).tokenizer.decode(local_ids(files, chat(a), 10, seed=5))
    assert r.json()["choices"][0]["message"]["content"] == want


def test_anthropic_image_blocks_and_responses_input_images(daemon, files):
    """The Messages API's base64 image block (Claude Code's screenshots) and the Responses
    API's input_image (Codex's), through the vendors' own clients: the local run's text
    (greedy: these APIs have no seed)."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    a = png(2)
    b64 = base64.b64encode(a).decode()
    want = Model(files[0]).tokenizer.decode(local_ids(files, chat(a), 10, seed=None, temperature=0.0))
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model="m", max_tokens=10, extra_body={"temperature": 0.0},
                               messages=[{"role": "user", "content": [
                                   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                "data": b64}},
                                   {"type": "text", "text": TEXT}]}])
    assert "".join(block.text for block in m.content if block.type == "text") == want
    codex = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = codex.responses.create(model="m", max_output_tokens=10, temperature=0.0,
                               input=[{"role": "user", "content": [
                                   {"type": "input_image", "image_url": f"data:image/png;base64,{b64}"},
                                   {"type": "input_text", "text": TEXT}]}])
    assert r.output_text == want
    with pytest.raises(anthropic.BadRequestError, match="not fetched"):
        claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="data: URL"):
        codex.responses.create(model="m", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/cat.png"}]}])


@pytest.mark.parametrize("url, problem", [
    ("https://example.com/cat.png", "http(s) URLs are not fetched"),
    ("http://127.0.0.1/x.png", "http(s) URLs are not fetched"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png,rawbytes", "expected a base64 data: URL"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "image 1: not a PNG or JPEG"),
])
def test_bad_image_urls_are_a_400(daemon, url, problem):
    r = _http_chat(daemon, [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}])
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text


def test_the_chat_page_attaches_an_image(daemon, files, tmp_path):
    """The page in headless chromium: an attached PNG goes out as a data: URL with the text;
    the reply is the local run's on that image."""
    import shutil
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("chromium and chromedriver are not installed")
    from tests.http.test_browser import LAST_REPLY, Browser
    image = tmp_path / "picture.png"
    image.write_bytes(png(7))
    model = Model(files[0])
    prompt = chat_prompt(model.tokenizer, chat(png(7)), vision=Mmproj(files[1]).config)
    want = model.tokenizer.decode(local_ids(files, chat(png(7)), 6, seed=None, temperature=0.0))
    browser = Browser()
    try:
        browser.cmd("POST", "/url", {"url": daemon.url + "/"})
        browser.type("#max-tokens", "6")
        browser.type("#temperature", "0")
        browser.type("#message", TEXT)
        browser.cmd("POST", f"/element/{browser.find('#image')}/value", {"text": str(image)})
        browser.cmd("POST", f"/element/{browser.find('#send')}/click", {})
        kind, text, stats = browser.wait_js(LAST_REPLY, "a finished reply")
        assert browser.js("return document.querySelector('#log .msg.user img').src.startsWith('data:image/png')")
    finally:
        browser.close()
    assert kind == "msg assistant" and f"prompt {len(prompt.tokens)} tokens" in stats
    assert text == want.split("<|im_end|>")[0]


def test_an_image_prompt_is_prefilled_on_the_gpu_worker(files, monkeypatch):
    """--prefill gpu (the host emulation): the GPU worker runs the tower and the prefill, a
    CPU worker decodes from its snapshot; each streamed token's log-probability is the one a
    CPU-only run gives it, within what the GPU's fp32 activations (the CPU's are 8-bit)
    move it by. The same image again resumes whole; another one is prefilled on the GPU.
    Fault guarded: the CPU worker handed the prompt not resumed at its end (the hand-over's
    lookup missing the GPU's snapshot: made with the prompt's tokens, not its image-keyed
    cache key), so that it prefilled the prompt again and ran its own tower, the output
    still right: the CPU worker here, in a thread of the test (picked first, by its id),
    shows it is told to resume at the prompt's end, prefills nothing and encodes no image."""
    from tests.support.serving_harness import Daemon, ThreadWorker, wait_until
    from tests.serving.test_gpu import gpu_ready
    monkeypatch.setenv("FERMOE_GPU", "emulate")
    daemon = Daemon(files[0], "--mmproj", files[1], "--gpu", "auto", "--prefill", "gpu")
    params = dict(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=0)
    cpu = None
    try:
        gpu_ready(daemon)
        cpu = ThreadWorker(daemon.worker_endpoint, files[0], "a-cpu", mmproj=str(files[1]))
        with Client(daemon.addr) as c:
            wait_until(lambda: any(w.worker_id == "a-cpu" and w.alive for w in c.status().workers), 120,
                       "the test's CPU worker never became ready")
        for image in (png(1, WIDE), png(2, WIDE)):
            with Client(daemon.addr, timeout_s=300) as c:
                msgs = list(c.generate(messages=chat(image), **params))
            done = msgs[-1]
            assert isinstance(done, P.Done) and done.finish_reason == "length", done
            assert done.prefill_device == "gpu" and done.cached_prompt_tokens < done.prompt_tokens
            assign = [m for m, _ in cpu.assigns if m.request_id == done.request_id]
            assert len(assign) == 1 and done.request_id in cpu.decoded, "not decoded by the test's CPU worker"
            assert assign[0].resume and assign[0].resume[-1].position == done.prompt_tokens
            assert cpu.prefilled(done.request_id) == [], "the CPU worker prefilled what the GPU worker had"
            assert cpu.worker._images is None or cpu.worker._images.tokens == 0, "the CPU worker ran its tower"
            tokens = [m for m in msgs if isinstance(m, P.Token) and m.token >= 0]
            want = _cpu_only_logprobs(files, chat(image), [m.token for m in tokens])
            err = np.abs(np.array([m.logprob for m in tokens]) - want).max()
            assert err < LOGPROB_TOL, f"log-probabilities {err:.3g} off the CPU-only run's"
        with Client(daemon.addr, timeout_s=300) as c:
            again = list(c.generate(messages=chat(png(2, WIDE)), **params))
        assert again[-1].prefill_device is None and again[-1].cached_prompt_tokens == again[-1].prompt_tokens
        assert streamed_ids(again) == streamed_ids(msgs)
    finally:
        if cpu is not None:
            cpu.stop()
        assert daemon.stop() == 0


WIDE = (256, 64)            # 8 x 2 merged tokens: the text after it runs 8 positions behind its length
# the hand-over's 8-bit vs fp32 activations moved them by 0.023 at most here; the prompt
# prefilled without its images, by 0.3 (this model's RoPE barely turns: test_vision_gpu
# tests the positions and the rope delta the snapshots carry)
LOGPROB_TOL = 0.1


def _cpu_only_logprobs(files, messages, ids: list[int]) -> np.ndarray:
    """The CPU engine's log-probability of each of `ids` after the chat with its images."""
    from cpu_worker.native_engine import NativeEngine
    from cpu_worker.vision_engine import image_encoder
    model = Model(files[0])
    prompt = chat_prompt(model.tokenizer, messages, vision=Mmproj(files[1]).config)
    inputs = [P.ImageInput(data=im.data, start=s.start, rows=s.rows, cols=s.cols)
              for im, s in zip(prompt.images, prompt.spans)]
    media = media_of_images(len(prompt.tokens), inputs, model.config.n_embd, image_encoder(files[1], model, 1))
    engine = NativeEngine(model, threads=1)
    try:
        state, out = engine.new_state(), []
        logits = engine.forward(prompt.tokens, state, all_logits=False, media=media)[-1]
        for token in ids:
            z = logits.astype(np.float64) - logits.max()
            out.append(z[token] - np.log(np.exp(z).sum()))
            logits = engine.forward([token], state, all_logits=False)[-1]
        return np.array(out)
    finally:
        engine.close()
