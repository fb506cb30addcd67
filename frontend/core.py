"""What every route shares, whichever API it speaks: the settings, the Server (the upstream
connection to the coordinator, metrics, the model's name, tokenizer and fingerprint),
request bodies read within --max-request-size, and a Generate submitted to the coordinator
within its own limit. The dialects' routes (openai_api.py, responses_api.py, anthropic_api.py,
llama_server_api.py) import it; app.py puts them together.
"""
from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import time
from dataclasses import dataclass

import msgspec
from starlette.requests import Request

from shared import protocol as P
from shared.chat import opens_reasoning, reasoning_kwargs, render_chat
from shared.errors import FermoeError, ProtocolError
from shared.sampling import with_defaults

from .errors import RETRY_AFTER_S, APIError
from .metrics import Metrics
from .upstream import Upstream


@dataclass
class Settings:
    connect: str
    api_key: str | None = None
    max_queue: int | None = None
    alias: str | None = None                     # the model's names, a comma list; None: the coordinator's
    cors_origins: tuple[str, ...] = ("*",)
    max_request_size: int = P.MAX_MESSAGE_BYTES  # bytes of a request body
    reasoning_format: str = "deepseek"
    curve_key: str | None = None                 # the client pair, for a coordinator requiring CURVE keys
    tags: tuple[str, ...] = ()                   # --tags: listed with the model
    slots: bool = True                           # --no-slots: GET /slots answers 501


class Server:
    """What the routes share: the upstream connection, metrics, the model's name and tokenizer."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.upstream: Upstream | None = None
        self.metrics: Metrics | None = None
        self.model_path: str | None = None
        self.name: str | None = None               # what replies carry: the first of `names`
        self.names: list[str] = []
        self.system_fingerprint = ""
        self.coordinator_limit = P.MAX_MESSAGE_BYTES
        self.reasoning_default = ("auto", -1)      # the coordinator's --reasoning, --reasoning-budget
        self.sampling_defaults: dict = {}           # its --temp, ... (SamplingParams fields), and -n
        self.n_predict = -1
        self.chat_template: str | None = None       # its --chat-template; None: the model's
        self.template_defaults: dict = {}           # its --chat-template-kwargs
        self.started = int(time.time())
        self._tokenizer = None
        self._tokenizer_lock = asyncio.Lock()

    async def status(self) -> P.StatusReply:
        try:
            st = await self.upstream.status()
        except (asyncio.TimeoutError, ProtocolError) as e:
            raise APIError(503, f"the coordinator at {self.settings.connect} does not answer"
                                f"{': ' + str(e) if str(e) else ''}", headers={"Retry-After": RETRY_AFTER_S}) from None
        self.model_path = st.model
        self.names = (self.settings.alias or st.name or st.model).split(",")
        self.name = self.names[0]
        self.system_fingerprint = system_fingerprint(st.fingerprint)
        self.coordinator_limit = st.max_request_size
        self.reasoning_default = (st.reasoning, st.reasoning_budget)
        self.sampling_defaults, self.n_predict = st.sampling_defaults, st.n_predict
        self.chat_template, self.template_defaults = st.chat_template or None, st.chat_template_kwargs
        return st

    def effective(self, msg: P.Generate) -> P.Generate:
        """`msg` as the coordinator runs it: the server's defaults in the fields it left unset
        (what llama-server's generation_settings show)."""
        sampling = with_defaults(msg.sampling, msg.unset, self.sampling_defaults)
        max_tokens = msg.max_tokens
        if "max_tokens" in msg.unset and self.n_predict != -1:
            max_tokens = self.n_predict
        return msgspec.structs.replace(msg, sampling=sampling, max_tokens=max_tokens, unset=[])

    async def model_id(self) -> str:
        if self.name is None:
            await self.status()
        return self.name

    async def opens_reasoning(self, msg: P.Generate) -> bool:
        """Whether a chat's output starts as reasoning: the chat template's generation prompt
        leaves <think> open, or the continued final message is inside an open <think>; read from
        the model's template, which needs the model file on this host (a front end without it
        splits out only a <think> block the model opens itself)."""
        try:
            tok = await self.tokenizer()
        except APIError:
            return False
        kwargs = self.template_kwargs(msg.chat_template_kwargs)
        if not msg.continue_final_message:
            return opens_reasoning(tok, kwargs)
        try:
            text = render_chat(tok, msg.messages, msg.tools, kwargs, continue_final=True)
        except FermoeError:             # the coordinator refuses it in its own words
            return False
        return text.rfind("<think>") > text.rfind("</think>")

    def template_kwargs(self, chat_template_kwargs: dict | None) -> dict | None:
        """A chat's template variables as the coordinator renders it: the server's
        --chat-template-kwargs under the request's own, then its --reasoning default."""
        return reasoning_kwargs({**self.template_defaults, **(chat_template_kwargs or {})}, *self.reasoning_default)

    async def tokenizer(self):
        """The model's tokenizer, with the coordinator's --chat-template if it has one."""
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                await self.model_id()
                self._tokenizer = await asyncio.to_thread(_load_tokenizer, self.model_path)
                if self.chat_template is not None:
                    self._tokenizer.chat_template = self.chat_template
        return self._tokenizer


def system_fingerprint(model_fingerprint: str) -> str:
    """OpenAI's system_fingerprint: one value per fermoe version and model file."""
    try:
        version = importlib.metadata.version("fermoe")
    except importlib.metadata.PackageNotFoundError:
        version = "source"
    return "fp_" + hashlib.sha256(f"fermoe {version} {model_fingerprint}".encode()).hexdigest()[:10]


def _size(n: int) -> str:
    return f"{n / 2**20:.4g} MiB" if n >= 2**20 else f"{n / 2**10:.4g} KiB"


def _load_tokenizer(path: str):
    from shared.gguf_file import GGUFFile
    from shared.tokenizer import Tokenizer
    try:
        f = GGUFFile(path)
    except (OSError, FermoeError) as e:
        raise APIError(501, f"the tokenizer is not available on this host: {e}") from None
    try:
        return Tokenizer.from_metadata(f.metadata)
    except FermoeError as e:
        raise APIError(501, f"the tokenizer is not available: {e}") from None
    finally:
        f.close()


async def read_body(request: Request) -> bytes:
    limit = request.app.state.server.settings.max_request_size
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"the request body is {declared} bytes", limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(f"the request body is over {len(body)} bytes", limit)
    return bytes(body)


def _too_large(what: str, limit: int, whose: str = "the server's") -> APIError:
    return APIError(413, f"{what}, over the limit of {limit} bytes ({_size(limit)}); {whose} --max-request-size "
                         f"raises it", code="request_too_large")


async def submit(server: Server, msg: P.Generate):
    """The Generate sent to the coordinator, once within its limits: (model name, upstream, its stream)."""
    model = await server.model_id()
    data = P.encode(msg)
    if len(data) > server.coordinator_limit:        # a coordinator of its own, with a lower limit
        raise _too_large(f"the request is {len(data)} bytes as a message to the coordinator",
                         server.coordinator_limit, "the coordinator's")
    if server.settings.max_queue is not None:      # the coordinator admits it once it has checked it
        msg = msgspec.structs.replace(msg, max_queue=server.settings.max_queue)
        data = P.encode(msg)
    return model, server.upstream, server.upstream.submit(msg, data)

