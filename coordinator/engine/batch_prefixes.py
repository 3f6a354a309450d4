"""The batch engine's kept prompt prefixes (a mixin of BatchEngine, on its MLX thread).

Each prompt's state before its last token is kept on every stage (node/prefixes.py), and each
request's as it ends, within `prefix_cache` bytes, least recently used dropped first and all of them
before a request waits for memory: a prompt that starts with a kept one prefills only the rest.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import scheduler as plan
from .batch_live import Live

log = logging.getLogger(__name__)


class KeepsPrefixes:
    """Kept prefixes for BatchEngine: it holds `_kept`, `prefix_cache`, `budget`, `dims`, `stages`, the
    rows being prefilled and decoded, and `_needs`."""

    _kept: dict[str, plan.KeptPrefix]
    prefix_cache: int
    budget: int
    dims: plan.ModelDims
    stages: list[Any]  # BatchStage
    _prefilling: list[Live]
    _decoding: list[Live]
    horizon: int | None

    def _reuse(self, live: Live) -> None:
        """Start an admitted prompt from the longest kept prefix it begins with (unless it is scored:
        the prompt's tokens are read as they go in). A preempted one goes on from one within its prompt
        only: the last stage counts what it generated from the tokens it is sent (`resumed_at`)."""
        hit = plan.reusable(list(self._kept.values()), live.req.prompt_tokens, live.req.mtp_depth > 0)
        if hit is None or live.scored is not None:
            return
        hit.used = time.monotonic()
        live.prefix, live.prefilled = hit.key, len(hit.tokens)
        if not live.resumed:
            live.stats.cached_tokens = len(hit.tokens)

    def _keep_as(self, live: Live) -> str:
        """The key its prompt is kept under as it joins ("": not kept, as one larger than the cache, or
        one that was kept, if it could be, when it first joined)."""
        if live.resumed:
            return ""
        tokens = tuple(live.req.prompt_tokens[:-1])
        if plan.kept_bytes(self.dims, len(tokens)) > self.prefix_cache:  # (not copied to go at once)
            return ""
        return self._new_key(live.seq_id, tokens, live.req.mtp_depth > 0)

    def _new_key(self, key: str, tokens: tuple[int, ...], drafts: bool) -> str:
        """`key`, or "" when `tokens` are not to be kept: nothing, or kept already (unless that one lacks
        the MTP head's part and this sequence drafts)."""
        if not self.prefix_cache or not tokens:
            return ""
        if plan.held(list(self._kept.values()), tokens, drafts):
            return ""
        return key

    def _keep_end(self, live: Live) -> None:
        """Keep a finished request's state at its end, its prompt and reply but the reply's last token
        (never fed): the next turn of a chat starts with them. It never fails the request."""
        tokens = (*live.req.prompt_tokens, *live.emitted[:-1])
        key = self._new_key(f"{live.seq_id}/end", tokens, live.req.mtp_depth > 0)
        if not key or plan.kept_bytes(self.dims, len(tokens)) > self.prefix_cache:  # (not copied to go at once)
            return
        try:
            kept = [stage.keep_end(live.seq_id, key, len(tokens)) for stage in self.stages]
        except Exception:  # noqa: BLE001
            log.exception("keeping the end of %s failed", live.seq_id)
            kept = [None]
        self._kept_now(key, list(tokens), kept, ending=live)

    def _kept_now(self, key: str, tokens: list[int], kept: list[Any], ending: Live | None = None) -> None:
        """Kept on every stage (`kept`, None where not): note it, and drop what no longer fits beside the
        running rows (`ending`, about to leave, not among them)."""
        if not key:
            return
        if any(k is None for k in kept):  # (a stage that marked nothing: none keeps it)
            self._drop_kept([key])
            return
        nbytes = sum(k.nbytes for k in kept)
        if nbytes > self.prefix_cache:  # (it alone would empty the cache, then go too)
            self._drop_kept([key])
            return
        self._drop_kept([k.key for k in self._kept.values() if k.tokens == tuple(tokens)])  # (without MTP)
        self._kept[key] = plan.KeptPrefix(key, tuple(tokens), nbytes, kept[-1].drafts, time.monotonic())
        over = sum(k.nbytes for k in self._kept.values()) - self.prefix_cache
        if over > 0:
            self._drop_kept(plan.least_used(list(self._kept.values()), over, self._pinned()))
        self._fit(self._needs([x for x in self._prefilling + self._decoding if x is not ending], self.horizon))

    def _fit(self, rows: list[plan.Footprint], keep: set[str] = frozenset(), only_if_room: bool = False) -> None:
        """Drop kept prefixes, least recently used first, until they and these rows fit the budget.
        `only_if_room`: none, where dropping every one it may would still leave the rows over it (a
        request that must wait for running rows to leave would empty the cache and wait all the same)."""
        kept = list(self._kept.values())
        over = plan.batch_bytes(self.dims, rows) + sum(k.nbytes for k in kept) - self.budget
        spared = self._pinned() | keep
        if only_if_room and over > sum(k.nbytes for k in kept if k.key not in spared):
            return
        self._drop_kept(plan.least_used(kept, over, spared))

    def _pinned(self) -> set[str]:
        """Kept prefixes a prompt is about to start from (its first step not taken yet)."""
        return {x.prefix for x in self._prefilling if x.prefix and x.step == 0}

    def _drop_kept(self, keys: list[str]) -> None:
        pinned = self._pinned()
        for key in keys:
            if not key or key in pinned:
                continue
            self._kept.pop(key, None)
            for stage in self.stages:
                stage.drop_prefix(key)
