"""What is wrong with a node now, for Health: each condition with the time it began, gone when it ends.

A broken link to the next (or first) node lasts until a new link to it opens; a failed load until a
load succeeds; a round that failed inside the node (a bug, an MLX error) is shown for a while. A step
refused for its own content (a malformed or out-of-order request) is the request's error, not the
node's: it is answered to its client and logged, never shown here; so is a round the node no longer
expects (ABORTED: a group it ended, or that a reload for a new shard dropped): its rows resume.
"""

from __future__ import annotations

import time

TRANSIENT_S = 60.0  # how long a failure with no end of its own (a failed round) stays on show
LINK_LOST = "lost the stream to the "  # how a broken link's condition begins (often the other node's fault)


class Conditions:
    def __init__(self) -> None:
        self._now: dict[str, tuple[str, float, bool]] = {}  # key -> (message, since (unix time), transient)

    def set(self, key: str, message: str, transient: bool = False) -> None:
        old = self._now.get(key)
        since = old[1] if old is not None and old[0] == message else time.time()
        self._now[key] = (message, since, transient)

    def clear(self, key: str) -> None:
        self._now.pop(key, None)

    def current(self, now: float | None = None) -> tuple[str, float] | None:
        """The latest condition still on (message, since), or None: the node is fine."""
        now = now if now is not None else time.time()
        for key in [k for k, (_, since, transient) in self._now.items() if transient and now - since > TRANSIENT_S]:
            del self._now[key]
        if not self._now:
            return None
        message, since, _ = max(self._now.values(), key=lambda v: v[1])
        return message, since

    def failed(self, code: str, message: str) -> None:
        """A step or round refused with gRPC status `code`: the node's condition unless the request's own."""
        if code not in ("INVALID_ARGUMENT", "ABORTED"):
            self.set("round", message, transient=True)
