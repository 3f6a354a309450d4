"""What the batch engine does next, as pure functions over plain data (the runner does the work).

Admission is by memory: each sequence holds some number of positions of attention KV, its
GatedDeltaNet states and the per-position states a verify captures. A batch's KV is one tensor per
layer as long as its longest row, and a round as wide as its deepest row, so every row pays for the
longest reach and the most drafts. Sequences wait in FIFO order (within a request's priority, lower
first, as vLLM's priority policy orders them: the engines sort the queue) until the batch with them
fits the budget with room for each row to grow by a horizon (not by all its max tokens, which few
replies use), and are refused after a queue timeout. Where the running rows outgrow the budget after
all, the last admitted (of the lowest priority) leave (preemption, as vLLM does it) and wait at the
head of the queue: their prompt and the tokens they had go in again when there is room, and they go
on where they stopped.
Prompts are prefilled in chunks between decode rounds, sized so a chunk takes about as long as a
round: running streams keep flowing while a long prompt goes in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_PREFILL_CHUNK = 32  # shorter chunks cost much more per token (the stepped GatedDeltaNet path)
PREFILL_ROUND_RATIO = 1.0  # a prefill chunk between two rounds takes about this many rounds' time
NARROW_SHARE = 4  # a prefill step narrows to a row that would take at most this share of its width...
NARROW_STEPS = 2  # ...for at most this many steps in a row (a prompt's chunk, then its last token)


@dataclass(frozen=True)
class ModelDims:
    """What a sequence's caches cost per layer kind (bytes), from the model's config."""

    kv_bytes_per_token: int  # attention keys and values of every attention layer (+ the MTP layer)
    state_bytes: int  # GatedDeltaNet recurrent and conv states of every linear layer
    kv_step: int = 1  # a batch's KV grows by this many positions at a time (models/ragged.py)

    @classmethod
    def of(cls, args: object, itemsize: int, mtp: bool, kv_step: int = 1,
           layers: tuple[int, int] | None = None) -> ModelDims:
        """The whole model's, or those of layers [start, end) (a node's shard; `mtp`: it holds the head)."""
        start, end = layers or (0, args.num_hidden_layers)
        full = sum(1 for i in range(start, end) if (i + 1) % args.full_attention_interval == 0)
        kv = 2 * args.num_key_value_heads * args.head_dim * itemsize * (full + (1 if mtp else 0))
        key_dim = args.linear_num_key_heads * args.linear_key_head_dim
        value_dim = args.linear_num_value_heads * args.linear_value_head_dim
        conv = (args.linear_conv_kernel_dim - 1) * (2 * key_dim + value_dim) * itemsize
        recurrent = args.linear_num_value_heads * args.linear_value_head_dim * args.linear_key_head_dim * 4
        return cls(kv, (end - start - full) * (conv + recurrent), kv_step)


@dataclass(frozen=True)
class Footprint:
    """What a sequence may hold."""

    reach: int  # positions of attention KV: prompt, max tokens and a round's drafts
    depth: int  # drafts per round at most: a verify captures GatedDeltaNet states at depth + 1 positions


def footprint(positions: int, depth: int) -> Footprint:
    return Footprint(positions + depth, depth)


ADMIT_HORIZON = 256  # a sequence is admitted where it fits with this many tokens more than it holds


def reach(prompt: int, generated: int, max_tokens: int, horizon: int | None) -> int:
    """Positions a sequence holds once it has `horizon` tokens more than its prompt and the `generated`
    ones (never past its end; None: at its end)."""
    end = prompt + max_tokens
    return end if horizon is None else min(end, prompt + generated + horizon)


def batch_bytes(dims: ModelDims, rows: list[Footprint]) -> int:
    """Bytes a batch of these rows may hold. Each attention layer's KV is [rows, heads, positions,
    dim] (models/ragged.py), as long as the longest row, grown in steps; a round is as wide as its
    deepest row, so every row's GatedDeltaNet states are captured at that many positions (and held,
    beside its own, until the commit)."""
    if not rows:
        return 0
    positions = -(-max(r.reach for r in rows) // dims.kv_step) * dims.kv_step
    return len(rows) * (dims.kv_bytes_per_token * positions + dims.state_bytes * (2 + max(r.depth for r in rows)))


@dataclass(frozen=True)
class SchedulerState:
    """What the scheduler holds now, as /metrics reports it."""

    running: int  # requests with their room (admitted, not finished)
    waiting: int  # requests in the queue for room (preempted ones included)
    cache_usage: float  # what the running rows hold over the memory budget (the fullest node's, over nodes)
    preemptions: int  # since the engine started


@dataclass(frozen=True)
class Waiting:
    seq_id: str
    need: Footprint
    since: float  # when it was queued (monotonic seconds)
    preempted: bool = False  # admitted once: it waits for room however long that takes, at the queue's head


def admit(waiting: list[Waiting], running: list[Footprint], dims: ModelDims, budget: int, max_rows: int) -> list[str]:
    """The head of the FIFO queue that fits beside the running rows: a sequence never overtakes an
    older one that does not fit yet, and one alone is admitted whatever its cost (it was validated
    against the context). One machine's batch: a ring of one node and one group."""
    return [seq_id for seq_id, _ in admit_ring(waiting, {1: list(running)}, 1, [NodeRoom(dims, budget)], max_rows)]


