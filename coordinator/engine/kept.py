"""Prompt prefixes kept on a pipeline's nodes for the ring engine: which one a prompt goes on from,
which prompts are kept, and which go to stay within a budget.

Each node keeps a prompt's state just before its last token (node/prefixes.py, node/kept.py) under
this engine's key; the choices are scheduler.py's pure functions, as in the batch engine. Bytes are
reckoned from the model's geometry (scheduler.ModelDims), summed over the nodes: the attention entries
of every position and one set of GatedDeltaNet states. A prefix a prompt is about to start from is
pinned until that prompt went in, so no drop overtakes it. A pipeline that was lost may come back
with nodes that kept nothing: what was kept before a loss is forgotten (the nodes forget it too, as
they are loaded again), and nothing is reused or kept while it is down.

A request's state at its end (its prompt and reply but the reply's last token) is kept by the nodes
as its row leaves its group (node/groups.py); the last node says so (or that a node refused it) once
the round that carried it came back. That word and the request's end can come in either order:
whichever comes second notes it. A prompt that starts with an end still to be heard of (a chat's next
turn sent at once) waits a moment for that word rather than prefill the reply again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ...node.protocol import GroupEnd
from . import scheduler as plan

MAX_KEPT = 128  # kept prefixes at once (a node takes at most node/stage.py's MAX_KEPT_PREFIXES)
MAX_UNMATCHED = 256  # ends heard of before their request ended, or ended before they were heard of


class KeptPrefixes:
    """Thread-safe: prompts go in on the ring engine's prefill threads."""

    def __init__(self, dims: plan.ModelDims, budget: int, drop: Callable[[str], None], most: int = MAX_KEPT):
        self.dims = dims
        self.budget = budget
        self.most = most
        self._drop = drop  # tells the nodes (in order behind the steps sent before)
        self._kept: dict[str, plan.KeptPrefix] = {}
        self._pins: dict[str, int] = {}
        self._ending: dict[str, tuple[list[int] | None, float]] = {}  # key -> (tokens fed, epoch): not heard yet
        self._heard: dict[str, GroupEnd] = {}  # key -> the last node's word, its request not ended yet
        self._epoch = 0.0  # when the pipeline was last lost, as the kept prefixes knew it
        self._lock = threading.Lock()
        self._word = threading.Condition(self._lock)  # an end was heard of

    def nbytes(self, tokens: int) -> int:
        return plan.kept_bytes(self.dims, tokens)

    def reuse(self, prompt: list[int], drafts: bool, epoch: float, wait: float = 0.0) -> plan.KeptPrefix | None:
        """The longest kept prefix `prompt` starts with, pinned until `done`. `epoch`: when the pipeline
        was last lost (a change forgets every prefix kept before). Up to `wait` seconds for the word on
        a longer one the prompt starts with: a request's end on its way around the nodes."""
        deadline = time.monotonic() + wait
        with self._lock:
            if epoch != self._epoch:
                self._kept, self._pins, self._epoch = {}, {}, epoch
            while True:
                hit = plan.reusable(list(self._kept.values()), prompt, drafts)
                coming = self._coming(prompt, len(hit.tokens) if hit else 0, epoch)
                left = deadline - time.monotonic()
                if coming and left <= 0 < wait:  # (no word in time: its round was lost, or will be; noted as none)
                    self._ending.update((k, (None, epoch)) for k in coming)
                if not coming or left <= 0:
                    break
                self._word.wait(left)
            if hit is not None:
                hit.used = time.monotonic()
                self._pins[hit.key] = self._pins.get(hit.key, 0) + 1
            return hit

    def _coming(self, prompt: list[int], than: int, epoch: float) -> list[str]:
        """Ends not heard of yet that `prompt` starts with, longer than `than` tokens (under the lock)."""
        return [k for k, (fed, e) in self._ending.items() if fed is not None and e == epoch
                and than < len(fed) - 1 < len(prompt) and prompt[: len(fed) - 1] == fed[:-1]]

    def done(self, key: str) -> None:
        with self._lock:
            if self._pins.get(key, 0) > 1:
                self._pins[key] -= 1
            else:
                self._pins.pop(key, None)

    def keep_as(self, key: str, prompt: list[int], drafts: bool, start: int) -> str:
        """`key` if `prompt` (its part before the last token) is to be kept as it goes in from `start`,
        "" if not: nothing new past the prefix it starts from, kept already (with the MTP head's part
        where it drafts), or larger than the whole budget."""
        tokens = tuple(prompt[:-1])
        if not self.budget or len(tokens) <= start or self.nbytes(len(tokens)) > self.budget:
            return ""
        with self._lock:
            if plan.held(list(self._kept.values()), tokens, drafts):
                return ""
        return key

    def kept(self, key: str, prompt: list[int], drafts: bool, epoch: float) -> None:
        """Every node kept `prompt`'s prefix under `key` (its last step went through while the pipeline
        served, since the loss at `epoch`); others go while the kept ones are over the budget or too many."""
        tokens = tuple(prompt[:-1])
        with self._lock:
            if epoch != self._epoch:  # lost and forgotten meanwhile: the nodes forget it as they are loaded again
                return
            if key not in self._kept and plan.held(list(self._kept.values()), tokens, drafts):  # another came first
                out = [key]
            else:
                out = self._keep(key, tokens, drafts)
        for k in out:
            self._drop(k)

    def _keep(self, key: str, tokens: tuple[int, ...], drafts: bool) -> list[str]:
        """Keep `tokens` under `key` (under the lock); the keys that go for it."""
        # (one without the MTP part; a pinned one stays, as a prompt is about to start from it)
        gone = [k.key for k in self._kept.values() if k.tokens == tokens and k.key not in self._pins]
        for k in gone:
            del self._kept[k]
        self._kept[key] = plan.KeptPrefix(key, tokens, self.nbytes(len(tokens)), drafts, time.monotonic())
        kept = list(self._kept.values())
        over = sum(k.nbytes for k in kept) - self.budget
        out = plan.least_used(kept, over, set(self._pins))
        extra = len(kept) - len(out) - self.most
        if extra > 0:
            left = sorted((k for k in kept if k.key not in out and k.key not in self._pins), key=lambda k: k.used)
            out += [k.key for k in left[:extra]]
        for k in out:
            del self._kept[k]
        return gone + out

    def end_key(self, seq_id: str, prompt: list[int]) -> str:
        """The key a request's state is kept under as it ends; "" when its prompt alone is over the budget."""
        return f"{seq_id}/end" if self.budget and self.nbytes(len(prompt)) <= self.budget else ""

    def ended(self, key: str, fed: list[int] | None, epoch: float) -> None:
        """The request that asked for its end to be kept under `key` ended. `fed`: its prompt and every
        token it was given (the last never went in); None when it failed or was cancelled (its row
        then leaves without keeping anything, or what a node kept meanwhile goes)."""
        with self._lock:
            end = self._heard.pop(key, None)
            if end is None:
                self._ending[key] = (fed, epoch)
                _bound(self._ending)
                return
        self._noted(end, fed, epoch)

    def heard(self, end: GroupEnd) -> None:
        """The last node's word: every node kept `end`, or one refused it (the pipeline's subscription
        thread)."""
        with self._lock:
            ending = self._ending.get(end.key)
            if ending is None:
                self._heard[end.key] = end
                gone = _bound(self._heard)
        if ending is None:
            for g in gone:  # (their requests never ended here: nothing will note them)
                self.forget(g.key)
            return
        self._noted(end, *ending)
        with self._lock:  # (noted first: a prompt waiting for it finds it kept)
            self._ending.pop(end.key, None)
            self._word.notify_all()

    def _noted(self, end: GroupEnd, fed: list[int] | None, epoch: float) -> None:
        """Kept, unless a node refused it, the request failed, the nodes kept another length than it
        fed, it is over the budget, the pipeline was lost since, or the same tokens are kept already
        (with the MTP head's part where this has it)."""
        if end.refused or fed is None or len(fed) - 1 != end.position or self.nbytes(end.position) > self.budget:
            self.forget(end.key)
            return
        with self._lock:  # (a pipeline lost meanwhile: a node loaded again may still have kept it)
            redundant = epoch != self._epoch or plan.held(list(self._kept.values()), tuple(fed[:-1]), end.drafts)
        if redundant:
            self.forget(end.key)
        else:
            self.kept(end.key, fed, end.drafts, epoch)

    def forget(self, key: str) -> None:
        """A prompt that was to be kept under `key` failed: whatever node kept it drops it."""
        with self._lock:
            self._kept.pop(key, None)
        self._drop(key)

    def describe(self) -> dict[str, int]:
        with self._lock:
            return {"kept_prefixes": len(self._kept), "kept_prefix_bytes": sum(k.nbytes for k in self._kept.values()),
                    "prefix_cache_bytes": self.budget}


def _bound(d: dict) -> list:
    """Drop the oldest entries past MAX_UNMATCHED; returns them."""
    return [d.pop(next(iter(d))) for _ in range(len(d) - MAX_UNMATCHED)]
