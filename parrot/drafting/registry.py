"""Drafters by name: the registry behind the configuration's ``drafting.method``.

A drafter module registers a factory under its method name when it is imported::

    @register_drafter("suffix")
    def _suffix(settings: DrafterSettings) -> SuffixDrafter: ...

``parrot/drafting/__init__.py`` imports the built-in drafters, so ``import drafting`` registers
"suffix" and "ngram"; a test (or a plug-in) registers its own the same way. The configuration
accepts any registered method, and the engine builds a request's drafter with ``new_drafter``,
so adding a drafter needs no edit of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from parrot.drafting.drafter import Drafter, TokenId


@dataclass(frozen=True)
class DrafterSettings:
    """What a factory builds one request's drafter from: the ``[drafting]`` fields drafters read
    (a drafter uses those it needs) and the request's stop tokens."""

    min_n: int = 1
    max_n: int = 8
    threshold: float = 0.1
    stop_token_ids: frozenset[TokenId] = frozenset()


DrafterFactory = Callable[[DrafterSettings], Drafter]
Factory = TypeVar("Factory", bound=DrafterFactory)

_FACTORIES: dict[str, DrafterFactory] = {}


def register_drafter(method: str) -> Callable[[Factory], Factory]:
    """Decorator: register ``factory`` as the drafter of ``drafting.method = method``."""

    def register(factory: Factory) -> Factory:
        if method in _FACTORIES:
            raise ValueError(f"drafting method {method!r} is already registered")
        _FACTORIES[method] = factory
        return factory

    return register


def drafter_methods() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    return tuple(_FACTORIES)


def new_drafter(method: str, settings: DrafterSettings) -> Drafter:
    """A new drafter for one request."""
    factory = _FACTORIES.get(method)
    if factory is None:
        raise ValueError(f"unknown drafting method {method!r} (registered: {', '.join(_FACTORIES)})")
    return factory(settings)
