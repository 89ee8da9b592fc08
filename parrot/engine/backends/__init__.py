"""Model backends (``registry.py`` says what one is). Importing the package registers the
built-in ones in the order ``model.backend = "auto"`` tries them: ``native``, then ``hf``."""

# The import order is the registration order, which is the order "auto" tries them in.
from parrot.engine.backends import native  # noqa: F401, I001  (registers itself)
from parrot.engine.backends import hf  # noqa: F401  (registers itself)
from parrot.engine.backends.registry import (
    Backend,
    BackendDeclined,
    backend_names,
    candidates,
    get_backend,
    register_backend,
    unregister_backend,
)

__all__ = ["Backend", "BackendDeclined", "backend_names", "candidates", "get_backend", "register_backend",
           "unregister_backend"]
