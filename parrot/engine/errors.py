"""Why a request did not run to the end, as types the HTTP layer dispatches on.

``EngineRequestError`` and its subclasses are the request's fault (``Engine.start`` raises them;
HTTP 400); ``EngineStopped`` means the server is shutting down (HTTP 503); any other
``EngineError`` is the server's fault (the engine failed; HTTP 500). ``EngineRequestError`` is also a ``ValueError``, so callers that run the engine
directly (the CLI, benchmarks) catch it as one.
"""

from __future__ import annotations


class EngineError(Exception):
    """A request could not be run (invalid for the engine, or the engine failed)."""


class EngineStopped(EngineError):
    """The engine stopped before the request ended: the server is shutting down (HTTP 503)."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class EngineRequestError(EngineError, ValueError):
    """The request cannot run as given."""


class EmptyPrompt(EngineRequestError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty")


class ContextWindowExceeded(EngineRequestError):
    """The prompt and ``max_tokens`` together do not fit in the model's context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_window: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_window = context_window
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
            f"exceeds the context window of {context_window} tokens"
        )
