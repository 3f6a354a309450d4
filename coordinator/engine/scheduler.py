"""What the batch engine does next, as pure functions over plain data (the runner does the work).

Admission is by memory: each sequence may reach some number of positions of attention KV, and holds
its GatedDeltaNet states and the per-position states a verify captures. A batch's KV is one tensor
per layer as long as its longest row, and a round as wide as its deepest row, so every row pays for the
longest reach and the most drafts. Sequences
wait in FIFO order until the batch with them fits the budget, and are refused after a queue timeout.
Prompts are prefilled in chunks between decode rounds, sized so a chunk takes about as long as a
round: running streams keep flowing while a long prompt goes in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_PREFILL_CHUNK = 32  # shorter chunks cost much more per token (the stepped GatedDeltaNet path)
PREFILL_ROUND_RATIO = 1.0  # a prefill chunk between two rounds takes about this many rounds' time


@dataclass(frozen=True)
class ModelDims:
    """What a sequence's caches cost per layer kind (bytes), from the model's config."""

    kv_bytes_per_token: int  # attention keys and values of every attention layer (+ the MTP layer)
    state_bytes: int  # GatedDeltaNet recurrent and conv states of every linear layer
    kv_step: int = 1  # a batch's KV grows by this many positions at a time (models/ragged.py)

    @classmethod
    def of(cls, args: object, itemsize: int, mtp: bool, kv_step: int = 1) -> ModelDims:
        layers = args.num_hidden_layers
        interval = args.full_attention_interval
        attention = layers // interval + (1 if mtp else 0)
        kv = 2 * args.num_key_value_heads * args.head_dim * itemsize * attention
        key_dim = args.linear_num_key_heads * args.linear_key_head_dim
        value_dim = args.linear_num_value_heads * args.linear_value_head_dim
        conv = (args.linear_conv_kernel_dim - 1) * (2 * key_dim + value_dim) * itemsize
        recurrent = args.linear_num_value_heads * args.linear_value_head_dim * args.linear_key_head_dim * 4
        return cls(kv, (layers - layers // interval) * (conv + recurrent), kv_step)


@dataclass(frozen=True)
class Footprint:
    """What a sequence may hold."""

    reach: int  # positions of attention KV: prompt, max tokens and a round's drafts
    depth: int  # drafts per round at most: a verify captures GatedDeltaNet states at depth + 1 positions


def footprint(dims: ModelDims, positions: int, depth: int) -> Footprint:
    return Footprint(positions + depth, depth)


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
class Waiting:
    seq_id: str
    need: Footprint
    since: float  # when it was queued (monotonic seconds)


def admit(waiting: list[Waiting], running: list[Footprint], dims: ModelDims, budget: int, max_rows: int) -> list[str]:
    """The head of the FIFO queue that fits beside the running rows: a sequence never overtakes an
    older one that does not fit yet, and one alone is admitted whatever its cost (it was validated
    against the context)."""
    out: list[str] = []
    rows = list(running)
    for w in waiting:
        if len(rows) >= max_rows:
            break
        if rows and batch_bytes(dims, [*rows, w.need]) > budget:
            break
        out.append(w.seq_id)
        rows.append(w.need)
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
    return [w.seq_id for w in waiting if now - w.since > timeout]


def prefill_chunk(remaining: int, largest: int, decoding: bool, round_seconds: float,
                  seconds_per_token: float) -> int:
    """Tokens of a prompt to prefill before the next round: all that fit `largest` while nothing decodes,
    otherwise as many as take about one round's time."""
    if not decoding or round_seconds <= 0 or seconds_per_token <= 0:
        return min(remaining, largest)
    fit = int(PREFILL_ROUND_RATIO * round_seconds / seconds_per_token)
    return max(1, min(remaining, largest, max(MIN_PREFILL_CHUNK, fit)))


def ema(old: float, new: float, weight: float = 0.2) -> float:
    return new if old <= 0 else (1 - weight) * old + weight * new


def ring_groups(stages: int, stage_seconds: list[float], hop_seconds: float = 0.0, most: int | None = None) -> int:
    """Groups to keep in flight around a ring of `stages` nodes so that the busiest one never waits: a
    group's trip takes every stage's time and every hop, and the busiest stage must have a group to
    work on during all of it. Unmeasured: one group per stage."""
    if stages <= 1:
        return 1
    most = most or 2 * stages
    if len(stage_seconds) != stages or min(stage_seconds) <= 0:
        return stages
    trip = sum(stage_seconds) + stages * max(hop_seconds, 0.0)
    return max(1, min(most, math.ceil(trip / max(stage_seconds))))


def pick_group(rows: dict[int, int], groups: int) -> int:
    """The group (1..groups) a new sequence joins: the one with the fewest rows, the lowest id first."""
    return min(range(1, groups + 1), key=lambda g: (rows.get(g, 0), g))
