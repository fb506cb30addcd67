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


class ChatTemplateError(FermoeError, ValueError):
    """A model's chat template refused the messages (its raise_exception())."""
