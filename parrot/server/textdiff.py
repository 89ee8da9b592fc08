"""Character-offset edits between two texts, for /v1/correct."""

from __future__ import annotations

import difflib
import re
from typing import TypedDict

# Words, runs of whitespace, and single other characters: edits come out at word granularity
# ("go" -> "went"), not as scattered letters.
_UNIT = re.compile(r"\w+|\s+|[^\w\s]", re.UNICODE)


class Edit(TypedDict):
    start: int
    end: int
    replacement: str


def _units(text: str) -> tuple[list[str], list[int]]:
    units, starts = [], []
    for m in _UNIT.finditer(text):
        units.append(m.group())
        starts.append(m.start())
    starts.append(len(text))
    return units, starts


def char_edits(source: str, target: str) -> list[Edit]:
    """Edits, in increasing order of ``start``, that turn ``source`` into ``target``.

    Each edit replaces ``source[start:end]`` with ``replacement``; offsets are characters of the
    original ``source`` (apply them from the last to the first, or use ``apply_edits``).
    """
    a, a_starts = _units(source)
    b, b_starts = _units(target)
    edits: list[Edit] = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        edits.append({"start": a_starts[i1], "end": a_starts[i2], "replacement": target[b_starts[j1] : b_starts[j2]]})
    return edits


def apply_edits(source: str, edits: list[Edit]) -> str:
    out, pos = [], 0
    for e in edits:
        out.append(source[pos : e["start"]])
        out.append(e["replacement"])
        pos = e["end"]
    out.append(source[pos:])
    return "".join(out)
