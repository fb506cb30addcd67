"""llama-server's command line, taken by `coordinator` beside its own, so that a command
copied from a model card starts fermoe (`-m M.gguf --jinja -c 65536 --temp 0.6 -a qwen3.6`).

Three kinds of llama-server flag, besides those the coordinator's parser takes under
llama-server's spellings (options.py: -m, -c, -t, -np, -n, --host, --port, the sampling
defaults, -ctk/-ctv):

- NO_EFFECT: flags that would not change the output here (where weights live, attention
  kernels, batch sizes, logging): accepted, and one line in the log says what fermoe does
  instead;
- REFUSED: flags that would change the output and that fermoe does not implement: refused
  at start, naming the flag and what it would have changed;
- anything else unknown is the parser's own error.

docs/serving.md has the table of them all.
"""
from __future__ import annotations

from shared.errors import FermoeError
from shared.sampling import WHOLE_CONTEXT

SWITCH, VALUE = 0, 1        # a flag alone, or a flag and its value
OPTIONAL = ("on", "off", "auto")    # a flag whose value may follow (`-fa`, `-fa on`)

# flag spellings -> (arity, what fermoe does instead)
NO_EFFECT: dict[tuple[str, ...], tuple[object, str]] = {
    ("--jinja",): (SWITCH, "fermoe always renders the model's own Jinja chat template"),
    ("-ngl", "--gpu-layers", "--n-gpu-layers"): (
        VALUE, "the weights stay in host memory; GPU workers (--gpu, --gpu-mem) stream them layer by layer"),
    ("-fa", "--flash-attn"): (OPTIONAL, "attention runs in fermoe's own kernels"),
    ("--no-mmap", "--mmap", "--mlock"): (SWITCH, "fermoe maps the GGUF and keeps the experts where it decides"),
    ("-b", "--batch-size", "-ub", "--ubatch-size"): (VALUE, "fermoe plans its own prefill passes"),
    ("-cb", "--cont-batching", "-nocb", "--no-cont-batching"): (
        SWITCH, "requests are always batched (--max-sequences per worker)"),
    ("-ot", "--override-tensor"): (VALUE, "the experts already live in host memory"),
    ("-cmoe", "--cpu-moe"): (SWITCH, "the experts already live in host memory"),
    ("-ncmoe", "--n-cpu-moe"): (VALUE, "the experts already live in host memory"),
    ("--metrics",): (SWITCH, "/metrics is always served"),
    ("--no-webui", "--webui"): (SWITCH, "the chat page is served at /"),
    ("--log-disable", "-v", "--verbose", "--log-colors", "--log-prefix", "--log-timestamps"): (
        SWITCH, "the log goes to stderr, one line per event"),
    ("-lv", "--log-verbosity", "--verbosity", "--log-file"): (VALUE, "the log goes to stderr, one line per event"),
    ("-to", "--timeout", "--threads-http"): (VALUE, "the HTTP front end is one asyncio process"),
    ("-tb", "--threads-batch"): (VALUE, "prefill uses the worker's threads (--threads)"),
    ("--no-warmup",): (SWITCH, "workers measure their rates at start"),
    ("--numa",): (VALUE, "workers are pinned per NUMA node; --numa-interleave spreads the weights"),
    ("-dev", "--device", "-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu"): (
        VALUE, "GPU workers are chosen with --gpu"),
    ("--cache-reuse",): (VALUE, "the snapshot cache resumes any cached prefix (--snapshot-mem)"),
    ("-kvu", "--kv-unified", "--swa-full", "--no-kv-offload", "-nkvo"): (
        SWITCH, "the KV cache is fermoe's own (--snapshot-mem, --kv-cache-dtype)"),
    ("--prio", "--prio-batch", "--poll", "--poll-batch", "-C", "--cpu-mask", "-Cr", "--cpu-range"): (
        VALUE, "workers are pinned to their NUMA node's cores"),
}

