"""A chat request -> the prompt text, through the model's own chat template as transformers
renders it (tokenizer.apply_chat_template), with what OpenAI-style clients send adapted to
what chat templates read:

- a tool call's `arguments`, JSON text in OpenAI's API, becomes the mapping it encodes: the
  Qwen3.5/3.6 templates iterate `tool_call.arguments|items` (vLLM and llama-server do the same);
- `reasoning_content` (or `reasoning`, `thinking`) is passed on under every one of those names
  (tokenizer.render_chat_template), so the template decides where the reasoning goes;
- role `developer` (OpenAI's newer name for system, sent by Codex, opencode, the SDKs) is
  `system`, as llama-server maps it. The Qwen templates take one system message, the first
  ("System message must be at the beginning."); when the template refuses the messages, a
  leading run of system messages (Codex sends two developer messages) is merged into one,
  their texts joined by a blank line, and a system message after the first non-system one
  (Claude Code's mid-conversation system message) is rendered as a user message, in its
  place; a template that takes them keeps them as they are;
- tools other than `{"type": "function"}` (Codex sends web_search, image_generation...) are
  left out with a warning, as llama-server and ik_llama.cpp leave them out;
- `chat_template_kwargs` become template variables (enable_thinking, preserve_thinking, ...).

A message the template still refuses is a ChatTemplateError: the request's 400.

And back: turn_marks() reads a rendered Qwen (ChatML) prompt's tokens for where its turns
begin, the positions the coordinator keeps snapshots at for the next turn.
"""
from __future__ import annotations

import json
import logging
from functools import lru_cache

import msgspec
import numpy as np

from shared.errors import ChatTemplateError

log = logging.getLogger("fermoe.chat")

# variables the renderer sets itself: a client's chat_template_kwargs may not replace them
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def function_tools(tools) -> list[dict]:
    """The function tools of a request; any other kind is left out, with a warning."""
    kept, skipped = [], []
    for tool in tools or ():
        if isinstance(tool, dict) and tool.get("type") == "function":
            kept.append(tool)
        else:
            skipped.append(tool.get("type") if isinstance(tool, dict) else type(tool).__name__)
    if skipped:
        log.warning("tools of type %s left out: only function tools reach the chat template",
                    ", ".join(map(repr, skipped)))
    return kept


def _parts(content):
    """Content parts as the template reads them: {"type": "text", "text": ...} and, for an image,
    {"type": "image"} (its bytes stay out of the template: chat_images() hands them on)."""
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None) or type(part).__name__
        if kind in ("image", "ImagePart"):
            out.append({"type": "image"})
        else:
            out.append({"type": "text", "text": part["text"] if isinstance(part, dict) else part.text})
    return out


def chat_images(messages) -> list[bytes]:
    """The image bytes of a chat's messages, in the order the template places them."""
    images = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else m.content
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") == "image":
                images.append(part["data"])
            elif not isinstance(part, dict) and hasattr(part, "data"):
                images.append(part.data)
    return images


def template_messages(messages) -> list[dict]:
    """Protocol ChatMessages (or dicts of their fields) as the template's message mappings."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else m.content
        m = msgspec.to_builtins(m) if not isinstance(m, dict) else dict(m)
        if isinstance(content, list):
            m["content"] = _parts(content)
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") == "developer":
            m["role"] = "system"
        m.setdefault("content", "")      # an assistant's tool-call turn may have none; templates want text
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(i, j, call) for j, call in enumerate(m["tool_calls"])]
        out.append(m)
    return out


def _template_call(i: int, j: int, call: dict) -> dict:
    call = {k: v for k, v in call.items() if v is not None}
    function = dict(call.get("function") or {})
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ChatTemplateError(f"messages[{i}].tool_calls[{j}].function.arguments is JSON of a "
                                f"{type(args).__name__}, not of an object")
    function["arguments"] = args
    call["function"] = function
    return call


def check_kwargs(kwargs: dict | None) -> dict:
    kwargs = dict(kwargs or {})
    taken = sorted(RESERVED_KWARGS & set(kwargs))
    if taken:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields)")
    return kwargs


def render_chat(tokenizer, messages, tools=None, chat_template_kwargs: dict | None = None,
                continue_final: bool = False, add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat: `messages` (protocol ChatMessages or dicts), `tools` (OpenAI's
    tool objects), `chat_template_kwargs` (template variables); ends with the generation prompt,
    or (continue_final) with the final message's text, its end of turn left off, so that the
    model continues it (an assistant prefill)."""
    kwargs = check_kwargs(chat_template_kwargs)
    msgs = template_messages(messages)
    tools = function_tools(tools) or None
    if continue_final:
        msgs[-1] = {**msgs[-1], "content": _with_mark(msgs[-1]["content"])}
        add_generation_prompt = False
    try:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt, tools=tools, **kwargs)
    except ChatTemplateError:
        fixed = system_first(msgs)
        if fixed == msgs:
            raise
        text = tokenizer.apply_chat_template(fixed, add_generation_prompt, tools=tools, **kwargs)
    if not continue_final:
        return text
    end = text.rfind(CONTINUE_MARK)
    if end < 0:
        raise ChatTemplateError("the chat template does not render the final message's text as given, so it "
                                "cannot be continued")
    return text[:end]


