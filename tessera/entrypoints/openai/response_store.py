"""The in-memory store behind `previous_response_id`: finished responses by id, least recently used
evicted first once the store holds `max_entries` responses or `max_chars` characters of them.

Each entry keeps the conversation the response continued (its input messages and its own output,
as chat messages, without its `instructions`, which OpenAI does not carry over) and the response
object itself (for `GET /v1/responses/{id}`). A request with `store: false` is never stored.
In memory only: a restart forgets everything, and replicas behind a load balancer do not share it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    messages: list[dict[str, Any]]  # chat messages: the conversation so far, this output included
    response: dict[str, Any]  # the Response object as it was sent
    num_chars: int


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_chars: int = 64 * 2**20) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError("the response store needs room for at least one response")
        self.max_entries = max_entries
        self.max_chars = max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, messages: list[dict[str, Any]],
            response: dict[str, Any]) -> None:
        """Store (or replace) a response; evicts the least recently used beyond the limits. A
        response larger than the whole store is not kept."""
        num_chars = len(json.dumps(messages)) + len(json.dumps(response))
        self.delete(response_id)
        if num_chars > self.max_chars:
            return
        self._entries[response_id] = StoredResponse(messages, response, num_chars)
        self._num_chars += num_chars
        while len(self._entries) > self.max_entries or self._num_chars > self.max_chars:
            _, evicted = self._entries.popitem(last=False)
            self._num_chars -= evicted.num_chars

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._num_chars -= entry.num_chars
        return True