# flag spellings -> what it would have changed (not implemented, so refused)
REFUSED: dict[tuple[str, ...], str] = {
    ("--no-jinja",): "the chat template's rendering (fermoe renders the model's Jinja template)",
    ("--lora", "--lora-scaled", "--lora-init-without-apply", "--control-vector", "--control-vector-scaled",
     "--control-vector-layer-range"): "the weights (adapters)",
    ("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
     "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast"): "the positions (RoPE)",
    ("--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file"): (
        "every answer's grammar (give one per request instead: grammar, json_schema, response_format)"),
    ("--samplers", "--sampling-seq", "--sampler-seq", "--mirostat", "--mirostat-lr", "--mirostat-ent", "--typical",
     "--top-nsigma", "--xtc-probability", "--xtc-threshold", "--dry-multiplier", "--dry-base",
     "--dry-allowed-length", "--dry-penalty-last-n", "--dry-sequence-breaker", "--dynatemp-range",
     "--dynatemp-exp", "-l", "--logit-bias", "--ignore-eos"): "the sampling",
    ("--embedding", "--embeddings", "--rerank", "--reranking", "--pooling"): "what is served (no embeddings here)",
    ("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-mu", "--model-url"): (
        "where the model comes from (fermoe downloads nothing: give -m FILE)"),
    ("-md", "--model-draft", "-hfd", "--hf-repo-draft", "--draft", "--draft-max", "--draft-min",
     "--spec-replace"): "the decoding (no speculative decoding here)",
    ("--slot-save-path", "--props", "--api-key-file",
     "--ssl-key-file", "--ssl-cert-file"): "what the server exposes (not implemented yet)",
}


def _table(table: dict) -> dict[str, object]:
    return {flag: value for flags, value in table.items() for flag in flags}


_NO_EFFECT, _REFUSED = _table(NO_EFFECT), _table(REFUSED)


