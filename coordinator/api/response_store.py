"""Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: the most recent ones, in the API
process's memory (gone when it restarts), as OpenAI keeps them for clients that chain turns. A response
is kept with the conversation that led to it, its input items after those of the responses it followed;
its own output items continue that conversation. Instructions are not kept: each request gives its own."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional

DEFAULT_KEPT = 256


class ResponseStore:
    def __init__(self, most: int = DEFAULT_KEPT):
        self.most = most
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep `response`, which `items` (its conversation's input items) led to; the oldest go past `most`."""
        with self._lock:
            self._kept[response["id"]] = (response, items)
            while len(self._kept) > self.most:
                self._kept.popitem(last=False)

    def get(self, response_id: str) -> Optional[dict[str, Any]]:
        with self._lock:
            kept = self._kept.get(response_id)
        return None if kept is None else kept[0]

    def conversation(self, response_id: str) -> Optional[list[dict[str, Any]]]:
        """The items a request that follows this response goes on from: its input, then its output."""
        with self._lock:
            kept = self._kept.get(response_id)
            if kept is not None:
                self._kept.move_to_end(response_id)  # (followed: kept longer)
        return None if kept is None else [*kept[1], *kept[0]["output"]]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._kept.pop(response_id, None) is not None
