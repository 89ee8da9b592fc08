"""Turning accepted token ids into text: no half UTF-8 character, no part of a stop string.

A verification pass can accept several tokens at once, so the text grows by several tokens per
step. ``TextAssembler.add`` returns the part of the text that is safe to send:

- text that ends in U+FFFD is an incomplete UTF-8 character (byte-level BPE splits characters
  across tokens); it is held back until the character is complete;
- with byte fallback (SentencePiece vocabularies) a run of byte tokens decodes as one piece of
  UTF-8 that a later byte can invalidate, text already decoded included: while the output ends in
  a byte token (``Decoder.text_may_change``), nothing new is sent;
- the longest suffix of the text that is a prefix of a stop string is held back, since the next
  tokens may complete the stop string;
- when a stop string appears, the text is cut before it, the tokens after the one that completed
  it are dropped, and nothing of the stop string is ever sent.

The text is the decoder's text of all the ids, but it is not decoded whole at every step, which
made a step's cost grow with the output (690 us per step at 2,000 tokens of SmolLM2's, 15% of a
one-token pass). For decoders that allow it (``decodes_incrementally``: a token's text depends on
its neighbours only through UTF-8 bytes split across tokens and the strip of a leading space from
the first token decoded, as byte-level BPE and SentencePiece decoders do), a step decodes a window
of the last tokens from a *prefix* token p: with r the tokens already read, text = (text of the
first r tokens) + decode(ids[p:])[len(decode(ids[p:r])):]. Both windows start at p, so the strip
of p's leading space cancels; r only moves past text that does not end in U+FFFD or in an open
run of byte tokens (so the bytes before it are whole characters and decode the same on their
own); p moves to the old r only where the window from it has text (a window starting on
skipped special tokens would strip the space of the token after them). A window that does not
extend the last one falls back to a whole decode. tests/test_textout.py checks the text against a whole decode after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

TokenId = int


class Decoder(Protocol):
    def decode(self, ids: Sequence[TokenId], skip_special_tokens: bool = True) -> str: ...

    # Optional: True when windows of ids may be decoded (see above); absent means False.
    # decodes_incrementally: bool
    # Optional: whether the next token can change the text of ``ids`` (see above).
    # def text_may_change(self, ids: Sequence[TokenId]) -> bool: ...


@dataclass
class TextAssembler:
    decoder: Decoder
    stop: tuple[str, ...] = ()
    ids: list[TokenId] = field(default_factory=list)
    text: str = ""  # decoded text of ``ids`` (cut before a stop string once one is found)
    sent: int = 0  # characters of ``text`` already returned
    stopped: str | None = None  # the stop string that ended generation
    # Incremental decoding (module docstring): the text of ids[:_read_at], the prefix token and
    # the text of ids[_prefix_at:_read_at] decoded from it.
    _committed: str = ""
    _read_at: int = 0
    _prefix_at: int = 0
    _prefix_text: str = ""

    def add(self, new_ids: Sequence[TokenId]) -> tuple[int, str]:
        """Append tokens. Returns (how many of them are kept, the text that may be sent now).

        Fewer than ``len(new_ids)`` are kept only when a stop string appears: the tokens after
        the one that completed it are not part of the output.
        """
        kept = len(new_ids)
        start = len(self.ids)
        self.ids.extend(new_ids)
        may_change = self._may_change()  # whether the next token can change this text
        self.text = self._decode(may_change)
        if self.stop:
            hit = self._find_stop(len(new_ids))
            if hit is not None:
                index, stop, kept = hit
                del self.ids[start + kept :]
                self.text = self.text[:index]
                self.stopped = stop
                return kept, self.flush()
        return kept, self._safe_delta(may_change)

    def _decode(self, may_change: bool) -> str:
        """The decoder's text of ``ids``, decoding only the last tokens where it can."""
        if not getattr(self.decoder, "decodes_incrementally", False):
            return self.decoder.decode(self.ids)
        window = self.decoder.decode(self.ids[self._prefix_at :])
        if not window.startswith(self._prefix_text):
            return self.decoder.decode(self.ids)
        text = self._committed + window[len(self._prefix_text) :]
        if not text.endswith("\ufffd") and not may_change:
            ahead = self.decoder.decode(self.ids[self._read_at :]) if self._read_at > self._prefix_at else window
            if ahead:
                self._prefix_at, self._prefix_text = self._read_at, ahead
            else:
                self._prefix_text = window
            self._read_at, self._committed = len(self.ids), text
        return text

    def flush(self) -> str:
        """Everything not sent yet (generation has ended)."""
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta

    def _may_change(self) -> bool:
        may_change = getattr(self.decoder, "text_may_change", None)
        return may_change is not None and may_change(self.ids)

    def _safe_delta(self, may_change: bool) -> str:
        if may_change:
            return ""
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
