"""Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: the most recent ones, in the API
process's memory (gone when it restarts), as OpenAI keeps them for clients that chain turns. A response
is kept with the conversation that led to it, its input items after those of the responses it followed;
its own output items continue that conversation. Those input items are listed by
`GET /v1/responses/{id}/input_items` in the Responses API's item form: each with an id, given when it is
first kept (so that listings agree, and page by it), a message's text as content parts. Instructions
are not kept: each request gives its own, nor are log-probabilities (a response read back has none).
At most `most` responses, and `most_bytes` of them as JSON, are kept; the least recently used go first."""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from typing import Any, Optional

DEFAULT_KEPT = 256
DEFAULT_KEPT_BYTES = 256 * 2**20


class ResponseStore:
    def __init__(self, most: int = DEFAULT_KEPT, most_bytes: int = DEFAULT_KEPT_BYTES):
        self.most, self.most_bytes = most, most_bytes
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep `response` (without its log-probabilities), which `items` (its conversation's input items)
        led to; the least recently used go past `most` responses or `most_bytes`."""
        response = {**response, "output": [_without_logprobs(item) for item in response["output"]]}
        items = [listed(item) for item in items]
        size = len(json.dumps([response, items], ensure_ascii=False))
        with self._lock:
            self._drop(response["id"])
            self._kept[response["id"]] = (response, items, size)
            self._bytes += size
            while self._kept and (len(self._kept) > self.most or self._bytes > self.most_bytes):
                self._drop(next(iter(self._kept)))

    def _drop(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._bytes -= kept[2]
        return kept is not None

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

    def input_items(self, response_id: str) -> Optional[list[dict[str, Any]]]:
        with self._lock:
            kept = self._kept.get(response_id)
        return None if kept is None else kept[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)


def _without_logprobs(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") != "message":
        return item
    return {**item, "content": [{**part, "logprobs": []} if "logprobs" in part else part for part in item["content"]]}


ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item in the form the Responses API lists it: with an id and type, a message's text as parts."""
    kind = item.get("type", "message")
    out = {"id": f"{ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}", **item, "type": kind}
    if kind == "message":
        if isinstance(out.get("content"), str):
            part = "output_text" if out.get("role") == "assistant" else "input_text"
            out["content"] = [{"type": part, "text": out["content"]}]
        out.setdefault("status", "completed")
    return out


def page(items: list[dict[str, Any]], *, limit: int, order: str, after: Optional[str] = None) -> dict[str, Any]:
    """A page of `items` as OpenAI's lists are paged: `order` "asc" (oldest first) or "desc", the `limit`
    items after the one with id `after` (KeyError where none has it)."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    if after is not None and after not in ids:
        raise KeyError(after)
    start = 0 if after is None else ids.index(after) + 1
    data = ordered[start : start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + len(data) < len(ordered)}
