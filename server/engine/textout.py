"""Turning accepted token ids into text: no half UTF-8 character, no part of a stop string.

A verification pass can accept several tokens at once, so the text grows by several tokens per
step. ``TextAssembler.add`` returns the part of the text that is safe to send:

- text that ends in U+FFFD is an incomplete UTF-8 character (byte-level BPE splits characters
  across tokens); it is held back until the character is complete;
- the longest suffix of the text that is a prefix of a stop string is held back, since the next
  tokens may complete the stop string;
- when a stop string appears, the text is cut before it, the tokens after the one that completed
  it are dropped, and nothing of the stop string is ever sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

TokenId = int


class Decoder(Protocol):
    def decode(self, ids: Sequence[TokenId], skip_special_tokens: bool = True) -> str: ...


@dataclass
class TextAssembler:
    decoder: Decoder
    stop: tuple[str, ...] = ()
    ids: list[TokenId] = field(default_factory=list)
    text: str = ""  # decoded text of ``ids`` (cut before a stop string once one is found)
    sent: int = 0  # characters of ``text`` already returned
    stopped: str | None = None  # the stop string that ended generation

    def add(self, new_ids: Sequence[TokenId]) -> tuple[int, str]:
        """Append tokens. Returns (how many of them are kept, the text that may be sent now).

        Fewer than ``len(new_ids)`` are kept only when a stop string appears: the tokens after
        the one that completed it are not part of the output.
        """
        kept = len(new_ids)
        start = len(self.ids)
        self.ids.extend(new_ids)
        self.text = self.decoder.decode(self.ids)
        if self.stop:
            hit = self._find_stop(len(new_ids))
            if hit is not None:
                index, stop, kept = hit
                del self.ids[start + kept :]
                self.text = self.text[:index]
                self.stopped = stop
                return kept, self.flush()
        return kept, self._safe_delta()

    def flush(self) -> str:
        """Everything not sent yet (generation has ended)."""
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta

    def _safe_delta(self) -> str:
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        end -= self._stop_prefix_length(end)
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def _stop_prefix_length(self, end: int) -> int:
        """Length of the longest suffix of text[:end] that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, end - self.sent), longest, -1):
                if self.text.endswith(stop[:n], 0, end):
                    longest = n
                    break
        return longest

    def _find_stop(self, num_new: int) -> tuple[int, str, int] | None:
        """(character index, stop string, tokens kept of the new ones) of the first stop string."""
        # A stop string can only start after what was already sent (sent text held none).
        first = None
        for stop in self.stop:
            index = self.text.find(stop, max(self.sent - len(stop) + 1, 0))
            if index >= 0 and (first is None or index < first[0]):
                first = (index, stop)
        if first is None:
            return None
        index, stop = first
        # The fewest new tokens whose text already contains the stop string.
        base = len(self.ids) - num_new
        for kept in range(1, num_new + 1):
            if self.decoder.decode(self.ids[: base + kept]).find(stop, index) == index:
                return index, stop, kept
        return index, stop, num_new
