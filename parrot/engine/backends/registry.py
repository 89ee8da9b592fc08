"""The backend registry: which code turns a model source into a ``Forward``.

A backend is one module that calls :func:`register_backend` with an object of the
:class:`Backend` shape: a name, a check that says (cheaply, before anything is loaded) whether it
can load a source and why not, the memory loading would take, the loading itself, and what to
say about the result (start-up log, ``/health``). ``model.backend = "auto"`` tries the backends
in the order they registered and takes the first that can load the source; a name picks that
backend. The built-in ones (``native``, then ``hf``) register when ``parrot.engine.backends`` is
imported; another one registers by being imported before the model loads (a test file, a
plugin module), with no edit elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

from parrot.config import ModelConfig
from parrot.engine.backend import LoadedModel
from parrot.engine.source import ModelSource

log = logging.getLogger("parrot.engine")


class BackendDeclined(Exception):
    """Raised by ``Backend.load`` when, having started, the backend finds it cannot run this
    model after all (a tensor format its kernels lack, say); with ``auto`` the next backend loads
    it instead, and the reason is logged."""


class Backend(Protocol):
    name: str

    def unsupported(self, source: ModelSource, config: ModelConfig) -> str | None:
        """None when this backend can load ``source`` as ``config`` asks; else why not, in a few
        words. Reads at most a file header or a config.json: nothing is loaded yet."""
        ...

    def memory_needed(self, source: ModelSource, config: ModelConfig) -> tuple[int, str] | None:
        """Bytes loading takes at its peak and how that was counted, or None when unknown."""
        ...

    def load(self, source: ModelSource, config: ModelConfig) -> LoadedModel:
        """The loaded model (raise ``BackendDeclined`` to hand it to the next backend)."""
        ...

    def wrap(self, hf_model: Any, tokenizer: Any, name: str, blocks: dict[str, Any], activations: str) -> LoadedModel | None:
        """A transformers model already in memory behind this backend's forward, or None where it
        cannot run it (tests and benchmarks compare the backends on one loaded model)."""
        ...

    def describe(self, loaded: LoadedModel) -> dict[str, Any]:
        """What the start-up log and ``/health`` say about a model this backend loaded: at least
        ``summary`` (one line); other keys are the backend's own (kernel set, weight format)."""
        ...


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add ``backend`` (after the ones registered before it, for ``auto``); a name registered
    again is replaced in place."""
    if not backend.name or backend.name == "auto":
        raise ValueError(f"a backend needs a name other than {backend.name!r}")
    _BACKENDS[backend.name] = backend


def unregister_backend(name: str) -> None:
    _BACKENDS.pop(name, None)


def backend_names() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"model.backend {name!r} is not a backend: give auto or one of "
                         f"{', '.join(_BACKENDS)}") from None


def candidates(source: ModelSource, config: ModelConfig) -> Iterator[Backend]:
    """The backends to try for ``source``, in order, each asked only when the one before it was
    not taken: with ``auto`` every registered one that can load it, else the one named. Raises
    ValueError, with each one's reason, when none can."""
    named = [get_backend(config.backend)] if config.backend != "auto" else list(_BACKENDS.values())
    reasons = {}
    for backend in named:
        reason = backend.unsupported(source, config)
        if reason is None:
            yield backend
        else:
            log.debug("backend %s passes %s: %s", backend.name, source.display_name, reason)
            reasons[backend.name] = reason
    if len(reasons) == len(named):
        why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
        raise ValueError(f"no backend can load {source.display_name} ({why})")
