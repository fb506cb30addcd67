"""Every wire message of fermoe, declared once.

MessagePack maps over ZeroMQ: each message is a map with a "type" field naming it
(msgspec tagged union), so a client in any language with a plain msgpack library
can speak the protocol (see the README's table). Decoding is strict: a wrong
type, a missing field, an unknown message or an oversized frame is a
ProtocolError, which the receiver answers with an Error message; nobody crashes.

Large data (recurrent state, KV, logits) never rides in a message: it lives in
shared memory and a message carries the slot number.
"""
from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from .errors import ProtocolError
from .sampling import SamplingParams

# The largest message a process decodes by default, and the default of the coordinator's
# --max-request-size (its limit on a client's message, set with set_max_message_bytes).
# A prompt of a whole 262144-token context is about 1.3 MB as token ids (an Assign, up
# to 5 bytes a token) and a few MB as text, JSON-escaped; 64 MiB leaves room for far
# longer contexts and for text of many bytes a token.
MAX_MESSAGE_BYTES = 64 << 20
_limit = MAX_MESSAGE_BYTES
# The largest image a chat message may carry (its PNG or JPEG bytes); the coordinator
# refuses a larger one by name. Its pixels are bounded apart (shared/vision/image.py).
MAX_IMAGE_BYTES = 20 << 20
# How deep containers may nest in a message's free-form fields (tools, chat_template_kwargs,
# a tool call's arguments): far deeper than any JSON schema a client sends, far shallower
# than what exhausts a decoder's or a template's recursion.
MAX_NESTING = 64
FinishReason = Literal["stop", "length", "cancelled", "error"]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=False):
    pass


# ---- client <-> coordinator ---------------------------------------------------
class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    """A call's function: `arguments` as OpenAI sends it (JSON text of an object) or as that object."""
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """Text within a message's content parts."""
    text: str