# the end of a continued message's text, found in the rendered prompt and cut there: the
# template may trim or rewrite around the text, never inside it
CONTINUE_MARK = "\u2063fermoe-continue\u2063"


def _with_mark(content):
    if isinstance(content, list):
        return [*content, {"type": "text", "text": CONTINUE_MARK}]
    return (content or "") + CONTINUE_MARK


def system_first(msgs: list[dict]) -> list[dict]:
    """The messages with one system message at most, the first: the leading run of system
    messages merged into one (texts joined by a blank line), later ones as user messages."""
    lead = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
    out = [{**msgs[0], "content": _joined([m.get("content", "") for m in msgs[:lead]])}] if lead > 1 else msgs[:lead]
    return out + [{**m, "role": "user"} if m.get("role") == "system" else m for m in msgs[lead:]]


def _joined(contents: list) -> str | list:
    """Message contents as one: text joined by a blank line, or, with parts, the parts in order."""
    if all(isinstance(c, str) for c in contents):
        return "\n\n".join(c for c in contents if c)
    parts: list = []
    for c in contents:
        if parts:
            parts.append({"type": "text", "text": "\n\n"})
        parts += [{"type": "text", "text": c}] if isinstance(c, str) else c
    return parts


REASONING_MODES = ("on", "off", "auto")      # --reasoning, as llama-server's


def reasoning_kwargs(chat_template_kwargs: dict | None, mode: str = "auto", budget: int = -1) -> dict | None:
    """A chat's template variables with the server's reasoning default applied (--reasoning,
    --reasoning-budget): a request's own enable_thinking wins; otherwise off (or a budget of 0)
    sets enable_thinking false, on sets it true, auto leaves the template's default. The
    coordinator renders with these and the front end reads the same, so both agree on whether
    the output starts as reasoning."""
    kwargs = chat_template_kwargs or {}
    if "enable_thinking" in kwargs or (mode == "auto" and budget != 0):
        return chat_template_kwargs
    return {**kwargs, "enable_thinking": mode == "on" and budget != 0}


def opens_reasoning(tokenizer, chat_template_kwargs: dict | None = None) -> bool:
    """Whether the template's generation prompt leaves a <think> block open, so that what the
    model writes starts as reasoning (Qwen3.5/3.6 with thinking on: it ends `<think>\\n`)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    key = json.dumps(chat_template_kwargs or {}, sort_keys=True, default=str)
    return _opens_reasoning(tokenizer, key)


@lru_cache(maxsize=64)
def _opens_reasoning(tokenizer, kwargs_json: str) -> bool:
    try:
        kwargs = check_kwargs(json.loads(kwargs_json))
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], **kwargs)
    except Exception as e:     # a template that cannot render this probe: no reasoning is split out
        log.warning("the chat template's generation prompt could not be probed for <think>: %s", e)
        return False
    return text.rfind("<think>") > text.rfind("</think>")


# ---- reading a rendered Qwen (ChatML) prompt back --------------------------------------
TURN_MARKS = 2
TOOL_RESPONSE = b"<tool_response>"      # how a Qwen template opens a user turn that holds tool results
ROLE_LINE_TOKENS = 8        # <|im_start|>, the role, its newline: where a turn's own text starts


def turn_marks(tokenizer, tokens: list[int]) -> list[int]:
    """Where the turns of a chat prompt begin that its next turn may diverge right after,
    after their role line (ChatML's <|im_start|>ROLE and a newline): the last TURN_MARKS
    turns (the generation prompt and the last message), and the first answer after the
    last user message. A template that drops the reasoning of earlier answers once a new
    user message comes rewrites from that answer's first token, however many agent steps
    later: naming it in every prompt until then keeps its snapshot (the coordinator's
    SnapshotIndex.plan). None for a template without <|im_start|>."""
    opener = tokenizer.token_to_id.get("<|im_start|>")
    if opener is None:
        return []
    starts = np.flatnonzero(np.asarray(tokens) == opener).tolist()     # a prompt may be 200k tokens
    turns = [role_line(tokenizer, tokens, i) for i in starts]          # (role, where its text starts)
    marks = {start for _, start in turns[-TURN_MARKS:]}
    last_user = max((t for t, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last_user is not None and last_user + 1 < len(turns) and turns[last_user + 1][0] == "assistant":
        marks.add(turns[last_user + 1][1])
    return sorted(marks)


def role_line(tokenizer, tokens: list[int], i: int) -> tuple[str, int]:
    """The role of the turn whose <|im_start|> is tokens[i], and where its text begins
    (after the role line's newline; i if no newline comes within ROLE_LINE_TOKENS).
    A user turn that opens with <tool_response> is "tool": Qwen's templates render tool
    results as user turns."""
    piece = tokenizer.piece_bytes
    line, j = b"", i + 1
    while j < min(i + ROLE_LINE_TOKENS, len(tokens)) and b"\n" not in line:
        line += piece(tokens[j])
        j += 1
    if b"\n" not in line:
        return "", i
    role, text = line.split(b"\n", 1)
    text += b"".join(piece(t) for t in tokens[j:j + ROLE_LINE_TOKENS])
    role = role.decode("utf-8", "replace").strip()
    return ("tool" if role == "user" and text.startswith(TOOL_RESPONSE) else role), j
