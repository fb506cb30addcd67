"""The chat page in a real browser: Debian's headless chromium, driven through
chromedriver with the W3C WebDriver protocol (plain HTTP, no client library).
The page loads, a typed message gets a streamed reply (the same text the engine
gives in this process), and its line shows tokens/s and the cached prompt tokens.
The daemon runs with --api-key, which the page sends once it is typed in."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import httpx
import pytest

from tests.support.http_server import HttpDaemon, LocalEngine
from tests.support.serving_harness import free_port, wait_until

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"     # the W3C key of an element reference
PAGE_TIMEOUT_S = 60                                  # chromium starts slowly on 2 busy cores
MESSAGE, MAX_TOKENS = "Hello there", 12
KEY = "sk-page-key"         # the daemon hands it to its front end; the page sends what is typed in


@pytest.fixture(scope="module", autouse=True)
def chromium():
    """Before the daemon starts: a skip without the browser, a failure in CI (where the
    page must be tested, not skipped without a word)."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are missing: .ci/run installs them (apt-get install chromium "
                        "chromium-driver)")
        pytest.skip("chromium and chromedriver are not installed (.ci/run installs Debian's chromium and "
                    "chromium-driver with apt-get; here that was not possible)")


class Browser:
    """A chromedriver process and one session in it."""

    def __init__(self):
        port = free_port()
        self.profile = tempfile.TemporaryDirectory()
        self.driver = subprocess.Popen(["chromedriver", f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(timeout=PAGE_TIMEOUT_S)
        self._wait_driver()
        options = {"binary": shutil.which("chromium"), "args": CHROMIUM_FLAGS + [f"--user-data-dir={self.profile.name}"]}
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
        self.session = self.call("POST", "/session", caps)["sessionId"]

    def _wait_driver(self):
        def ready():
            try:
                return self.http.get(f"{self.base}/status").json()["value"]["ready"]
            except httpx.HTTPError:
                return False
        wait_until(ready, PAGE_TIMEOUT_S, "chromedriver did not start")

    def call(self, method, path, body=None):
        r = self.http.request(method, f"{self.base}{path}", json=body)
        value = r.json()["value"]
        assert r.status_code == 200, value
        return value

    def cmd(self, method, path, body=None):
        return self.call(method, f"/session/{self.session}{path}", body)

    def find(self, css: str) -> str:
        return self.cmd("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css: str, text: str) -> None:
        element = self.find(css)
        self.cmd("POST", f"/element/{element}/clear", {})
        self.cmd("POST", f"/element/{element}/value", {"text": text})

    def js(self, script: str, *args):
        return self.cmd("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait_js(self, script: str, what: str):
        return wait_until(lambda: self.js(script), PAGE_TIMEOUT_S, f"the page never showed {what}")

    def close(self):
        try:
            self.cmd("DELETE", "")
        finally:
            self.driver.terminate()
            self.driver.wait(timeout=30)
            self.http.close()
            self.profile.cleanup()


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    d = HttpDaemon(tiny_q4_path, "--api-key", KEY)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


# Count the changes of the replies' text as they happen: once a streamed piece.
WATCH = """
window.updates = 0;
new MutationObserver((records) => {
  for (const r of records) if (r.target.classList && r.target.classList.contains('content')
                               && r.target.parentElement.classList.contains('assistant')) window.updates += 1;
}).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
"""
LAST_REPLY = """
const r = document.querySelector('#log .msg.assistant:last-of-type, #log .msg.error:last-of-type');
return r && r.dataset.done ? [r.className, r.querySelector('.content').textContent,
                              (r.querySelector('.stats') || {}).textContent] : null;
"""


def chat_once(browser) -> list:
    browser.type("#message", MESSAGE)
    browser.cmd("POST", f"/element/{browser.find('#send')}/click", {})
    return browser.wait_js(LAST_REPLY, "a finished reply")


def test_a_typed_message_gets_a_streamed_reply(daemon, browser, tiny_q4_path):
    local = LocalEngine(tiny_q4_path)
    ids = local.chat_ids([{"role": "user", "content": MESSAGE}])
    pieces, n = local.pieces(ids, MAX_TOKENS, temperature=0.0)
    expected = "".join(pieces)
    browser.cmd("POST", "/url", {"url": daemon.url + "/"})                     # the page itself is open
    browser.wait_js("return document.getElementById('model').textContent.includes('API key')", "the 401")
    browser.type("#api-key", KEY + "\ue004")                                     # Tab: the field's change event
    model = httpx.get(f"{daemon.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    browser.wait_js(f"return document.getElementById('model').textContent === {model!r}", "the model's name")
    browser.type("#max-tokens", str(MAX_TOKENS))
    browser.type("#temperature", "0")
    browser.js(WATCH)
    kind, text, stats = chat_once(browser)
    assert kind == "msg assistant" and text == expected
    assert len(pieces) > 1 and browser.js("return window.updates") == len(pieces)    # it grew piece by piece
    assert f"{n} tokens" in stats and "tok/s" in stats and f"prompt {len(ids)} tokens (0 cached)" in stats

    browser.cmd("POST", f"/element/{browser.find('#clear')}/click", {})          # the same first message again
    kind, again, stats = chat_once(browser)
    assert again == expected and f"prompt {len(ids)} tokens ({len(ids)} cached)" in stats
