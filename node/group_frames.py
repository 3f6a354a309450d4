"""The node service's side of ring batches: group frames in, group frames and results out (groups.py decides).

A mixin of NodeService, on the node's loop thread like the rest of it: a group frame is computed and
passed on, or, on the last node, its outcome goes to the client and the group's next round straight
to the first node. A round that fails on a node fails its rows (an error per row to the client) and
ends the group on every node: the failing node passes an ending frame on, the last node sends one
around to the nodes before it. Rows that ended with their states kept (`ends`) ride the next frame
around; once it is back at the last node, the client hears of each: kept on every node, or refused
by one (then dropped where it was kept). If the frame is lost, the last node has them dropped
everywhere.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..proto import mtpipe_pb2 as pb
from .conditions import Conditions
from .groups import GroupGone, RingGroups, StaleRound
from .protocol import GroupEnd, GroupRound, StageError, StepOutput
from .wire import (
    end_to_pb,
    frame_to_group,
    group_result,
    group_to_frame,
    output_to_result,
    tensor_from_pb,
    tensor_to_pb,
)

if TYPE_CHECKING:
    from .stage import StageWorker

log = logging.getLogger(__name__)


class GroupFrames:
    worker: StageWorker | None
    name: str
    conditions: Conditions
    _subs: dict[str, Any]
    _owners: dict[str, str]
    _ring_groups: RingGroups | None = None
    _ring_worker: StageWorker | None = None

    # what NodeService provides
    def _owned_by(self, seq_id: str, client_id: str) -> bool: ...
    def _emit(self, client_id: str, event: pb.Event) -> None: ...
    def _forward(self, frame: pb.Frame) -> None: ...
    def _start_round(self, frame: pb.Frame) -> None: ...

    def _listens(self, client_id: str) -> bool:
        return client_id in self._subs

    @property
    def ring_groups(self) -> RingGroups:
        """This shard's groups (a new shard starts with none)."""
        worker = self.worker
        if worker is None:
            raise StageError(f"{self.name} has no shard loaded")
        if worker.overlap:
            raise StageError(f"{self.name} is the whole model: it runs no ring groups")
        if self._ring_worker is not worker:
            self._ring_groups, self._ring_worker = RingGroups(worker), worker
        return self._ring_groups

    def left_to_the_ring(self, seq_id: str) -> bool:
        """A sequence in a group on a node other than the last: it leaves by the group's frames (the
        last node decides), never on this node's own account."""
        groups = self._ring_groups
        return groups is not None and not groups.spec.is_last and groups.in_group(seq_id)

    def end_idle_groups(self, idle_s: float) -> None:
        if self._ring_groups is None:
            return
        ended = self._ring_groups.end_idle(idle_s)
        if not ended.groups:
            return
        log.info("ended %d group(s) whose rounds stopped coming for %.0f s", ended.groups, idle_s)
        # (this node reports it; the node or link at fault is somewhere around the ring)
        message = (f"no round of its group came back to this, the last node, for {idle_s:.0f} s: a node or link "
                   "of the ring was lost or hangs")
        for client_id, rnd, seq_id in ended.rows:
            err = pb.Error(code="UNAVAILABLE", message=message, node=self.name, seq_id=seq_id, step=rnd)
            self._emit(client_id, pb.Event(error=err))
        for fresh in ended.fresh:
            self._start_round(group_to_frame(fresh))
        for client_id, end in ended.ends:
            self._drop_end(client_id, end)

    def has_groups(self) -> bool:
        return self._ring_groups is not None and bool(self._ring_groups.groups)

    def pause_groups(self, seconds: float) -> None:
        """The loop was held for `seconds` (a step): no round could come by meanwhile."""
        if self._ring_groups is not None:
            self._ring_groups.pause(seconds)

    def drop_groups(self) -> None:
        """Forget every group (the shard goes): nothing may keep the old shard's arrays alive."""
        self._ring_groups = self._ring_worker = None

    def end_groups(self) -> None:
        """A link of the ring broke: the rounds on it are lost, every group ends here."""
        if self._ring_groups is not None:
            self._ring_groups.end_all()

    def on_group(self, frame: pb.Frame) -> None:
        start = time.perf_counter()
        try:
            groups = self.ring_groups
        except StageError as e:
            self._fail_rows(frame, "FAILED_PRECONDITION", str(e))
            return
        try:
            rnd = frame_to_group(frame)
        except StageError as e:  # unreadable: its group cannot go on, here or anywhere
            if frame.group >= 1:
                self._group_failed(groups, GroupRound(frame.client_id, frame.group, frame.step, []), frame,
                                   "INVALID_ARGUMENT", str(e))
            else:
                self._fail_rows(frame, "INVALID_ARGUMENT", str(e))
            return
        last = groups.spec.is_last
        if not rnd.rows:  # the group ended
            if not last:
                groups.close(rnd)
                _pass_ends(frame, rnd)
                self._forward(frame)
            elif not rnd.from_last:  # it failed on a node before: end it on the nodes before that one too
                self._end_around(groups, rnd)
            else:  # an ending frame the last node sent came back around (a new group may hold the id by now)
                self._round_back(rnd, [])
            return
        try:
            if foreign := [r.seq_id for r in rnd.rows if r.join and not self._owned_by(r.seq_id, rnd.client_id)]:
                raise StageError(f"group {rnd.group}: sequence {foreign[0]!r} belongs to another client")
            hidden = tensor_from_pb(frame.hidden) if frame.HasField("hidden") else None
            out = groups.run(rnd, hidden)
        except StaleRound as e:  # the group went on without it: its rows were failed then
            self._fail_rows(frame, "ABORTED", str(e))
            return
        except GroupGone as e:  # (its rows resume)
            self._group_failed(groups, rnd, frame, "ABORTED", str(e))
            return
        except StageError as e:
            self._group_failed(groups, rnd, frame, "INVALID_ARGUMENT", str(e))
            return
        except Exception as e:  # a bug or an MLX failure: fail this group, keep serving the others
            log.exception("round %d of group %d failed", rnd.round, rnd.group)
            self._group_failed(groups, rnd, frame, "INTERNAL", f"{type(e).__name__}: {e}")
            return
        if not last:
            frame.hidden.CopyFrom(tensor_to_pb(out))
            _pass_ends(frame, rnd)
            self._forward(frame)
            self._timed(len(rnd.rows), start)
            return
        try:
            if not self._listens(rnd.client_id):  # the client is gone: no more rounds for its rows
                groups.groups[rnd.key].released.update(r.seq_id for r in rnd.rows)
            shown, nxt = groups.next_round(rnd, out)
        except Exception as e:  # a bug: fail this group, keep serving the others
            log.exception("round %d of group %d failed after it ran", rnd.round, rnd.group)
            for end in rnd.ends:  # (kept on the nodes; the client will never hear of them)
                self._drop_end(rnd.client_id, end)
            self._group_failed(groups, rnd, frame, "INTERNAL", f"{type(e).__name__}: {e}")
            return
        if nxt is not None:
            self._start_round(group_to_frame(nxt))
        self._round_back(rnd, shown)
        self._timed(len(rnd.rows), start)

    def _timed(self, rows: int, start: float) -> None:
        """A round's whole time here, the frame's handling besides the step: what it keeps this node from
        other groups' rounds (the fit the number of groups in flight is chosen from)."""
        self.worker.stats.rounds.add(rows, time.perf_counter() - start)

    def _round_back(self, rnd: GroupRound, shown: list) -> None:
        """The last node, a round of a group back: the rows' outcomes, and the ends it carried (kept on
        every node, or refused by one), go to the client; a refused end is dropped where it was kept."""
        for end in rnd.ends:
            if end.refused:
                self._drop_end(rnd.client_id, end)
        if shown or rnd.ends:
            self._emit(rnd.client_id, pb.Event(group=group_result(rnd, shown, rnd.ends)))

    def joined(self, frame: pb.Frame, out: StepOutput) -> pb.Event:
        """The last node after a prompt's last chunk meant for a group: the sequence joins it."""
        groups = self.ring_groups
        out.continued, rnd = groups.joined(frame.client_id, frame.group, out, frame.budget, tuple(frame.stop_tokens),
                                           frame.keep_end)
        if rnd is not None:
            self._start_round(group_to_frame(rnd))
        return pb.Event(result=output_to_result(out))

    def release_grouped(self, frame: pb.Frame) -> bool:
        """A release of a sequence meant for a group (False: it is not). The client's is acted on by
        the last node alone (it may still be on its way into a group on the nodes before); the last
        node's, sent around to the nodes before it, frees it there."""
        if not frame.group or self.worker is None or self.worker.overlap:
            return False
        groups = self.ring_groups
        if not groups.spec.is_last:
            if frame.ring:  # (the client's own: its lease keeps running here until the last node's word)
                self._owners.pop(frame.seq_id, None)
                groups.release(frame.seq_id)
            self._forward(frame)
        elif not frame.ring:  # (ring: it came back around)
            self._owners.pop(frame.seq_id, None)
            if not groups.client_release(frame.seq_id):
                self._start_round(pb.Frame(client_id=frame.client_id, seq_id=frame.seq_id, kind=pb.RELEASE,
                                           group=frame.group, ring=True))
        return True

    def _group_failed(self, groups: RingGroups, rnd: GroupRound, frame: pb.Frame, code: str, message: str) -> None:
        self._fail_rows(frame, code, message)
        if groups.spec.is_last:
            self._end_around(groups, rnd)
        else:
            groups.end(rnd.key)
            self._forward(group_to_frame(GroupRound(rnd.client_id, rnd.group, rnd.round, [])))

    def _end_around(self, groups: RingGroups, rnd: GroupRound) -> None:
        self._start_round(group_to_frame(GroupRound(rnd.client_id, rnd.group, rnd.round, [], from_last=True)))
        for end in groups.riding(rnd.key):  # (kept on the nodes the lost round passed)
            self._drop_end(rnd.client_id, end)
        fresh = groups.failed(rnd.key)  # rows that were waiting to join start the group anew
        if fresh is not None:
            self._start_round(group_to_frame(fresh))

    def _drop_end(self, client_id: str, end: GroupEnd) -> None:
        """An end kept on some nodes whose round was lost: every node drops it (node/kept.py)."""
        self._start_round(pb.Frame(client_id=client_id, kind=pb.RELEASE, prefix=end.key))

    def _fail_rows(self, frame: pb.Frame, code: str, message: str) -> None:
        """The refusal, to each row the frame names but one that lives elsewhere here: in another group,
        or prefilled and on its way to join one though the frame does not join it (a frame naming it by
        mistake must not end it)."""
        log.info("round %d of group %d refused: %s", frame.step, frame.group, message)
        self.conditions.failed(code, message)
        groups = self._ring_groups if self._ring_worker is self.worker else None
        elsewhere = groups.held_elsewhere(frame.client_id, frame.group) if groups is not None else set()
        waiting = self.worker.sequences.keys() if self.worker is not None else set()
        for r in frame.rows:
            if r.seq_id in elsewhere or (not r.join and r.seq_id in waiting):
                continue
            err = pb.Error(code=code, message=message, node=self.name, seq_id=r.seq_id, step=frame.step)
            self._emit(frame.client_id, pb.Event(error=err))


def _pass_ends(frame: pb.Frame, rnd: GroupRound) -> None:
    """The ends this node refused to keep are marked so in the frame it passes on."""
    if any(e.refused for e in rnd.ends):
        del frame.ends[:]
        frame.ends.extend(end_to_pb(e) for e in rnd.ends)