class ImagePart(msgspec.Struct, tag_field="type", tag="image", forbid_unknown_fields=True):
    """An image within a message's content parts: its PNG or JPEG bytes (MessagePack bin),
    at most MAX_IMAGE_BYTES. Needs a coordinator started with --mmproj (the vision tower)."""
    data: bytes


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One message of a chat; the optional fields are those the model's chat template reads
    (an assistant's reasoning and tool calls, a tool result's call id and name). content:
    text, or parts in order (text and images: the template places each image's tokens)."""
    role: str
    content: str | list[TextPart | ImagePart] | None = ""
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Constraint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the output must match (constrained decoding, llguidance; shared/grammar.py): a JSON
    schema (its JSON text), a Lark grammar in llguidance's dialect, a regex, or a GBNF grammar
    (llama.cpp's, translated by llguidance). It applies after
    the reasoning when the prompt leaves a <think> block open. The coordinator compiles it before
    queueing: one that does not compile is refused with an Error (code "invalid_grammar")."""
    kind: Literal["json_schema", "lark", "regex", "gbnf"]
    text: str


class Generate(_Msg, tag="generate"):
    """client -> coordinator: start a request. Exactly one of prompt, tokens, messages.
    Replies: a stream of Token, then one Done (or one Error if refused)."""
    request_id: str
    prompt: str | None = None
    tokens: list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None       # None: until end of generation or of the context (llama.cpp's -1)
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stop: list[str] = []
    ignore_eos: bool = False            # as vLLM's ignore_eos: end-of-generation tokens are streamed, not obeyed
    logprobs: int | None = None         # None: none; n in [0, 20]: each token's and the n most likely ones
    # with messages: OpenAI's tool objects ({"type": "function", "function": {...}}) and the chat
    # template's extra variables (enable_thinking, preserve_thinking...), as transformers passes them
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    grammar: Constraint | None = None   # None: unconstrained
    # with messages whose prompt leaves a <think> block open: after this many reasoning tokens
    # the model's end of reasoning (</think> and the blank line after it) is forced, so that the
    # answer (or a grammar's constrained part) follows; None: the coordinator's
    # --reasoning-budget; -1: no limit
    reasoning_budget: int | None = None
    # with messages: continue the final (assistant) message, its end-of-turn left off, instead of
    # starting a new turn (an assistant prefill); add_generation_prompt false: no new turn either
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # refuse it (Error code "queue_full") when this client has this many requests waiting for
    # their first token already: checked after the request is validated, so that a bad request
    # gets its own error however full the queue (the HTTP front end's --max-queue)
    max_queue: int | None = None
    # the sampling fields (and max_tokens) the client left to the server's defaults (llama-server's
    # --temp, -n, ...: the coordinator's); those it does not name are the client's own
    unset: list[str] = []
    # llama-server's return_progress: a Progress after each forward pass over the prompt
    return_progress: bool = False


class Cancel(_Msg, tag="cancel"):
    """client -> coordinator: stop a request of this client; it ends with Done(cancelled)."""
    request_id: str


class Status(_Msg, tag="status"):
    """client -> coordinator: ask for a StatusReply."""


class TokenLogprob(msgspec.Struct, forbid_unknown_fields=True):
    token: int
    logprob: float


class Token(_Msg, tag="token"):
    """coordinator -> client: one generated token and the text it completes (may be "");
    with Generate.logprobs, its log-probability and the most likely tokens' (the model's
    distribution, before sampling modifiers)."""
    request_id: str
    token: int
    text: str
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None


class Started(_Msg, tag="started"):
    """coordinator -> client, once, when the request first goes to a worker (before its first
    Token): the prompt's tokens and how many of them were found cached, as its Done will
    report them. A streamed API's opening event can then carry the prompt's size."""
    request_id: str
    prompt_tokens: int
    cached_prompt_tokens: int


class Progress(_Msg, tag="progress"):
    """worker -> coordinator -> client, with Generate.return_progress: `processed` of the
    prompt's tokens are in the sequence's state (those resumed from a snapshot included) after
    `time_ms` of its forward passes. One after each pass over the prompt; none once it decodes."""
    request_id: str
    processed: int
    time_ms: float


class Done(_Msg, tag="done"):
    """coordinator -> client: the request is over. Timings in milliseconds and tokens/s."""
    request_id: str
    finish_reason: FinishReason
    error: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_ms: float = 0.0             # the prompt's forward passes (0: resumed whole from a snapshot)
    decode_tok_s: float = 0.0           # tokens after the first one, per second
    stop_reason: str | None = None      # as vLLM's: the stop string matched (None: end of generation or other)
    reasoning_tokens: int = 0           # of a chat's completion_tokens, those of its <think> block, the tags included
    prefill_device: str | None = None   # where the uncached part of the prompt ran: gpu or cpu (None: no prefill)
    decode_device: str | None = None    # hybrid: decode steps ran their dense part on a gpu worker; else cpu (None: none)
    prefill_estimates_ms: dict[str, float] = {}     # what the choice was made on, by device
    prefill_batch: int = 0              # prompts prefilled in one batch with it on a GPU worker, itself included
    disk_ms: float = 0.0                # its prefix's snapshots brought from the disk tier in this long (0: none)


class Error(_Msg, tag="error"):
    """coordinator -> client: a message was refused (malformed, unknown, duplicate id...).
    A prompt longer than the context has code "context_length_exceeded" (OpenAI's) and
    llama-server's counts: the prompt's tokens and the positions a sequence may hold; a
    request that no worker can run (none is left) has code "unavailable"."""
    message: str
    request_id: str | None = None
    code: str | None = None
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None


class WorkerInfo(msgspec.Struct):
    worker_id: str
    pid: int
    threads: int
    running: int
    alive: bool
    kind: str = "cpu"                   # cpu (prefill and decode) or gpu (prefill only)
    device: str = ""
    prefill_tok_s: float = 0.0          # measured at start, then as it serves
    decode_tok_s: float = 0.0
    vision_tok_s: float = 0.0           # image tokens its vision tower encodes a second; 0: none yet


class StatusReply(_Msg, tag="status_reply"):
    """coordinator -> client: the daemon's state. `model` is the file it serves; `name` the
    model's name for clients (--alias, else --model as given); `fingerprint` the file's."""
    model: str
    workers: list[WorkerInfo]
    queued: int
    running: int
    snapshots: dict[str, int]
    name: str = ""
    fingerprint: str = ""
    max_request_size: int = MAX_MESSAGE_BYTES        # the largest client message it takes
    n_ctx: int = 0                  # the longest prompt + generation (--max-model-len); 0: not said
    max_sequences: int = 0          # per worker (--max-sequences); 0: not said
    vision: bool = False            # a vision tower is loaded (--mmproj): chat messages may hold images
    unavailable: str = ""           # why every request is refused now (no worker can run it); "": served
    reasoning: str = "auto"         # --reasoning: on, off or auto (the template's default)
    reasoning_budget: int = -1      # --reasoning-budget: -1 no limit, 0 thinking off
    # the sampling a request gets for the fields it leaves unset (--temp, ...: SamplingParams's
    # fields, llama.cpp's defaults where the server sets none) and its max_tokens (-n; -1: none)
    sampling_defaults: dict[str, Any] = {}
    n_predict: int = -1
    chat_template: str = ""         # --chat-template(-file): the template chats are rendered with; "": the model's
    chat_template_kwargs: dict[str, Any] = {}   # --chat-template-kwargs: under each request's own
    sleeping: bool = False          # --sleep-idle-seconds: its workers are stopped until a request comes


# ---- coordinator <-> worker ---------------------------------------------------
WorkerKind = Literal["cpu", "gpu"]


class Hello(_Msg, tag="hello"):
    """worker -> coordinator, first message: who the worker is and which model it loaded.
    A cpu worker prefills and decodes (Assign); a gpu worker only prefills (Prefill), on
    `device`. The rates are the worker's own measurement at start (0: not measured): a
    prompt of n tokens takes about prefill_fixed_ms + n / prefill_tok_s."""
    worker_id: str
    pid: int
    threads: int
    fingerprint: str
    kind: WorkerKind = "cpu"
    device: str = ""
    prefill_tok_s: float = 0.0
    prefill_fixed_ms: float = 0.0       # what any prompt costs on top of its tokens (a GPU streaming its experts)
    decode_tok_s: float = 0.0
    mailbox: str = ""                   # a cpu worker's hybrid-decode mailbox (shared/hybrid_link.py); "": none


class Welcome(_Msg, tag="welcome"):
    """coordinator -> worker, answer to Hello: the snapshot arena to attach (shared memory):
    its KV slots (`slot_bytes`, `n_slots`) and its state slots (`state_slot_bytes`,
    `n_state_slots`), and the element type of every sequence's KV cache (f16, f32), which
    its KV slots hold; `max_model_len`, the positions the host's memory is planned for (a
    GPU worker's batch of prompts holds at most that many in all; 0: unknown)."""
    arena: str
    slot_bytes: int
    n_slots: int
    state_slot_bytes: int
    n_state_slots: int
    block: int
    kv_cache_dtype: str
    max_model_len: int = 0


class Attached(_Msg, tag="attached"):
    """worker -> coordinator, answer to Welcome: whether the worker mapped the snapshot
    arena; it is ready from here on. One that did not (on another host, or started with
    --no-shared-memory) gets the snapshots of an Assign's `resume` as raw frames after
    the Assign (the KV slot of each, then the state slot of the last), and sends each
    snapshot it writes as raw frames after its SnapshotWritten (its KV slot's bytes if it
    has one, then its state slot's if it has one). No other message carries data frames."""
    arena: bool


class SnapshotRef(msgspec.Struct, forbid_unknown_fields=True):
    """A snapshot in the shared arena: its KV slot (-1: already cached, only the state is
    to be written), its state slot (-1: none, a KV link of a chain) and its position."""
    slot: int
    state: int
    position: int


class ImageInput(msgspec.Struct, forbid_unknown_fields=True):
    """An image of an Assign's prompt: its bytes, and where its merged tokens lie in
    `tokens`: [start, start + rows * cols), a rows x cols grid (the worker checks it)."""
    data: bytes
    start: int
    rows: int
    cols: int


class Assign(_Msg, tag="assign"):
    """coordinator -> worker: run a sequence. The worker restores `resume` (the KV slots
    of the chain in block order, the state slot of the last one), prefills the rest of
    `tokens`, writes each of `snapshots` as it passes that position, then decodes."""
    request_id: str
    tokens: list[int]
    resume: list[SnapshotRef]
    snapshots: list[SnapshotRef]
    max_tokens: int
    sampling: SamplingParams            # its seed always set (the coordinator's draw if the client gave none)
    ignore_eos: bool = False
    # (KV slot, state slot) pairs for snapshots while decoding: at each block boundary the
    # generation crosses (while a pair with a state is left beside it; a pair without one,
    # state -1, holds the block's KV alone) and of the final state when it ends (an
    # end-of-generation token or max_tokens) in a pair with a state: the next chat turn
    # resumes after them.
    decode_slots: list[tuple[int, int]] = []
    logprobs: int | None = None         # as in Generate
    # the request's Constraint as llguidance's grammar (its JSON form), the reasoning before it
    # included, compiled by the coordinator: the worker masks every token with it
    grammar: str | None = None
    # the prompt's images, in order: the worker runs the vision tower for those its resumed
    # snapshots do not cover, and gives every token its M-RoPE position
    images: list[ImageInput] = []
    # the prompt leaves <think> open: after reasoning_budget sampled reasoning tokens (none of
    # them </think>) the worker emits reasoning_end (</think> and the blank line after it)
    # instead of sampling; None: no limit
    reasoning_budget: int | None = None
    reasoning_end: list[int] = []
    progress: bool = False              # Generate.return_progress: a Progress after each prompt pass


class Stop(_Msg, tag="stop"):
    """coordinator -> worker: end a sequence now (cancelled, a stop string, client gone)."""
    request_id: str


class Shutdown(_Msg, tag="shutdown"):
    """coordinator -> worker: finish nothing, exit."""


class Sampled(_Msg, tag="sampled"):
    """worker -> coordinator: the next token of a sequence; the first one says how long
    the sequence's prompt took (milliseconds of its forward passes)."""
    request_id: str
    token: int
    prefill_ms: float | None = None
    logprob: float | None = None        # with Assign.logprobs, as in Token
    top_logprobs: list[TokenLogprob] | None = None
    # the first one also: its images' merged tokens the vision tower encoded, and its time
    # (not in prefill_ms), from which the coordinator learns the worker's tower rate
    vision_tokens: int = 0
    vision_ms: float = 0.0


class SnapshotWritten(_Msg, tag="snapshot_written"):
    """worker -> coordinator: a planned snapshot's slots (its KV slot `slot`, its state
    slot `state`; -1: none) now hold the state at its position; a decode pair
    (Assign.decode_slots) the state at `position`."""
    request_id: str
    slot: int
    state: int
    position: int = -1                  # of a decode pair's snapshot (a planned one's is known)


class DecodeSlots(_Msg, tag="decode_slots"):
    """coordinator -> worker: more (KV slot, state slot) pairs for a running sequence's
    decode snapshots (one comes for each block-boundary snapshot written into an earlier one)."""
    request_id: str
    slots: list[tuple[int, int]]


class Finished(_Msg, tag="finished"):
    """worker -> coordinator: a sequence ended ("stop" = end-of-generation token)."""
    request_id: str
    finish_reason: FinishReason
    prefill_ms: float
    decode_ms: float
    completion_tokens: int
    error: str | None = None
    hybrid_steps: int = 0               # its decode steps whose dense part ran on a gpu worker


class Goodbye(_Msg, tag="goodbye"):
    """worker -> coordinator: exiting now (stopped by hand, SIGTERM or Ctrl-C); what it
    was running is replayed elsewhere at once, not after the heartbeat timeout."""


class Prefill(_Msg, tag="prefill"):
    """coordinator -> gpu worker: prefill only. Restore `resume` (as in Assign), run the
    rest of `tokens`, write each of `snapshots` as the prompt passes its position (the
    last one, at len(tokens), holds the final state and its logits: a cpu worker decodes
    from there), then reply Prefilled. Snapshots travel as frames as for an Assign."""
    request_id: str
    tokens: list[int]
    resume: list[SnapshotRef]
    snapshots: list[SnapshotRef]
    images: list[ImageInput] = []       # as in Assign: the GPU worker runs the tower for them


class Prefilled(_Msg, tag="prefilled"):
    """gpu worker -> coordinator: a Prefill is done (every SnapshotWritten sent before
    it), or failed with `error` (then no snapshot of it is to be trusted). Prompts
    waiting on a GPU worker are prefilled in one batch: `prefill_ms` is the batch's time,
    `batch_tokens` the tokens it prefilled, `batch_prompts` its prompts (this one included)."""
    request_id: str
    prefill_ms: float
    error: str | None = None
    batch_tokens: int = 0
    batch_prompts: int = 1
    vision_tokens: int = 0              # the batch's image tokens through the tower, and its time (in prefill_ms)
    vision_ms: float = 0.0


class Heartbeat(_Msg, tag="heartbeat"):
    """worker -> coordinator, every second: still alive, this many sequences."""
    running: int


CLIENT_MESSAGES = Union[Generate, Cancel, Status]
CLIENT_REPLIES = Union[Started, Progress, Token, Done, Error, StatusReply]
class HybridPeer(_Msg, tag="hybrid_peer"):
    """coordinator -> gpu worker: serve the decode steps of the cpu worker `worker_id` (pid
    `pid`) through its mailbox (shared/hybrid_link.py: the dense part here, its routed
    experts there)."""
    worker_id: str
    mailbox: str
    pid: int


class HybridReady(_Msg, tag="hybrid_ready"):
    """coordinator -> cpu worker: a gpu worker (pid `pid`) serves your mailbox: decode there."""
    pid: int


class HybridLost(_Msg, tag="hybrid_lost"):
    """coordinator -> cpu worker: the gpu worker serving your mailbox is gone: decode here, and
    open a new mailbox (HybridMailbox) for the next one."""


class HybridMailbox(_Msg, tag="hybrid_mailbox"):
    """cpu worker -> coordinator: a new mailbox, its gpu worker lost (as Hello.mailbox)."""
    mailbox: str


TO_WORKER = Union[Welcome, Assign, Prefill, Stop, Shutdown, DecodeSlots, HybridPeer, HybridReady, HybridLost]
FROM_WORKER = Union[Hello, Attached, Sampled, Progress, SnapshotWritten, Finished, Prefilled, Heartbeat, Goodbye, Error,
                    HybridMailbox]

_encoder = msgspec.msgpack.Encoder()
_decoders = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def set_max_message_bytes(n: int) -> None:
    """The largest message this process decodes (the coordinator's --max-request-size)."""
    global _limit
    _limit = n


def max_message_bytes() -> int:
    return _limit


class _Addressed(msgspec.Struct):
    """Only the request_id of a message; every other field is skipped unread."""
    request_id: str | None = None


_addressed = msgspec.msgpack.Decoder(_Addressed)


def request_id_of(data: bytes) -> str | None:
    """The request_id of a message that failed to decode, if it has a readable one: the
    Error answering it then reaches the request's stream (Client.stream waits by id)."""
    if len(data) > _limit:
        return None
    try:
        return _addressed.decode(data).request_id
    except Exception:       # not a map, a request_id not a string, nesting past the decoder's bound...
        return None


def decode(data: bytes, kind):
    """Decode one message of the union `kind`; any defect is a ProtocolError naming it.
    Whatever the bytes (truncated, nested without end, of the wrong types), nothing else
    is raised: a receiver answers or logs the error and goes on with its next message."""
    if len(data) > _limit:
        raise ProtocolError(f"the message is {len(data)} bytes, over the limit of {_limit} bytes "
                            f"(the coordinator's --max-request-size raises it)")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        msg = decoder.decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"not a MessagePack message: {e}") from None
    except RecursionError:
        raise ProtocolError(f"the message nests containers deeper than {MAX_NESTING} levels") from None
    except Exception as e:              # a decoder's own limit we have not met yet: still one bad message
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
    for field, value in _free_form(msg):
        if not _nests_within(value, MAX_NESTING):
            raise ProtocolError(f"invalid message: `{field}` nests containers deeper than {MAX_NESTING} levels")
    return msg


def _free_form(msg):
    """(name, value) of the fields whose type is Any (JSON objects of the client's own)."""
    if not isinstance(msg, Generate):
        return
    yield "tools", msg.tools
    yield "chat_template_kwargs", msg.chat_template_kwargs
    for i, m in enumerate(msg.messages or ()):
        for j, call in enumerate(m.tool_calls or ()):
            yield f"messages[{i}].tool_calls[{j}].function.arguments", call.function.arguments


def _nests_within(value, limit: int) -> bool:
    """Whether no list or dict in `value` lies more than `limit` containers deep (no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        if depth == limit:
            return False
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return True