def strip(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv without llama-server's flags that have no effect here, and one log line for each
    (what fermoe does instead); a flag that would change the output is a FermoeError naming it."""
    out, notes, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        flag, has_value, _ = arg.partition("=")
        if flag in _REFUSED:
            raise FermoeError(f"{flag}: llama-server's flag is not supported by fermoe (it would change "
                              f"{_REFUSED[flag]}); leave it out")
        if flag not in _NO_EFFECT:
            out.append(arg)
            i += 1
            continue
        arity, instead = _NO_EFFECT[flag]
        taken = [arg]
        if not has_value:
            follows = argv[i + 1] if i + 1 < len(argv) else None
            if arity == VALUE:
                if follows is None:
                    raise FermoeError(f"{flag}: expected a value")
                taken.append(follows)
            elif arity == OPTIONAL and follows in OPTIONAL:
                taken.append(follows)
        notes.append(f"{' '.join(taken)}: accepted without effect ({instead})")
        i += len(taken)
    return out, notes


# ---- the flags the coordinator takes under llama-server's names ------------------------

# sampling defaults: flag, SamplingParams field, type (the defaults of every request that
# does not set its own)
SAMPLING_FLAGS = (("--temp", "temperature", float), ("--top-k", "top_k", int), ("--top-p", "top_p", float),
                  ("--min-p", "min_p", float), ("--repeat-penalty", "repeat_penalty", float),
                  ("--repeat-last-n", "repeat_last_n", int), ("--presence-penalty", "presence_penalty", float),
                  ("--frequency-penalty", "frequency_penalty", float))
# --chat-template NAME: the templates known by name (llama.cpp knows more; a Jinja text or
# --chat-template-file gives any other)
NAMED_TEMPLATES = {
    "chatml": "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
              "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
              "{%- endif %}",
}


def add_options(p) -> None:
    g = p.add_argument_group("llama-server's flags (the defaults of every request that does not set its own)")
    g.add_argument("--host", default=None, help="with --port: serve the HTTP API there (llama-server's; a comma "
                                                "list for several; default 127.0.0.1), the same as --http HOST:PORT")
    g.add_argument("--port", type=int, default=None, help="with --host: the HTTP API's port (default 8080)")
    g.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="as --max-model-len (0: the model's context length)")
    g.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=None, metavar="N",
                   help="tokens a request generates when it does not say (-1: until its end; default -1)")
    for flag, field, kind in SAMPLING_FLAGS:
        g.add_argument(flag, dest=f"default_{field}", type=kind, default=None, metavar="X",
                       help=f"the {field} of a request that does not give one")
    g.add_argument("-s", "--seed", dest="default_seed", type=int, default=None, metavar="N",
                   help="the seed of a request that does not give one (-1: a random one each; default -1)")
    g.add_argument("--chat-template", default=None, metavar="NAME-or-JINJA",
                   help=f"render chats with this template instead of the model's: a Jinja template, or one of "
                        f"{', '.join(NAMED_TEMPLATES)}")
    g.add_argument("--chat-template-file", default=None, metavar="FILE", help="the same, from a file")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='the template\'s variables for every chat, under a request\'s own (e.g. '
                        '\'{"enable_thinking": false}\')')
    g.add_argument("-ctk", "--cache-type-k", default=None, metavar="TYPE", help="as --kv-cache-dtype (both halves)")
    g.add_argument("-ctv", "--cache-type-v", default=None, metavar="TYPE", help="as --kv-cache-dtype (both halves)")


def apply(opts) -> None:
    """llama-server's spellings onto the coordinator's options: --host/--port as --http,
    -c 0 as the model's context, -ctk/-ctv as --kv-cache-dtype, the sampling defaults
    checked (opts.sampling_defaults: SamplingParams fields) and -n as opts.n_predict."""
    from shared.sampling import InvalidSampling, SamplingParams
    if opts.host is not None or opts.port is not None:
        if opts.http is not None:
            raise FermoeError("--host/--port and --http: give one (--http HOST:PORT)")
        port = 8080 if opts.port is None else opts.port
        opts.http = ",".join(f"[{h}]:{port}" if ":" in h else f"{h}:{port}"
                             for h in (opts.host or "127.0.0.1").split(",") if h.strip())
    if opts.ctx_size is not None:
        if opts.max_model_len is not None:
            raise FermoeError("-c/--ctx-size and --max-model-len: give one")
        if opts.ctx_size < 0:
            raise FermoeError(f"-c {opts.ctx_size}: must be >= 0 (0: the model's context length)")
        opts.max_model_len = opts.ctx_size or None
    halves = {t for t in (opts.cache_type_k, opts.cache_type_v) if t is not None}
    if len(halves) > 1:
        raise FermoeError(f"-ctk {opts.cache_type_k} -ctv {opts.cache_type_v}: fermoe keeps K and V in one type")
    if halves:
        from shared.state import KV_DTYPES
        opts.kv_cache_dtype = halves.pop()
        if opts.kv_cache_dtype not in KV_DTYPES:
            raise FermoeError(f"-ctk/-ctv {opts.kv_cache_dtype}: fermoe's KV cache types are {', '.join(KV_DTYPES)}")
    defaults = {field: getattr(opts, f"default_{field}") for _, field, _ in SAMPLING_FLAGS
                if getattr(opts, f"default_{field}") is not None}
    if defaults.get("repeat_last_n") == -1:
        defaults["repeat_last_n"] = WHOLE_CONTEXT
    if opts.default_seed is not None and opts.default_seed != -1:
        defaults["seed"] = opts.default_seed
    try:
        SamplingParams(**defaults)
    except InvalidSampling as e:
        flag = next((f for f, field, _ in SAMPLING_FLAGS if field == e.field), "--seed")
        raise FermoeError(f"{flag}: {e}") from None
    opts.sampling_defaults = defaults
    if opts.n_predict is not None and (opts.n_predict == 0 or opts.n_predict < -1):
        raise FermoeError(f"-n {opts.n_predict}: must be >= 1, or -1 for no limit")
    opts.n_predict = None if opts.n_predict in (None, -1) else opts.n_predict
    opts.chat_template = _chat_template(opts)
    opts.chat_template_kwargs = _template_kwargs(opts.chat_template_kwargs)


def _chat_template(opts) -> str | None:
    """The template text --chat-template or --chat-template-file gives, checked to parse."""
    if opts.chat_template is not None and opts.chat_template_file is not None:
        raise FermoeError("--chat-template and --chat-template-file: give one")
    flag, text = "--chat-template", opts.chat_template
    if opts.chat_template_file is not None:
        flag = "--chat-template-file"
        try:
            with open(opts.chat_template_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise FermoeError(f"--chat-template-file {opts.chat_template_file}: cannot read it: {e}") from None
    elif text is not None and "{{" not in text and "{%" not in text:
        if text not in NAMED_TEMPLATES:
            raise FermoeError(f"--chat-template {text!r}: not a Jinja template, nor a name fermoe knows "
                              f"({', '.join(NAMED_TEMPLATES)}); give the template itself or --chat-template-file")
        text = NAMED_TEMPLATES[text]
    if text is None:
        return None
    from shared.tokenizer import check_chat_template
    try:
        check_chat_template(text)
    except FermoeError as e:
        raise FermoeError(f"{flag}: {e}") from None
    return text


def _template_kwargs(text: str | None) -> dict:
    if text is None:
        return {}
    import json
    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise FermoeError(f"--chat-template-kwargs: not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise FermoeError(f"--chat-template-kwargs: expected a JSON object, got {type(kwargs).__name__}")
    return kwargs
