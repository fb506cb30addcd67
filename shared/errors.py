"""The exceptions fermoe raises on bad input. Each names the file, key or field at fault."""


class FermoeError(Exception):
    """Base of every error fermoe reports to a user instead of a traceback."""


class GGUFError(FermoeError):
    """A GGUF file is unreadable, corrupt, truncated, or not a model we can run."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class ModelError(FermoeError):
    """A model (config, tensors or checkpoint) contradicts itself or what we support."""


class ProtocolError(FermoeError):
    """A wire message is malformed, oversized, wrongly typed or unknown."""


class ContextLengthError(FermoeError):
    """A sequence would run past its model's context length (context_length, n_ctx_train)."""


class PromptTooLong(ContextLengthError):
    """A request's prompt has more tokens than a sequence may hold: OpenAI's
    context_length_exceeded, with llama-server's counts (wire_fields, for an Error)."""

    def __init__(self, message: str, n_prompt_tokens: int, n_ctx: int):
        super().__init__(message)
        self.wire_fields = {"code": "context_length_exceeded", "n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx}


class ChatTemplateError(FermoeError, ValueError):
    """A model's chat template refused the messages (its raise_exception())."""


class GrammarError(FermoeError, ValueError):
    """A constraint llguidance cannot compile: an invalid JSON schema, Lark grammar or regex."""
    wire_fields = {"code": "invalid_grammar"}     # the Error's code (protocol.Error)
