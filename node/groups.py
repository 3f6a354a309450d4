"""Ring batches on a node: groups of sequences whose decode rounds go around the nodes one after another.

A client's sequences are split into groups; each group is a batch of its own (a BatchStage over the
node's one StageWorker, so all groups share the weights and the prefill path). While node i runs
group g's round, node i+1 runs group g-1's: with as many groups in flight as there are stages, no
node waits. A group round is one frame with every row's tokens and the outcome of its previous
round, and one hidden-state tensor for all rows.

The last node decides everything about membership, so every node sees the same batch in the same
order: it verifies, accepts and drafts per row, drops the rows that are done (budget spent, a stop
token, released by the client), adds rows whose prompt was just prefilled, and sends the next round
straight to the first node. Every other node applies what the frame says, in a fixed order: the
last round's commit for every row it holds, then the states of the rows that ended are kept (`ends`,
which carry their commits), then the rows missing from the frame leave, then the `join` rows enter. A
frame without rows ends the group everywhere. A sequence meant for a group is
freed on a non-last node only on the last node's word (a frame it is missing from, or a release the
last node sends around), never on the client's release, which could overtake the frame that joins it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import mlx.core as mx

from .batch import BatchStage, RowStep
from .batch_depth import DepthPlan
from .batch_head import RowOutput
from .kept import scoped
from .prefixes import Prefix
from .protocol import MAX_MTP_DEPTH, Commit, GroupEnd, GroupRound, GroupRow, StageError, StepOutput, StepRequest
from .stage import StageWorker

log = logging.getLogger(__name__)

# A node other than the last forgets a group no round of which came by for this long. It never
# judges a group lost (the last node does, at its lease): a long step on a node before it holds
# the group's round up, and the last node's judgement would be spoiled by forgetting it here.
FORGET_IDLE_S = 60.0


@dataclass
class Group:
    stage: BatchStage
    round: int = 0
    pending: bool = False  # a round ran here whose commit has not been applied (non-last nodes)
    # The last node only:
    in_flight: bool = False  # a round of this group is on its way around the nodes
    budgets: dict[str, int] = field(default_factory=dict)  # tokens each row may still emit
    stops: dict[str, frozenset[int]] = field(default_factory=dict)
    end_keys: dict[str, str] = field(default_factory=dict)  # rows whose state is kept as they end: its key
    riding: list[GroupEnd] = field(default_factory=list)  # ends kept here the client has not heard of
    joins: list[GroupRow] = field(default_factory=list)  # prefilled, waiting for the next round
    joining: set[str] = field(default_factory=set)  # joins riding the round on its way
    released: set[str] = field(default_factory=set)  # the client let go: out of the next round
    seen: float = field(default_factory=time.monotonic)  # when a round of it was last here


class StaleRound(StageError):
    """A round came back to the last node for a group that is not waiting for it (the group ended, or
    started anew, meanwhile): it is dropped, and the group this node holds goes on."""


class GroupGone(StageError):
    """A round of a group this node no longer holds (it restarted, or its client's pipeline was formed
    again): the round is lost, not malformed, and its rows may go on anew."""


@dataclass
class IdleEnd:
    """Groups whose rounds stopped coming, ended. On the last node: the rows they held, as (client,
    round, sequence), whose clients must be told; and the rounds that start their waiting joins anew."""

    groups: int = 0
    rows: list[tuple[str, int, str]] = field(default_factory=list)
    fresh: list[GroupRound] = field(default_factory=list)
    ends: list[tuple[str, GroupEnd]] = field(default_factory=list)  # (client, end) kept on their lost rounds


class RingGroups:
    """The groups of every client on this node, and what the last node decides about them."""

    def __init__(self, worker: StageWorker):
        if worker.overlap:
            raise ValueError("ring groups need a stage that is not the whole model")
        self.worker = worker
        self.spec = worker.spec
        self.vocab_size = worker.shard.config.args.vocab_size
        self.groups: dict[tuple[str, int], Group] = {}
        # The last node: one depth for a client's groups, which take turns on every node (batch_depth.py)
        self.plans: dict[str, DepthPlan] = {}

    def _new_group(self, client_id: str) -> Group:
        plan = None
        if self.spec.is_last:
            plan = self.plans.get(client_id)
            if plan is None:
                plan = self.plans[client_id] = DepthPlan()
        return Group(BatchStage(self.worker, plan))

    def joins_at(self, client_id: str, req: StepRequest) -> int | None:
        """For a prompt meant for a group, the depth the client's groups run (its plan's): its sequence's
        first round takes it (the stage reads it at the prompt's last chunk). None before the plan chose one."""
        plan = self.plans.get(client_id)
        return plan.depth if plan is not None and req.group else None

    def interrupt(self) -> None:
        """Work outside the groups ran on the last node (a prompt chunk, a sequence's own step): the
        rounds in flight waited for it."""
        for plan in self.plans.values():
            plan.interrupt()

    # -- every node -------------------------------------------------------------------------

    def run(self, rnd: GroupRound, hidden: mx.array | None) -> mx.array | list[RowOutput]:
        """This node's part of a group round (an ending round must not get here)."""
        self._validate(rnd)
        g = self.groups.get(rnd.key)
        if self.spec.is_last:  # every round the last node gets back is one it started
            if g is None:
                raise GroupGone(f"group {rnd.group} is not held here (it ended)")
            if not g.in_flight or rnd.round != g.round or {r.seq_id for r in rnd.rows if r.join} != g.joining:
                raise StaleRound(f"group {rnd.group}: round {rnd.round} is not the one on its way")
        if g is not None and rnd.round == 1 and not self.spec.is_last:
            # a first round of a group this node still holds: the last node started it anew (it
            # restarted, or the old group failed there); the old one is gone
            self.end(rnd.key)
            g = None
        kept = [r for r in rnd.rows if not r.join]
        joins = [r for r in rnd.rows if r.join]
        if g is None and kept:
            raise GroupGone(f"group {rnd.group} is unknown here, yet its round carries rows that do not join")
        if g is not None and not self.spec.is_last and rnd.round != g.round + 1:
            raise StageError(f"group {rnd.group}: round {rnd.round} after round {g.round}")
        ids = g.stage.ids if g is not None else []
        if [r.seq_id for r in kept] != [s for s in ids if s in {r.seq_id for r in kept}]:
            raise StageError(f"group {rnd.group}: the rows are not in the group's order")
        missing = [r.seq_id for r in joins if r.seq_id not in self.worker.sequences]
        if missing:
            raise StageError(f"group {rnd.group}: sequence {missing[0]!r} joins but was not prefilled here")
        unready = [r.seq_id for r in joins if not self.worker.sequences[r.seq_id].prompt_done
                   or self.worker.sequences[r.seq_id].decoding]
        if unready:  # (before anything here changes)
            raise StageError(f"group {rnd.group}: sequence {unready[0]!r} joins before its prompt is through "
                             "or while it decodes on its own")
        if g is None:
            g = self.groups[rnd.key] = self._new_group(rnd.client_id)
        g.seen = time.monotonic()
        stage = g.stage
        self._settle(g, rnd)
        left = set(stage.ids) - {r.seq_id for r in kept}
        stage.leave(left)
        g.released -= left  # (released while they finished: no outcome of theirs can come any more)
        for r in joins:
            stage.join(r.seq_id)
        g.round = rnd.round
        out = stage.forward([RowStep(r.seq_id, r.tokens) for r in rnd.rows], hidden)
        if self.spec.is_last:
            stage.commit([o.output.commit for o in out])  # decided here: applied at once
        else:
            g.pending = True
        return out

    def _settle(self, g: Group, rnd: GroupRound) -> None:
        """A node other than the last: its last round's commit for every row (rows that ended carry
        theirs in `ends`; other leaving rows take any outcome), then the ends' states are kept. An end
        this node cannot keep is marked refused in `rnd`: no node after it keeps it."""
        if not g.pending:  # (the last node's commit is applied already; elsewhere none of theirs is here)
            _refuse(rnd.ends if not self.spec.is_last else [])
            return
        by_id = {r.seq_id: r.commit for r in rnd.rows if not r.join}
        by_id.update((e.seq_id, e.commit) for e in rnd.ends)
        g.stage.commit([by_id.get(s) or Commit(0, 0, 0) for s in g.stage.ids])
        g.pending = False
        for e in rnd.ends:
            if not e.refused and self._keep(rnd.client_id, g.stage, e) is None:
                log.info("the end of %s is not kept here (no room, or not at position %d)", e.seq_id, e.position)
                e.refused = True

    def _keep(self, client_id: str, stage: BatchStage, end: GroupEnd) -> Prefix | None:
        """Keep a row's state as it ended, under its client's key, where the node has room."""
        key = scoped(client_id, end.key)
        if key in self.worker.prefixes or not self.worker.room_for_prefix():
            return None
        try:
            prefix = stage.end_prefix(end.seq_id, end.position)
        except Exception:  # (a copy that failed costs the next turn a longer prefill, never the rows)
            log.exception("keeping the end of %s failed", end.seq_id)
            return None
        if prefix is not None:
            self.worker.prefixes[key] = prefix
        return prefix

    def close(self, rnd: GroupRound) -> None:
        """An ending frame on a node other than the last: rows that ended with it keep their states,
        then the group ends here."""
        g = self.groups.get(rnd.key)
        if g is None or rnd.round != g.round + 1:  # (not the group whose rows ended)
            _refuse(rnd.ends)
        elif rnd.ends:
            try:
                self._validate(rnd)
                self._settle(g, rnd)
            except StageError as e:  # (the ends are not kept here, nor after: the last node drops them)
                log.warning("group %d ended without keeping its ends: %s", rnd.group, e)
                _refuse(rnd.ends)
        self.end(rnd.key)

    def riding(self, key: tuple[str, int]) -> list[GroupEnd]:
        """The last node: ends kept here that the client has not heard of (those on the round on its
        way, or kept by a `next_round` that failed): if the group fails, they go."""
        g = self.groups.get(key)
        return list(g.riding) if g is not None else []

    def end(self, key: tuple[str, int]) -> None:
        """Drop a group and every row in it, and the joins riding its round that the client let go
        (no one else frees those: they are in no group, and the client's release was taken as done)."""
        g = self.groups.pop(key, None)
        if g is not None:
            g.stage.leave(set(g.stage.ids))
            for seq_id in g.joining & g.released:
                self.worker.release(seq_id)

    def release(self, seq_id: str) -> bool:
        """The last node's word, or a client gone for good: free the sequence wherever it is here. A
        group waiting for its last round's commit cannot lose a row before it (the commit is per row):
        such a group ends here, and its next round is refused, which ends it everywhere."""
        for g in self.groups.values():  # (the last node) waiting to join: it never will
            for r in [r for r in g.joins if r.seq_id == seq_id]:
                g.joins.remove(r)
                g.budgets.pop(seq_id, None)
                g.stops.pop(seq_id, None)
                g.end_keys.pop(seq_id, None)
        for key, g in list(self.groups.items()):
            if self.spec.is_last and g.in_flight and (seq_id in g.stage.ids or seq_id in g.joining):
                g.released.add(seq_id)  # out of the group's next round, and so freed on every node
                return True
            if seq_id in g.stage.ids:
                if g.pending:
                    self.end(key)
                else:
                    g.stage.leave({seq_id})
                return True
        return self.worker.release(seq_id)

    def end_idle(self, idle_s: float) -> IdleEnd:
        """End the groups no round of which came by for `idle_s`: a live group always has one going
        around (its rounds were lost with a node or a link). The last node gives up the rows they held
        and starts their waiting joins in a new group, so that no client waits on a lost round."""
        now = time.monotonic()
        ended = IdleEnd()
        if not self.spec.is_last:  # only the last node judges a group lost: here it is forgotten, later
            idle_s = max(idle_s, FORGET_IDLE_S)
        for key in [k for k, g in self.groups.items() if now - g.seen > idle_s]:
            g = self.groups[key]
            ended.groups += 1
            if not self.spec.is_last:
                self.end(key)
                continue
            lost = [*g.stage.ids, *g.joining]  # (joins that rode the lost round; not rows that ended)
            ended.rows += [(key[0], g.round, s) for s in lost if s not in g.released and s in g.budgets]
            ended.ends += [(key[0], e) for e in self.riding(key)]
            fresh = self.failed(key)
            if fresh is not None:
                ended.fresh.append(fresh)
        return ended

    def pause(self, seconds: float) -> None:
        """Every group's idle clock stands still for `seconds` (this node's loop was held)."""
        for g in self.groups.values():
            g.seen += seconds

    def end_all(self) -> None:
        """Every group ends here (a link of the ring broke: their rounds are lost)."""
        for key in list(self.groups):
            self.end(key)

    @property
    def rows(self) -> int:
        return sum(len(g.stage.ids) for g in self.groups.values())

    def drop_client(self, client_id: str) -> list[str]:
        """Every group of a client that is gone (or whose pipeline is formed again): their rows, and the
        rows joining them (on their way, or waiting), for the caller to free."""
        gone = []
        for key in [k for k in self.groups if k[0] == client_id]:
            g = self.groups[key]
            gone += dict.fromkeys([*g.stage.ids, *g.joining, *(r.seq_id for r in g.joins)])
            self.end(key)
        self.plans.pop(client_id, None)
        return gone

    def _validate(self, rnd: GroupRound) -> None:
        if rnd.group < 1:
            raise StageError("a group round needs a group id >= 1")
        ids = [r.seq_id for r in rnd.rows]
        if len(set(ids)) != len(ids) or not all(ids):
            raise StageError("a group round names each sequence once, by a non-empty id")
        for r in rnd.rows:
            if not 1 <= len(r.tokens) <= MAX_MTP_DEPTH + 1:
                raise StageError(f"row {r.seq_id!r} carries {len(r.tokens)} tokens, not 1..{MAX_MTP_DEPTH + 1}")
            if self.spec.is_first and any(not 0 <= t < self.vocab_size for t in r.tokens):
                raise StageError(f"row {r.seq_id!r}: token id out of the vocabulary range")
            if r.join and r.commit is not None:
                raise StageError(f"row {r.seq_id!r} joins and carries a commit")
            if r.commit is not None and not 0 <= r.commit.trim <= MAX_MTP_DEPTH:
                raise StageError(f"row {r.seq_id!r}: trim {r.commit.trim} out of range")
        ended = [e.seq_id for e in rnd.ends]
        if len(set(ended)) != len(ended) or not set(ended).isdisjoint(ids):
            raise StageError("a group round names each row that ended once, and not among its rows")
        for e in rnd.ends:
            if not e.seq_id or not e.key or e.position < 1 or not 0 <= e.commit.trim <= MAX_MTP_DEPTH:
                raise StageError(f"the end of row {e.seq_id!r} is malformed")

    # -- the last node ----------------------------------------------------------------------

    def joined(self, client_id: str, group: int, out: StepOutput, budget: int, stops: tuple[int, ...],
               keep_end: str = "") -> tuple[bool, GroupRound | None]:
        """A prompt's last chunk gave its first tokens: the sequence joins `group` at the group's next
        round, which starts now if the group has none on its way. Returns whether it joins (not when
        it is already done) and the round to start. `keep_end`: its state is kept under that key (its
        client's) once it ends."""
        seq_id = out.seq_id
        left = budget - len(out.tokens)
        if left <= 0 or not set(out.tokens).isdisjoint(stops):
            self.worker.release(seq_id)
            return False, None
        g = self.groups.get((client_id, group))
        if g is None:
            g = self.groups[(client_id, group)] = self._new_group(client_id)
        g.budgets[seq_id] = left
        g.stops[seq_id] = frozenset(stops)
        if keep_end:
            g.end_keys[seq_id] = keep_end
        g.joins.append(GroupRow(seq_id, [out.tokens[-1], *out.drafts], join=True))
        if g.in_flight:
            return True, None
        return True, self._launch(client_id, group, g, [])

    def next_round(self, rnd: GroupRound, outs: list[RowOutput]) -> tuple[list[RowOutput], GroupRound | None]:
        """After the last node's part of a round: the outcomes to hand out (rows the client released
        are left out) and the group's next round, or the frame that ends it (no rows)."""
        g = self.groups[rnd.key]
        g.in_flight = False
        g.joining = set()
        shown, rows = [], []
        ends = g.riding = []  # (the round's own are heard of now; these, once the next round is back)
        for o in outs:
            seq_id, out = o.seq_id, o.output
            if seq_id in g.released:
                continue
            shown.append(o)
            g.budgets[seq_id] -= len(out.tokens)
            if g.budgets[seq_id] > 0 and g.stops[seq_id].isdisjoint(out.tokens):
                rows.append(GroupRow(seq_id, [out.tokens[-1], *out.drafts], out.commit))
            elif seq_id in g.end_keys and out.commit is not None:  # it ended: its state is kept
                end = GroupEnd(seq_id, out.commit, g.end_keys[seq_id], g.stage.positions[g.stage.ids.index(seq_id)])
                prefix = self._keep(rnd.client_id, g.stage, end)
                end.drafts, end.refused = prefix is not None and prefix.drafts, prefix is None
                ends.append(end)  # (refused, it rides too: the client hears of it a trip later either way)
        done = set(g.stage.ids) - {r.seq_id for r in rows}
        for seq_id in done:
            g.budgets.pop(seq_id, None)
            g.stops.pop(seq_id, None)
            g.end_keys.pop(seq_id, None)
            g.released.discard(seq_id)
        return shown, self._launch(rnd.client_id, rnd.group, g, rows, ends)

    def failed(self, key: tuple[str, int]) -> GroupRound | None:
        """A round of the group failed somewhere: the group is gone; its waiting joins start a new one."""
        g = self.groups.get(key)
        joins = g.joins if g is not None else []
        self.end(key)
        if not joins:
            return None
        fresh = self.groups[key] = self._new_group(key[0])
        fresh.joins = joins
        for r in joins:
            fresh.budgets[r.seq_id], fresh.stops[r.seq_id] = g.budgets[r.seq_id], g.stops[r.seq_id]
            if r.seq_id in g.end_keys:
                fresh.end_keys[r.seq_id] = g.end_keys[r.seq_id]
        return self._launch(key[0], key[1], fresh, [])

    def _launch(self, client_id: str, group: int, g: Group, rows: list[GroupRow],
                ends: list[GroupEnd] | None = None) -> GroupRound:
        joins, g.joins = g.joins, []
        rows += joins
        g.round += 1
        ends = ends or []
        if not rows:
            self.end((client_id, group))
            return GroupRound(client_id, group, g.round, [], from_last=True, ends=ends)
        g.in_flight = True
        g.joining = {r.seq_id for r in joins}
        g.riding = ends
        g.seen = time.monotonic()
        return GroupRound(client_id, group, g.round, rows, from_last=True, ends=ends)

    def client_release(self, seq_id: str) -> bool:
        """The client let go of a sequence (last node). True: it is out of a group's next round, and
        the group's frames free it everywhere. False: it is in no group; the caller frees it here and
        sends the release around, so the other nodes free it too."""
        return self.release(seq_id) and any(seq_id in g.released for g in self.groups.values())

    def in_group(self, seq_id: str) -> bool:
        return any(seq_id in g.stage.ids for g in self.groups.values())

    @staticmethod
    def _held(g: Group) -> set[str]:
        """A group's sequences: in it, riding a round to join it, or waiting to join it."""
        return {*g.stage.ids, *g.joining, *(r.seq_id for r in g.joins)}

    def held_elsewhere(self, client_id: str, group: int) -> set[str]:
        """The client's sequences held by its groups other than `group`."""
        return {s for (c, n), g in self.groups.items() if c == client_id and n != group for s in self._held(g)}

    def holds(self, seq_id: str) -> bool:
        return any(seq_id in self._held(g) for g in self.groups.values())


def _refuse(ends: list[GroupEnd]) -> None:
    """Ends this node does not keep: no node after it keeps them, and the last node has them dropped."""
    for end in ends:
        end.refused = True