def to_preempt(running: list[Footprint], dims: ModelDims, budget: int) -> int:
    """How many of the running rows (in the order they were admitted) must leave, the last admitted
    first, for the others to fit the budget: never the first, which runs whatever it costs."""
    return len(ring_to_preempt([(1, r) for r in running], [NodeRoom(dims, budget)], [True] * len(running)))


@dataclass(frozen=True)
class NodeRoom:
    """What one node of a ring holds per row (its layers' caches) and may hold in all (bytes)."""

    dims: ModelDims
    budget: int


def ring_fits(nodes: list[NodeRoom], groups: list[list[Footprint]]) -> bool:
    """Every node holds each group as a batch of its own (node/groups.py): do they all fit its budget?"""
    return all(sum(batch_bytes(n.dims, rows) for rows in groups) <= n.budget for n in nodes)


def held_shares(nodes: list[NodeRoom], groups: list[list[Footprint]]) -> list[float]:
    """Each node's share of its budget that these groups hold."""
    return [sum(batch_bytes(n.dims, rows) for rows in groups) / n.budget if n.budget > 0 else 0.0 for n in nodes]


def admit_ring(waiting: list[Waiting], groups: dict[int, list[Footprint]], count: int, nodes: list[NodeRoom],
               max_rows: int) -> list[tuple[str, int]]:
    """The head of the FIFO queue that fits every node beside the running rows, each with the group it
    joins (`pick_group` of `count` groups); one alone is admitted whatever it costs, as `admit` does."""
    out: list[tuple[str, int]] = []
    groups = {g: list(rows) for g, rows in groups.items()}
    for w in waiting:
        if sum(len(rows) for rows in groups.values()) >= max_rows:
            break
        g = pick_group({k: len(rows) for k, rows in groups.items()}, count)
        trial = {**groups, g: [*groups.get(g, []), w.need]}
        if any(groups.values()) and not ring_fits(nodes, list(trial.values())):
            break
        out.append((w.seq_id, g))
        groups = trial
    return out


def ring_to_preempt(running: list[tuple[int, Footprint]], nodes: list[NodeRoom], movable: list[bool]) -> list[int]:
    """Which of the running rows ((group, need), in the order they were admitted) must leave, the last
    admitted first, for the others to fit every node: only those `movable` (a prompt on its way stays
    and counts), never the first."""
    keep, out = list(range(len(running))), []
    for i in reversed(range(1, len(running))):
        groups: dict[int, list[Footprint]] = {}
        for j in keep:
            groups.setdefault(running[j][0], []).append(running[j][1])
        if ring_fits(nodes, list(groups.values())):
            break
        if movable[i]:
            keep.remove(i)
            out.append(i)
    return out


@dataclass
class KeptPrefix:
    """A prompt prefix the stages keep (node/prefixes.py): its tokens, what it holds, when last used."""

    key: str
    tokens: tuple[int, ...]
    nbytes: int
    drafts: bool  # it carries the MTP head's part
    used: float


def kept_bytes(dims: ModelDims, tokens: int) -> int:
    """What a kept prefix of `tokens` holds: the attention entries of every position, one set of states."""
    return dims.kv_bytes_per_token * tokens + dims.state_bytes


def held(kept: list[KeptPrefix], tokens: tuple[int, ...], drafts: bool) -> bool:
    """These tokens are kept already, with the MTP head's part if a sequence that drafts needs it."""
    return any(k.tokens == tokens and (k.drafts or not drafts) for k in kept)


def reusable(kept: list[KeptPrefix], prompt: list[int], drafts: bool) -> KeptPrefix | None:
    """The longest kept prefix `prompt` starts with, leaving at least its last token to go in (that step
    yields the first token). A sequence that drafts needs one with the MTP head's part."""
    best = None
    for k in kept:
        n = len(k.tokens)
        if n >= len(prompt) or (best is not None and n <= len(best.tokens)):
            continue
        if (k.drafts or not drafts) and tuple(prompt[:n]) == k.tokens:
            best = k
    return best


def least_used(kept: list[KeptPrefix], over: int, pinned: set[str] = frozenset()) -> list[str]:
    """Kept prefixes to drop, least recently used first, until `over` bytes are freed (pinned ones stay)."""
    out: list[str] = []
    for k in sorted(kept, key=lambda k: k.used):
        if over <= 0:
            break
        if k.key not in pinned:
            out.append(k.key)
            over -= k.nbytes
    return out


