"""Where Parrot keeps what it builds once per machine: converted models, compiled kernels."""

from __future__ import annotations

import os


def cache_root() -> str:
    """``PARROT_CACHE_DIR``, or ``~/.cache/parrot``."""
    return os.environ.get("PARROT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "parrot")
