"""Stored responses of the Responses API, for ``previous_response_id``: each response's whole
conversation as chat messages (its input after the conversation it continued, then its output),
in memory, the least recently used dropped past ``max_responses``. A response belongs to the API
key that created it (a hash of it, or anonymous): another key is told it does not exist. The
conversation a new request continues is rendered with the same chat template, so its tokens
begin with the earlier prompt and answer, and the prefix cache reuses their KV. Used on the event
loop only."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class ResponseStore:
    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self._items: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()

    def put(self, response_id: str, owner: str, messages: list[dict[str, Any]]) -> None:
        if self.max_responses <= 0:
            return
        self._items[response_id] = (owner, messages)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)

    def get(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The conversation of ``response_id`` if ``owner`` stored it (None: unknown to them)."""
        item = self._items.get(response_id)
        if item is None or item[0] != owner:
            return None
        self._items.move_to_end(response_id)
        return item[1]

    def __len__(self) -> int:
        return len(self._items)