def expired(waiting: list[Waiting], now: float, timeout: float) -> list[str]:
    """Those refused after waiting `timeout` seconds: never one that was preempted."""
    return [w.seq_id for w in waiting if not w.preempted and now - w.since > timeout]


def prefill_chunk(remaining: int, largest: int, decoding: bool, round_seconds: float,
                  seconds_per_token: float) -> int:
    """Tokens of a prompt to prefill before the next round: all that fit `largest` while nothing decodes,
    otherwise as many as take about one round's time."""
    if not decoding or round_seconds <= 0 or seconds_per_token <= 0:
        return min(remaining, largest)
    fit = int(PREFILL_ROUND_RATIO * round_seconds / seconds_per_token)
    return max(1, min(remaining, largest, max(MIN_PREFILL_CHUNK, fit)))


def fill_width(needs: list[int], width: int, narrowed: int) -> int:
    """The width of a prefill step whose rows would take `needs` tokens (a prompt's last token: 1), at
    most `width` each. Every row runs padded to the step's width, so a short prompt beside a long one
    would pay the long one's width for its few tokens, twice (its chunk, then its last token alone).
    So the narrowest row sets the width where it would take a small share of it, for up to
    NARROW_STEPS steps in a row (`narrowed`: the steps just narrowed); then a step at full width comes,
    so short prompts arriving one after another never starve a long one."""
    narrowest = min(min(needs), width)
    worth = width >= NARROW_SHARE * MIN_PREFILL_CHUNK  # (narrower than that, a step costs about what a narrow one does)
    return narrowest if worth and narrowest * NARROW_SHARE <= width and narrowed < NARROW_STEPS else width


def ema(old: float, new: float, weight: float = 0.2) -> float:
    return new if old <= 0 else (1 - weight) * old + weight * new


GROUPS_TIE = 0.02  # group counts whose rounds come within this share of the best's are as good: the fewest wins


@dataclass(frozen=True)
class StageRound:
    """One node's decode round, as it measured it: fixed + per_row x rows seconds."""

    fixed: float
    per_row: float

    def seconds(self, rows: float) -> float:
        return self.fixed + self.per_row * rows


def ring_cycle(groups: int, rows: int, stages: list[StageRound], hops: list[float]) -> float:
    """Seconds for every one of `rows` rows to get a round, with the rows split into `groups` groups in
    flight: each node takes every group in turn (its rounds back to back when it never waits), and a
    group cannot come round faster than its own trip (every node's round and every hop)."""
    used = max(1, min(groups, rows))  # (a group without rows costs nothing)
    each = [s.seconds(max(rows, 1) / used) for s in stages]
    return max(used * max(each), sum(each) + sum(max(h, 0.0) for h in hops))


def quickest_hops(hops: dict[str, float], probes_ms: dict[str, float]) -> dict[str, float]:
    """Each link's hop (seconds), the quickest seen over its probes (round trips in ms, <= 0 when not
    probed), for the links there are now (a link gone with a heal is forgotten). A probe over gRPC waits
    for a busy node's answer, which is no part of the hop."""
    return {link: min(hops.get(link, math.inf), rtt / 2000.0) if rtt > 0 else hops[link]
            for link, rtt in probes_ms.items() if rtt > 0 or link in hops}


def ring_groups(stages: list[StageRound], rows: int, hops: list[float] | None = None, most: int | None = None) -> int:
    """Groups to keep in flight around a ring so that its rows get their rounds soonest: one per node at
    least, and more where they keep every node busy over the hops (seconds each, as measured; a hop not
    measured, such as the last node's to the first, as the others' mean), though each group more pays a
    round's fixed part again on every node. Where the nodes measured nothing yet, one group per node."""
    n = len(stages)
    if n <= 1:
        return 1
    if not all(math.isfinite(s.fixed + s.per_row) and min(s.fixed, s.per_row) >= 0 and s.seconds(1) > 0
               for s in stages):  # (a node that measured nothing, or sent what no round takes)
        return n
    hops = [h for h in (hops or [])[:n] if math.isfinite(h)]
    hops += [sum(hops) / len(hops)] * (n - len(hops)) if hops else []
    cycles = {g: ring_cycle(g, rows, stages, hops) for g in range(n, max(most or 2 * n, n) + 1)}
    best = min(cycles.values())
    return min(g for g, c in cycles.items() if c <= best * (1 + GROUPS_TIE))


def pick_group(rows: dict[int, int], groups: int) -> int:
    """The group (1..groups) a new sequence joins: the one with the fewest rows, the lowest id first."""
    return min(range(1, groups + 1), key=lambda g: (rows.get(g, 0), g))
