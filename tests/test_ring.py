"""Ring batches (issue 13): groups of sequences in flight around the nodes, each round one trip.

Greedy rows give the tokens of the same request run alone on one in-process stage, over 2 and 3
nodes, depths 0-3 and auto, dense and MoE, with rows joining and leaving while groups are in flight;
seeded sampled rows reproduce. Nodes learn only commits: the group frames each node receives are
checked field by field. Cancelled and finished rows leave nothing on any node; a lost node fails
every row within seconds, naming it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from helpers import PROMPTS, node_servers

from mtpipe.coordinator.engine.build import local_engine, ring_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest, resolve_depth
from mtpipe.coordinator.engine.ring import RingEngine
from mtpipe.coordinator.engine.ring_room import RingRoom
from mtpipe.coordinator.engine.sinks import END
from mtpipe.coordinator.pipeline.nodes import NodeFailure
from mtpipe.models.config import load_config
from mtpipe.node.groups import RingGroups, StaleRound
from mtpipe.node.protocol import Commit, GroupRound, GroupRow, SamplingParams, StageError
from mtpipe.proto import mtpipe_pb2 as pb

WAIT_S = 60.0
FRAME_HEADER = 48


def request(engine: Any, i: int, depth: int | str, max_tokens: int, **kw: Any) -> GenerationRequest:
    mtp_depth, auto = resolve_depth(depth, True)
    return GenerationRequest(engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), max_tokens=max_tokens,
                             mtp_depth=mtp_depth, mtp_auto=auto, **kw)


def run_all(engine: RingEngine, reqs: list[GenerationRequest], stagger: float = 0.0) -> list[list[int]]:
    """Every request at once from threads of their own (joining `stagger` seconds apart)."""
    out: list[Any] = [None] * len(reqs)

    def one(i: int) -> None:
        try:
            out[i] = engine.complete(reqs[i]).tokens
        except Exception as e:  # surfaced below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a request hung"
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


def quiet(servers: list[Any], timeout: float = 5.0) -> list[int]:
    """Sequences (alone and in groups) left on each node, once frames in flight have landed."""
    deadline = time.monotonic() + timeout
    while True:
        left = [len(s.service.worker.sequences) + s.service.ring_groups.rows + len(s.service.ring_groups.groups)
                for s in servers]
        if not any(left) or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture(scope="module", params=[2, 3], ids=["2nodes", "3nodes"])
def ring(request: pytest.FixtureRequest, ckpt: Path) -> Any:
    with node_servers(request.param) as servers:
        engine = ring_engine(ckpt, [s.address for s in servers], dtype="float32")
        assert isinstance(engine, RingEngine) and engine.groups == request.param
        yield engine, servers, ckpt
        engine.close()


@pytest.fixture(scope="module")
def references(ckpt: Path) -> dict[Path, Engine]:
    return {}


def alone(refs: dict[Path, Engine], ckpt: Path, req: GenerationRequest) -> list[int]:
    if ckpt not in refs:
        refs[ckpt] = local_engine(ckpt, dtype=mx.float32)
    return refs[ckpt].complete(req).tokens


def test_greedy_rows_match_one_node(ring: Any, references: dict) -> None:
    """Eight rows of every depth, starting apart and of different lengths (they join and leave while
    other groups are in flight): each gives the tokens it gives alone on one stage."""
    engine, servers, ckpt = ring
    depths: list[int | str] = [0, 1, 2, 3, "auto", 0, 2, "auto"]
    reqs = [request(engine, i, d, 10 + 3 * i) for i, d in enumerate(depths)]
    got = run_all(engine, reqs, stagger=0.02)
    for req, tokens, d in zip(reqs, got, depths):
        assert tokens == alone(references, ckpt, req), f"depth {d}"
    assert quiet(servers) == [0] * len(servers)
    # the rounds went around: the last node started them, several groups were used
    last = servers[-1].service
    assert last.ring_stats.frames > len(reqs)
    # every node timed its rounds, which the number of groups in flight is chosen from
    assert all(h.round_fixed_ms > 0 or h.round_row_ms > 0 for h in engine.pipeline.health())


def test_seeded_rows_reproduce(ring: Any) -> None:
    """A seeded sampled row draws the same tokens alone and among other rows."""
    engine, servers, _ = ring
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    sampled = request(engine, 3, 2, 24, params=params)
    solo = run_all(engine, [sampled])[0]
    others = [request(engine, i, d, 20, params=SamplingParams(temperature=1.0, seed=i)) for i, d in
              enumerate([0, 1, 3, "auto", 2])]
    busy = run_all(engine, [*others[:3], sampled, *others[3:]], stagger=0.01)[3]
    assert busy == solo
    assert quiet(servers) == [0] * len(servers)


def test_nodes_see_only_commits(ring: Any) -> None:
    """Each node's group frames carry row ids, tokens, per-row commits and the previous node's hidden
    states (none into the first node): no logits, sampling parameters or other state, and at most
    rows x hidden x (K+1) x 4 bytes + 64 bytes per row, plus the frame's own header (client, group,
    round, the tensor's dtype and shape: under 48 bytes), which a group of 2 rows or more fits in
    those 64 bytes per row. Rows that ended with their states kept ride the next frame with their
    last commit, the key and the length to keep it at: 64 bytes each, too."""
    engine, servers, ckpt = ring
    hidden = load_config(ckpt).args.hidden_size
    seen: list[list[pb.Frame]] = [[] for _ in servers]
    originals = []
    for i, s in enumerate(servers):
        svc = s.service
        originals.append(svc.on_group)

        def spy(frame: pb.Frame, i: int = i, inner: Any = svc.on_group) -> None:
            copy = pb.Frame()
            copy.CopyFrom(frame)
            seen[i].append(copy)
            inner(frame)

        svc.on_group = spy
    try:
        run_all(engine, [request(engine, i, d, 16) for i, d in enumerate([0, 2, 3, "auto"])])
        deadline = time.monotonic() + WAIT_S  # (the frames that carry the last ends to the nodes)
        while min(len(ends_seen(f)) for f in seen[:-1]) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        for s, inner in zip(servers, originals):
            s.service.on_group = inner
    allowed = {"client_id", "kind", "group", "step", "ring", "rows", "hidden", "ends"}
    assert [len(ends_seen(f)) for f in seen[:-1]] == [4] * (len(servers) - 1)  # every request's end
    for i, frames in enumerate(seen):
        rounds = [f for f in frames if f.rows]
        assert rounds, f"node {i} saw no group round"
        for f in frames:
            assert {d.name for d, _ in f.ListFields()} <= allowed
            for e in f.ends:
                assert {d.name for d, _ in e.ListFields()} <= {"seq_id", "accepted", "trim", "key", "position",
                                                               "drafts"}
                assert e.ByteSize() <= 64
        for f in rounds:
            for r in f.rows:
                assert {d.name for d, _ in r.ListFields()} <= {"seq_id", "tokens", "accepted", "trim", "join"}
            width = max(len(r.tokens) for r in f.rows)
            if i == 0:
                assert not f.HasField("hidden")
                continue
            assert list(f.hidden.shape) == [len(f.rows), width, hidden] and f.hidden.dtype == "float32"
            header = 0 if len(f.rows) > 1 else FRAME_HEADER
            limit = len(f.rows) * (hidden * width * 4 + 64) + 64 * len(f.ends) + header
            assert f.ByteSize() <= limit, f.ByteSize()


def ends_seen(frames: list[pb.Frame]) -> set[str]:
    return {e.seq_id for f in frames for e in f.ends}


def test_cancelled_and_stopped_rows_leave_nothing(ring: Any) -> None:
    """Rows cancelled mid-flight and rows ended by a stop string leave no sequence on any node, and
    the rows beside them still match one node."""
    engine, servers, _ = ring
    items: list[queue.SimpleQueue] = []
    handles = []
    for i in range(6):
        q: queue.SimpleQueue = queue.SimpleQueue()
        handles.append(engine.open(request(engine, i, [0, 2, "auto"][i % 3], 200), q.put))
        items.append(q)
    for q in items[:3]:  # a first chunk, then the client goes away
        assert not isinstance(q.get(timeout=WAIT_S), BaseException)
    for h in handles[:3]:
        h.cancel()
    for h in handles[3:]:
        h.cancel()
    for q in items:
        while (item := q.get(timeout=WAIT_S)) is not END:
            assert not isinstance(item, BaseException)
    assert quiet(servers) == [0] * len(servers)
    stopped = request(engine, 5, 2, 60, stop=["\n"])
    assert engine.complete(stopped).finish_reason in ("stop", "length")
    assert quiet(servers) == [0] * len(servers)


def test_a_requests_own_stop_tokens_end_its_row_on_the_nodes(ring: Any) -> None:
    """`stop_token_ids` end a row as EOS does, in the stages too (nothing left on any node); with
    `ignore_eos` the model's EOS does not end it."""
    engine, servers, _ = ring
    whole = engine.complete(request(engine, 1, 2, 24)).tokens
    at = next(i for i in range(2, len(whole)) if whole[i] not in whole[:i])
    cut = engine.complete(request(engine, 1, 2, 24, stop_token_ids=[whole[at]]))
    assert cut.tokens == whole[: at + 1] and cut.finish_reason == "stop"
    eos = sorted(engine.eos)[0]
    through = engine.complete(request(engine, 1, "auto", 6, ignore_eos=True,
                                      params=SamplingParams(logit_bias=((eos, 100.0),))))
    assert through.tokens == [eos] * 6 and through.finish_reason == "length"
    assert quiet(servers) == [0] * len(servers)


def test_a_prompt_for_a_sequence_decoding_in_a_group_is_refused(ring: Any) -> None:
    """Bad input: a prompt naming a sequence that decodes in a group is refused before any node takes
    it, a round of a group that does not exist naming it is refused to no row, and that row and the
    others go on."""
    from mtpipe.node.protocol import StepKind, StepRequest

    engine, servers, _ = ring
    queues: list[queue.SimpleQueue] = []
    handles = []
    for i in range(3):
        q: queue.SimpleQueue = queue.SimpleQueue()
        handles.append(engine.open(request(engine, i, 2, 400), q.put))
        queues.append(q)
    try:
        for q in queues:
            assert not isinstance(q.get(timeout=WAIT_S), BaseException)
        victim = handles[0]._live
        with pytest.raises(StageError, match="decoding here already|out of order"):  # (in a group, or joining)
            engine.pipeline.steps([StepRequest(victim.seq_id, 0, StepKind.PREFILL, [5, 6, 7], final=True, budget=50,
                                               group=victim.group)])
        first = servers[0].service  # what the first node refuses of a round of no group, and whom it tells
        refused, told = threading.Event(), []
        fail_rows, emit = first._fail_rows, first._emit

        def refusing(frame: pb.Frame, code: str, message: str) -> None:
            fail_rows(frame, code, message)
            refused.set()

        def telling(client_id: str, event: pb.Event) -> None:
            if event.WhichOneof("kind") == "error" and event.error.seq_id == victim.seq_id:
                told.append(event.error.message)
            emit(client_id, event)

        first._fail_rows, first._emit = refusing, telling
        try:
            stray = pb.Frame(client_id=engine.pipeline.client_id, kind=pb.GROUP, group=99, step=5)
            stray.rows.add(seq_id=victim.seq_id, tokens=[1])
            engine.pipeline._first.send(stray)
            assert refused.wait(WAIT_S) and told == []
        finally:
            del first._fail_rows, first._emit
        for q in queues:  # every row still streams
            for _ in range(3):
                item = q.get(timeout=WAIT_S)
                assert not isinstance(item, BaseException) and item is not END
    finally:
        for h in handles:
            h.cancel()
    for q in queues:
        while (item := q.get(timeout=WAIT_S)) is not END:
            assert not isinstance(item, BaseException)
    assert quiet(servers) == [0] * len(servers)


def test_lost_node_fails_every_row(dense_ckpt: Path) -> None:
    """A node that goes away fails every row of every group within seconds, naming it (when its
    requests do not wait for the pipeline to come back: tests/test_faults.py for those)."""
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32", resume_window=0)
        try:
            errors: list[queue.SimpleQueue] = []
            for i in range(4):
                q: queue.SimpleQueue = queue.SimpleQueue()
                engine.open(request(engine, i, 2, 2000), q.put)
                errors.append(q)
            for q in errors:
                assert not isinstance(q.get(timeout=WAIT_S), BaseException)
            victim = servers[1].address
            start = time.monotonic()
            servers[1].stop(0)
            for q in errors:
                while not isinstance(item := q.get(timeout=10), BaseException):
                    assert item is not END, "a row ended without an error"
                assert isinstance(item, NodeFailure) and victim in str(item)
            assert time.monotonic() - start < 5.0
        finally:
            engine.close()


def test_the_nodes_left_free_the_groups_of_a_lost_middle_node(dense_ckpt: Path) -> None:
    """The middle of 3 nodes goes away for good: the last node's groups never come round again, and their
    rows' leases run out before the groups are found idle; the groups and rows go all the same, with
    no lease left to keep the node's sweep going."""
    with node_servers(3) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32", resume_window=0)
        try:
            never = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))
            queues: list[queue.SimpleQueue] = []
            for i in range(6):
                q: queue.SimpleQueue = queue.SimpleQueue()
                engine.open(request(engine, i, 2, 3000, params=never), q.put)
                queues.append(q)
            for q in queues:
                assert not isinstance(q.get(timeout=WAIT_S), BaseException)
            servers[1].stop(0)
            for q in queues:
                while not isinstance(item := q.get(timeout=10), BaseException):
                    assert item is not END
            last = servers[2].service
            deadline = time.monotonic() + 30  # (a lease, then idle groups: 5 s each)
            while last.ring_groups.groups or last.worker.sequences:
                assert time.monotonic() < deadline, (len(last.ring_groups.groups), len(last.worker.sequences))
                time.sleep(0.5)
        finally:
            engine.close()


def test_group_frames_are_checked(dense_ckpt: Path) -> None:
    """A malformed group round is refused with a clear error and changes nothing on the node."""
    from mtpipe.models.loading import load_shard
    from mtpipe.models.shard import ShardSpec
    from mtpipe.node.stage import StageWorker

    n = load_config(dense_ckpt).num_layers
    worker = StageWorker(load_shard(dense_ckpt, ShardSpec(0, n // 2, n), dtype=mx.float32))
    groups = RingGroups(worker)
    bad = [
        GroupRound("c", 0, 1, [GroupRow("a", [1], join=True)]),  # group ids start at 1
        GroupRound("c", 1, 1, [GroupRow("a", [1])]),  # unknown group, a row that does not join
        GroupRound("c", 1, 1, [GroupRow("a", [1], join=True)]),  # never prefilled here
        GroupRound("c", 1, 1, [GroupRow("a", [1], join=True), GroupRow("a", [2], join=True)]),
        GroupRound("c", 1, 1, [GroupRow("a", [])]),
        GroupRound("c", 1, 1, [GroupRow("a", [10**6], join=True)]),
        GroupRound("c", 1, 1, [GroupRow("a", [1], Commit(0, 0, 0), join=True)]),
    ]
    for rnd in bad:
        with pytest.raises(StageError):
            groups.run(rnd, None)
        assert not worker.sequences and not groups.groups


def test_a_row_released_while_it_joins_leaves_cleanly(dense_ckpt: Path) -> None:
    """The last node: a row released while the round that brings it in is on its way is dropped from
    the next round; the group and the other rows go on."""
    worker, groups, prefill, arrive = last_node(dense_ckpt)

    joined, first = groups.joined("c", 1, prefill("a"), 50, ())
    assert joined and first is not None and [r.seq_id for r in first.rows] == ["a"]
    assert groups.joined("c", 1, prefill("b"), 50, ()) == (True, None)  # waits: a round is on its way
    shown, second = arrive(first)
    assert [o.seq_id for o in shown] == ["a"] and [(r.seq_id, r.join) for r in second.rows] == [("a", False),
                                                                                                  ("b", True)]
    assert groups.client_release("b") is True  # in the round on its way: out of the next one
    shown, third = arrive(second)
    assert [o.seq_id for o in shown] == ["a"] and [r.seq_id for r in third.rows] == ["a"]
    _, fourth = arrive(third)
    assert groups.rows == 1 and "b" not in worker.sequences
    # A row that ends on its budget, released by its client while the next round is on its way: it
    # leaves with that round, and nothing of it is kept.
    assert groups.joined("c", 1, prefill("e"), 2, ()) == (True, None)  # one token left after its first
    _, fifth = arrive(fourth)
    assert [(r.seq_id, r.join) for r in fifth.rows] == [("a", False), ("e", True)]
    _, sixth = arrive(fifth)  # "e" emits its last token: not in the next round
    assert [r.seq_id for r in sixth.rows] == ["a"]
    assert groups.client_release("e")
    arrive(sixth)
    assert groups.rows == 1 and not groups.groups[("c", 1)].released and "e" not in worker.sequences


def test_a_row_released_before_it_joins_leaves_nothing_in_its_group(dense_ckpt: Path) -> None:
    """The last node: a row waiting to join (its group's round is on its way) that asked to keep its
    state as it ends, released then: nothing of it stays with the group, which goes on."""
    worker, groups, prefill, arrive = last_node(dense_ckpt)
    joined, first = groups.joined("c", 1, prefill("a"), 50, (), keep_end="a/end")
    assert joined and first is not None
    assert groups.joined("c", 1, prefill("b"), 50, (), keep_end="b/end") == (True, None)  # waits
    assert groups.client_release("b") is False  # in no round yet: freed here, the caller tells the other nodes
    g = groups.groups[("c", 1)]
    assert not [r for r in g.joins if r.seq_id == "b"] and all("b" not in m for m in (g.budgets, g.stops, g.end_keys))
    _, second = arrive(first)
    assert [r.seq_id for r in second.rows] == ["a"] and "b" not in worker.sequences and list(g.end_keys) == ["a"]


def test_the_last_node_ends_a_group_whose_round_was_lost(dense_ckpt: Path) -> None:
    """A round lost with a node or a link never comes back: once the group is idle, the last node gives
    up its rows (their clients are told) and starts the joins that waited for that round in a new group.
    The lost round, should it turn up after all, is refused and leaves the new group as it was; a
    round of a group the last node does not hold is refused."""
    worker, groups, prefill, arrive = last_node(dense_ckpt)

    _, first = groups.joined("c", 1, prefill("a"), 50, ())
    _, lost = arrive(first)  # round 2 carries "a", and never comes back
    assert groups.joined("c", 1, prefill("b"), 50, ()) == (True, None)  # waits for round 2
    assert groups.end_idle(60.0).groups == 0
    ended = groups.end_idle(0.0)
    assert ended.groups == 1 and ended.rows == [("c", 2, "a")] and "a" not in worker.sequences
    fresh, = ended.fresh
    assert fresh.round == 1 and [(r.seq_id, r.join) for r in fresh.rows] == [("b", True)]
    with pytest.raises(StaleRound):
        arrive(lost)
    shown, on_its_way = arrive(fresh)
    assert [o.seq_id for o in shown] == ["b"] and groups.rows == 1
    with pytest.raises(StageError, match="not held here"):
        groups.run(GroupRound("c", 7, 1, [GroupRow("b", [1], join=True)]),
                   mx.random.normal((1, 1, worker.hidden_size)))
    # A join released here (its lease ran out) is out of the next round, which goes on without it.
    assert groups.joined("c", 1, prefill("j"), 50, ()) == (True, None)
    assert groups.release("j") and "j" not in worker.sequences
    shown, nxt = arrive(on_its_way)
    assert [o.seq_id for o in shown] == ["b"] and [r.seq_id for r in nxt.rows] == ["b"]


def test_the_last_node_keeps_a_row_as_it_ends_and_gives_it_up_with_a_lost_round(dense_ckpt: Path) -> None:
    """A row that asked for its end to be kept keeps it on the last node as it ends, at its prompt and
    every token but the last, and the next round carries it to the other nodes; if that round is lost,
    the last node names it to be dropped everywhere."""
    worker, groups, prefill, arrive = last_node(dense_ckpt)

    _, first = groups.joined("c", 1, prefill("a"), 50, ())
    assert groups.joined("c", 1, prefill("e"), 2, (), keep_end="e/end") == (True, None)
    _, second = arrive(first)
    assert not second.ends and [r.seq_id for r in second.rows] == ["a", "e"]
    _, third = arrive(second)  # "e" emits its last token: it leaves, its state kept
    (end,) = third.ends
    assert (end.seq_id, end.key, end.position, end.drafts) == ("e", "e/end", 3 + 2 - 1, False)
    assert [r.seq_id for r in third.rows] == ["a"] and worker.prefixes["c/e/end"].length == 4
    ended = groups.end_idle(0.0)  # the round that carried it was lost
    assert ended.rows == [("c", 3, "a")] and ended.ends == [("c", end)]
    # A next round that fails after it kept an end (a bug): the group's failure names it too.
    _, first = groups.joined("c", 2, prefill("f"), 2, (), keep_end="f/end")  # ends with this round

    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    groups._launch = broken
    with pytest.raises(RuntimeError):
        arrive(first)
    (end,) = groups.riding(("c", 2))
    assert end.key == "f/end" and "c/f/end" in worker.prefixes


def test_a_row_in_a_group_hears_of_its_errors() -> None:
    """The result of a prompt's last chunk meant for a group sets up no waiter for a next step (its
    rounds come as group events), so an error about one of its rounds reaches the row, whatever
    the round's number."""
    from mtpipe.coordinator.pipeline.remote import RemotePipeline
    from mtpipe.node.protocol import StepKind, StepOutput, StepRequest
    from mtpipe.node.wire import output_to_result

    pipe = RemotePipeline(["127.0.0.1:9"])
    try:
        got: list[Any] = []
        pipe.row_sinks["s"] = got.append
        waiter = pipe._register(StepRequest("s", 1, StepKind.PREFILL, [1], final=True))
        pipe._dispatch(pb.Event(result=output_to_result(StepOutput("s", 1, [4], continued=True))))
        assert waiter.done.is_set() and list(pipe._waiters) == [("s", 1)]
        pipe._dispatch(pb.Event(error=pb.Error(code="UNAVAILABLE", message="gone", node="n", seq_id="s", step=2)))
        assert len(got) == 1 and "gone" in str(got[0])
    finally:
        pipe.close()


class FakePipeline:
    """What the ring engine asks of a pipeline, without nodes: each test says what its steps do."""

    nodes: tuple[str, ...] = ("a", "b")
    reformer: Any = None

    def __init__(self) -> None:
        self.row_sinks: dict[str, Any] = {}
        self.released: list[str] = []

    def release(self, seq_id: str, group: int = 0) -> None:
        self.released.append(seq_id)

    def close(self) -> None:
        pass


def test_a_row_lost_while_its_prompt_goes_in_is_freed_once_it_is_through() -> None:
    """A node lost while a prompt goes in: the sequence is released on the nodes only once no chunk of
    it is on its way any more (a chunk sent after the release would start it again there), once."""
    from types import SimpleNamespace

    from mtpipe.node.protocol import StageUnavailable

    class Pipeline(FakePipeline):
        reformer = SimpleNamespace(down=None, wait=lambda timeout: False)  # it never comes back

        def __init__(self) -> None:
            super().__init__()
            self.early: list[str] = []
            self.through = threading.Event()

        def steps(self, steps: list, stop: Any = None) -> list:
            self.row_sinks[steps[0].seq_id](StageUnavailable("node b is gone"))  # heard while chunks go
            self.early = list(self.released)
            self.through.set()
            raise StageUnavailable("node b is gone")

    pipeline = Pipeline()
    engine = RingEngine(pipeline, SimpleNamespace(detokenizer=None), [0], 64, False, 100, prefill_chunk=8,
                        resume_window=5.0)
    try:
        with pytest.raises(StageUnavailable, match="node b is gone"):
            engine.complete(GenerationRequest(list(range(1, 20)), max_tokens=4))
        assert pipeline.through.wait(5)
        deadline = time.monotonic() + 5
        while not pipeline.released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pipeline.early == [] and len(pipeline.released) == 1 and engine._rows == {1: 0}
    finally:
        engine.close()


class ResumingPipeline(FakePipeline):
    """Prompts go in at once; the pipeline is back as soon as asked, unless `back` is cleared."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        super().__init__()
        self.prefilled: list[str] = []
        self.back = threading.Event()
        self.back.set()
        self.reformer = SimpleNamespace(down=None, down_at=0.0, given_up=False, attempt_error=None,
                                        wait=self.back.wait)

    def steps(self, steps: list, stop: Any = None) -> list:
        from mtpipe.node.protocol import StepOutput

        self.prefilled.append(steps[0].seq_id)
        return [StepOutput(steps[-1].seq_id, steps[-1].step, [7], continued=True)]


def resuming_engine(queue_timeout: float) -> tuple[ResumingPipeline, RingEngine, queue.SimpleQueue, list]:
    """One row decoding (max_rows 1) and two requests waiting for a row in the queue."""
    from types import SimpleNamespace

    pipeline = ResumingPipeline()
    tokenizer = SimpleNamespace(detokenizer=SimpleNamespace(add_token=lambda t: None, last_segment="",
                                                            finalize=lambda: None, tokens=[]))
    engine = RingEngine(pipeline, tokenizer, [0], 100000, False, 100, prefill_chunk=8,
                        room=RingRoom(None, False, max_rows=1),
                        queue_timeout=queue_timeout, resume_window=30.0, groups=2)
    row: queue.SimpleQueue = queue.SimpleQueue()
    engine.open(GenerationRequest([1, 2, 3], max_tokens=1000), row.put)
    assert row.get(timeout=WAIT_S).tokens == [7]
    waiting = [queue.SimpleQueue() for _ in range(2)]
    for q in waiting:
        engine.open(GenerationRequest([4, 5, 6], max_tokens=10), q.put)
    deadline = time.monotonic() + WAIT_S
    while len(engine.room.waiting) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return pipeline, engine, row, waiting


def test_a_row_waiting_to_resume_is_not_held_behind_requests_waiting_for_a_row() -> None:
    """A lost row holds its room while it waits for the pipeline: its resume never waits behind the
    requests queued for that room (they would time out first, and it with them)."""
    from mtpipe.node.protocol import StageUnavailable

    pipeline, engine, row, waiting = resuming_engine(queue_timeout=10.0)
    try:
        start = time.monotonic()
        pipeline.row_sinks[pipeline.prefilled[0]](StageUnavailable("node b is gone"))
        while len(pipeline.prefilled) < 2:
            assert time.monotonic() - start < 2.0, "the resume waited behind the queue"
            time.sleep(0.01)
    finally:
        engine.close()
    for q in waiting:  # (they never got a row: close() ends them)
        assert isinstance(q.get(timeout=WAIT_S), StageUnavailable)


def test_close_ends_a_request_waiting_to_resume() -> None:
    from mtpipe.node.protocol import StageUnavailable

    pipeline, engine, row, waiting = resuming_engine(queue_timeout=30.0)
    pipeline.back.clear()  # the pipeline is down
    pipeline.row_sinks[pipeline.prefilled[0]](StageUnavailable("node b is gone"))
    engine.close()  # (its resume waiting for the pipeline, or not started yet: ended either way)
    items = []
    while (item := row.get(timeout=5)) is not END:
        items.append(item)
    pipeline.back.set()  # (the resume's thread, waiting for it, ends)
    assert isinstance(items[-1], StageUnavailable)


def test_a_request_refused_from_the_queue_while_the_pipeline_is_down_is_told_so() -> None:
    """No room comes back while a node is lost: a request that waited its queue timeout then hears that, and
    the node, not that the server is busy."""
    from mtpipe.coordinator.engine.sinks import ServerBusy

    pipeline, engine, row, waiting = resuming_engine(queue_timeout=0.5)
    try:
        pipeline.reformer.down = ConnectionError("node b:2 does not answer")
        pipeline.reformer.attempt_error = RuntimeError("node b:2: no shard loaded")  # (what the attempts find now)
        for q in waiting:
            error = q.get(timeout=WAIT_S)
            assert isinstance(error, ServerBusy) and "node b:2 does not answer" in str(error)
            assert "formed again (the last attempt: node b:2: no shard loaded)" in str(error)
            assert q.get(timeout=WAIT_S) is END
    finally:
        pipeline.reformer.down = None
        engine.close()


def test_requests_in_the_queue_end_at_once_when_the_pipeline_will_not_come_back() -> None:
    from mtpipe.node.protocol import StageUnavailable

    pipeline, engine, row, waiting = resuming_engine(queue_timeout=30.0)
    try:
        pipeline.reformer.given_up = True
        pipeline.reformer.down = ConnectionError("node b:2 was taken over by another coordinator")
        start = time.monotonic()
        for q in waiting:
            error = q.get(timeout=WAIT_S)
            assert isinstance(error, StageUnavailable) and "taken over" in str(error) and q.get(timeout=WAIT_S) is END
        assert time.monotonic() - start < 5.0 and not engine.room.waiting  # (not after the queue timeout)
    finally:
        pipeline.reformer.down, pipeline.reformer.given_up = None, False
        engine.close()


def test_a_client_gone_while_its_prompt_goes_in_stops_it_there(ring: Any) -> None:
    """A long prompt, in many chunks: once its client goes away no more chunks are sent, so the nodes
    compute only those already in flight, not the whole prompt; nothing is left on any node."""
    engine, servers, _ = ring
    chunk, engine.prefill_chunk = engine.prefill_chunk, 32
    try:
        tokens = [5 + i % 50 for i in range(3000)]
        first = servers[0].service.worker.stats
        before = first.tokens_processed
        q: queue.SimpleQueue = queue.SimpleQueue()
        handle = engine.open(GenerationRequest(tokens, max_tokens=4), q.put)
        deadline = time.monotonic() + WAIT_S
        while first.tokens_processed == before and time.monotonic() < deadline:  # (its first chunk is in)
            time.sleep(0.001)
        handle.cancel()
        while (item := q.get(timeout=WAIT_S)) is not END:
            assert not isinstance(item, BaseException)
        assert quiet(servers) == [0] * len(servers)
        assert first.tokens_processed - before < len(tokens) // 2
    finally:
        engine.prefill_chunk = chunk


def test_a_request_cancelled_as_it_is_admitted_is_released_once() -> None:
    """A client that leaves between its admission and its prompt going out: its row and slot are given
    back once, and nothing of it is sent (the group's count and `max_rows` hold)."""
    from types import SimpleNamespace

    from mtpipe.node.protocol import StepOutput

    class Pipeline(FakePipeline):
        reformer = SimpleNamespace(down=None)

        def __init__(self) -> None:
            super().__init__()
            self.prefilled: list[str] = []

        def steps(self, steps: list, stop: Any = None) -> list:  # the prompt goes in; no rounds come, so the row stays
            self.prefilled.append(steps[0].seq_id)
            return [StepOutput(steps[-1].seq_id, steps[-1].step, [7], continued=True)]

    pipeline = Pipeline()
    engine = RingEngine(pipeline, SimpleNamespace(detokenizer=None), [0], 64, False, 100, prefill_chunk=8,
                        room=RingRoom(None, False, max_rows=2), groups=2)
    ended = threading.Event()
    handle: list[Any] = []
    real = engine._chunk_size

    def cancelled_now(n: int) -> Any:  # the client leaves at this moment (a window, held open here)
        while not handle:
            time.sleep(0.01)
        handle[0].cancel()
        return real(n)

    try:
        engine.open(GenerationRequest([1, 2, 3], max_tokens=8), lambda item: None)  # a row that keeps decoding
        deadline = time.monotonic() + 5
        while not pipeline.prefilled and time.monotonic() < deadline:
            time.sleep(0.01)
        engine._chunk_size = cancelled_now
        handle.append(engine.open(GenerationRequest([4, 5, 6], max_tokens=8),
                                  lambda item: ended.set() if item is END else None))
        assert ended.wait(5)
        deadline = time.monotonic() + 5
        while len(engine.room.held) != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pipeline.prefilled) == 1 and pipeline.released == []  # its prompt never went out
        assert len(engine.room.held) == 1 and sorted(engine._rows.values()) == [0, 1]
    finally:
        engine.close()


def test_a_row_whose_rounds_stop_coming_fails() -> None:
    """A row whose group's rounds stop coming back (the last node hung: nothing else notices) fails
    after the engine's stall time, naming that node, as a lost node fails it."""
    from types import SimpleNamespace

    from mtpipe.node.protocol import StageUnavailable, StepOutput

    class Pipeline(FakePipeline):
        nodes = addresses = ("a:1", "b:2")
        reformer = SimpleNamespace(down=None)

        def steps(self, steps: list, stop: Any = None) -> list:  # the prompt goes in; its row joins a group, then none
            return [StepOutput(steps[-1].seq_id, steps[-1].step, [7], continued=True)]

    detokenizer = SimpleNamespace(add_token=lambda t: None, last_segment="", finalize=lambda: None, tokens=[])
    pipeline = Pipeline()
    engine = RingEngine(pipeline, SimpleNamespace(detokenizer=detokenizer), [0], 64, False, 100, prefill_chunk=8,
                        resume_window=0, row_stall=0.5)
    try:
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        start = time.monotonic()
        engine.open(GenerationRequest([1, 2, 3], max_tokens=8), chunks.put)
        assert chunks.get(timeout=5).tokens == [7]
        error = chunks.get(timeout=5)
        assert isinstance(error, StageUnavailable) and "b:2" in str(error) and chunks.get(timeout=5) is END
        assert 0.5 < time.monotonic() - start < 3.0 and len(pipeline.released) == 1
    finally:
        engine.close()


def test_prompt_chunks_shrink_to_a_node_round_while_rows_decode() -> None:
    """Each chunk a node takes holds up the groups behind it: while rows decode, a prompt goes in chunks
    of about a node's share of a group round (its trip over the groups), at the prompt speed measured
    when nothing else ran; with nothing decoding, or nothing measured yet, in whole chunks."""
    class Pipeline:
        nodes = ("a", "b")

        def close(self) -> None:
            pass

    engine = RingEngine(Pipeline(), None, [0], 8192, False, 100, prefill_chunk=512)
    try:
        engine._rows = {1: 1}  # this request alone
        assert engine._chunk_size(4000) == (512, True)
        engine._rows = {1: 3, 2: 2}
        assert engine._chunk_size(4000) == (512, False)  # nothing measured yet
        engine._trip_s, engine._token_s = 0.02, 0.0001  # 2 groups: 10 ms per node round, 0.1 ms per token
        assert engine._chunk_size(4000) == (100, False)
        assert engine._chunk_size(60) == (60, False)
    finally:
        engine.close()


def last_node(ckpt: Path) -> tuple[Any, RingGroups, Any, Any]:
    """The last node's groups over the second half of the layers, driven by hand: `prefill(seq)` a
    3-token prompt, `arrive(round)` a round back around the ring with random hidden states (so no
    stop token is ever drawn), giving what the last node hands out and its next round."""
    from mtpipe.models.loading import load_shard
    from mtpipe.models.shard import ShardSpec
    from mtpipe.node.protocol import StepKind, StepRequest
    from mtpipe.node.stage import StageWorker

    n = load_config(ckpt).num_layers
    worker = StageWorker(load_shard(ckpt, ShardSpec(n // 2, n, n), mtp=False, dtype=mx.float32))
    groups = RingGroups(worker)

    def prefill(seq: str) -> Any:
        return worker.step(StepRequest(seq, 0, StepKind.PREFILL, [5, 6, 7], final=True),
                           mx.random.normal((1, 3, worker.hidden_size)))

    def arrive(rnd: GroupRound) -> tuple[list, GroupRound | None]:
        width = max(len(r.tokens) for r in rnd.rows)
        return groups.next_round(rnd, groups.run(rnd, mx.random.normal((len(rnd.rows), width, worker.hidden_size))))

    return worker, groups, prefill, arrive


def test_asking_the_nodes_for_their_step_times_holds_up_no_row_and_no_admission() -> None:
    """How many groups to keep in flight comes from the nodes' Health, which a node busy in a step
    answers late: neither the rows' outcomes nor an admission wait for it (here Health takes 2 s)."""
    import threading
    import time
    from types import SimpleNamespace

    from mtpipe.coordinator.engine.request import GenerationRequest
    from mtpipe.coordinator.engine.ring import RingEngine
    from mtpipe.node.protocol import StepOutput

    asked = threading.Event()

    class Pipeline:
        nodes = addresses = ("a:1", "b:2")
        reformer = SimpleNamespace(down=None, down_at=0.0)

        def __init__(self) -> None:
            self.row_sinks: dict = {}

        def steps(self, steps, stop=None):
            return [StepOutput(steps[-1].seq_id, steps[-1].step, [7], continued=True)]

        def release(self, seq_id, group=0):
            pass

        def health(self, probe_next=False, timeout=5.0):
            asked.set()
            time.sleep(2.0)
            raise TimeoutError("DEADLINE_EXCEEDED")

        def close(self):
            pass

    detok = SimpleNamespace(add_token=lambda t: None, last_segment="", finalize=lambda: None, tokens=[])
    pipeline = Pipeline()
    engine = RingEngine(pipeline, SimpleNamespace(detokenizer=detok), [0], 100000, False, 100, prefill_chunk=8)
    try:
        got: list[float] = []
        t0 = time.monotonic()
        engine.open(GenerationRequest([1, 2, 3], max_tokens=90000), lambda item: got.append(time.monotonic()))
        while not pipeline.row_sinks and time.monotonic() - t0 < 5.0:
            time.sleep(0.01)
        assert time.monotonic() - t0 < 0.5  # placed in a group without asking the nodes
        seq = next(iter(pipeline.row_sinks))
        assert asked.wait(5.0)
        handed: list[float] = []
        for step in range(50):  # one round's outcome every 20 ms while the nodes are asked
            t0 = time.monotonic()
            pipeline.row_sinks[seq](StepOutput(seq, step, [7]))
            handed.append(time.monotonic() - t0)
            time.sleep(0.02)
        assert max(handed) < 0.5
        admitted = threading.Event()
        asked.clear()
        threading.Thread(target=engine._refresh_groups, daemon=True).start()
        assert asked.wait(5.0)
        t0 = time.monotonic()
        engine.open(GenerationRequest([4, 5, 6], max_tokens=10), lambda item: None, admitted=admitted.set)
        assert admitted.wait(5.0) and time.monotonic() - t0 < 0.5
    finally:
        engine.close()


def test_prompt_chunks_are_sized_under_steady_load_from_the_nodes_own_prefill_times() -> None:
    """While rows decode a prompt goes in chunks of about a node's share of a group round. Under steady
    load no prompt is ever alone to be timed: the nodes' own seconds per prompt token size the chunks
    (before, a whole `prefill_chunk` went in at once, holding every group behind it)."""
    from types import SimpleNamespace

    from mtpipe.coordinator.engine.ring import RingEngine

    def node(prefill_tokens: int, prefill_seconds: float) -> SimpleNamespace:
        return SimpleNamespace(next_rtt_ms=0.2, mean_step_ms=5.0, steps=100, tokens_processed=900,
                               prefill_tokens=prefill_tokens, prefill_seconds=prefill_seconds,
                               round_fixed_ms=3.0, round_row_ms=0.3, node_id="n", next="")

    nodes = [node(1000, 0.5), node(1000, 1.0)]  # 0.5 and 1 ms per prompt token
    pipeline = SimpleNamespace(nodes=("a:1", "b:2"), addresses=("a:1", "b:2"), row_sinks={},
                               reformer=SimpleNamespace(down=None), close=lambda: None,
                               health=lambda probe_next=False, timeout=5.0: nodes)
    engine = RingEngine(pipeline, SimpleNamespace(), [0], 100000, False, 100, prefill_chunk=512, groups=2)
    engine._stop.set()  # (its watch asks the nodes by itself a second in: here the test asks)
    try:
        engine._rows = {0: 3, 1: 3}  # rows decode in both groups
        engine._trip_s = 0.2  # a group's trip: 0.1 s of it a node's share
        assert engine._chunk_size(4000) == (512, False)  # nothing measured yet: whole chunks
        engine._refresh_groups()
        size, alone = engine._chunk_size(4000)
        assert not alone and size == int(0.1 / 0.0015)  # 1.5 ms per prompt token over both nodes
        assert engine.groups == 2  # (fixed: not the nodes' choice)
    finally:
        engine.close()


def test_a_round_fit_reads_a_rounds_fixed_part_and_its_cost_per_row() -> None:
    """A node fits its decode rounds' seconds against their rows: with rounds of several row counts it
    finds both parts; with one row count only it reports nothing (a ring then keeps a group per node);
    each row count's first round (kernels built) and stalls are left out; older rounds fade."""
    from mtpipe.node.stage import RoundFit

    fit = RoundFit()
    assert fit.line() == (0.0, 0.0)
    for i in range(200):
        rows = 1 + i % 8
        fit.add(rows, 0.5 if i < 8 else 0.002 + 0.0005 * rows)  # (the first round of each: building kernels)
    fixed, per_row = fit.line()
    assert fixed == pytest.approx(0.002, rel=1e-6) and per_row == pytest.approx(0.0005, rel=1e-6)
    fit.add(4, 10.0)  # a stall counts as twice the mean at most
    assert fit.line()[0] == pytest.approx(0.002, abs=0.001)
    steady = RoundFit()
    for _ in range(50):
        steady.add(4, 0.004)
    assert steady.line() == (0.0, 0.0)
    for i in range(800):  # the rounds got dearer: the fit follows them, the old ones faded
        rows = 1 + i % 8
        fit.add(rows, 0.004 + 0.001 * rows)
    fixed, per_row = fit.line()
    assert fixed == pytest.approx(0.004, rel=0.02) and per_row == pytest.approx(0.001, rel=0.02)


def test_groups_in_flight_weigh_the_hops_against_a_rounds_fixed_part() -> None:
    """One group per node when nothing is measured, or when a round's cost hardly depends on its rows
    and the hops are short (each more group would pay the fixed part again on every node); more groups
    when hops are long against the rounds; never more than twice the nodes."""
    from mtpipe.coordinator.engine import scheduler as plan

    dispatch = [plan.StageRound(0.003, 0.0002), plan.StageRound(0.0033, 0.00025)]
    assert plan.ring_groups([plan.StageRound(0.0, 0.0)] * 2, 8, [0.0003]) == 2  # unmeasured
    for odd in ((math.nan, 0.001), (0.01, -0.001), (-0.01, 0.02), (math.inf, 0.0)):  # no round takes these
        assert plan.ring_groups([plan.StageRound(*odd), plan.StageRound(0.01, 0.001)], 8, [0.0003]) == 2
    assert plan.ring_groups([plan.StageRound(0.004, 0.0005)] * 2, 8, [math.nan, math.inf]) == 2
    assert plan.ring_groups(dispatch[:1], 8) == 1
    assert plan.ring_groups(dispatch, 8, [0.0003, 0.0003]) == 2
    # all fixed, the last node's round dearer than the first's and the hops: one group would come round
    # sooner, yet every node but one would wait; never fewer groups than nodes
    assert plan.ring_cycle(1, 8, [plan.StageRound(0.004, 0.0), plan.StageRound(0.005, 0.0)], [2e-5] * 2) < 0.01
    assert plan.ring_groups([plan.StageRound(0.004, 0.0), plan.StageRound(0.005, 0.0)], 8, [2e-5] * 2) == 2
    # a busy node answering a probe late used to read as a 10 ms hop, and the ring ran 4 groups of 2
    # rows (about 0.6 of the rate of 2 groups on the demo model); the quickest probe is the hop
    hops = plan.quickest_hops({}, {"a>b": 0.6, "b>a": -1.0})
    hops = plan.quickest_hops(hops, {"a>b": 21.0, "b>a": -1.0})
    assert hops == {"a>b": pytest.approx(0.0003)}
    assert plan.ring_groups(dispatch, 8, list(hops.values())) == 2
    # rows that cost most of a round, long hops: more groups keep the nodes busy meanwhile
    heavy = [plan.StageRound(0.0005, 0.002)] * 2
    assert plan.ring_groups(heavy, 16, [0.01, 0.01]) == 4
    assert plan.ring_groups(heavy, 16, [0.05, 0.05]) == 4  # (never more than twice the nodes)
    assert plan.ring_groups(heavy, 16, [0.01, 0.01], most=3) == 3
    # rows cost nearly all, hops short: a group per node suffices, and one row is one group whatever
    assert plan.ring_groups(heavy, 16, [0.0001, 0.0001]) == 2
    assert plan.ring_groups(heavy, 1, [0.01, 0.01]) == 2
    cycle = plan.ring_cycle
    assert cycle(2, 8, dispatch, [0.0003, 0.0003]) < min(cycle(g, 8, dispatch, [0.0003, 0.0003]) for g in (1, 3, 4))


def test_the_nodes_round_times_and_their_quickest_hops_choose_the_groups() -> None:
    """The engine asks the nodes now and then: with rows decoding since its last look it chooses the
    groups from the nodes' fitted rounds and each link's quickest probe (the last node's link to the
    first, not probed, taken as the others'); with none it keeps its choice; a link gone is forgotten."""
    from types import SimpleNamespace

    from mtpipe.coordinator.engine.ring import RingEngine

    probes = [0.6, 0.6, 0.6]
    nodes = [SimpleNamespace(node_id=name, next=nxt, next_rtt_ms=0.0, round_fixed_ms=0.5, round_row_ms=2.0,
                             prefill_tokens=0, prefill_seconds=0.0) for name, nxt in [("a", "b:2"), ("b", "")]]

    def health(probe_next: bool = False, timeout: float = 5.0) -> list:
        for n, rtt in zip(nodes, probes):
            n.next_rtt_ms = rtt if probe_next and n.next else -1.0
        return nodes

    pipeline = SimpleNamespace(nodes=("a:1", "b:2"), addresses=("a:1", "b:2"), row_sinks={},
                               reformer=SimpleNamespace(down=None), close=lambda: None, health=health)
    engine = RingEngine(pipeline, SimpleNamespace(), [0], 100000, False, 100, prefill_chunk=512)
    engine._stop.set()
    try:
        engine.groups = 3
        engine._refresh_groups()
        assert engine.groups == 3 and engine._hop_s == {"a>b:2": pytest.approx(0.0003)}  # no rows: kept
        engine._rows, engine._rows_peak = {1: 8, 2: 8}, 16
        probes[0] = 20.0  # a busy node answers late: the 0.3 ms hop stays
        engine._refresh_groups()
        assert engine.groups == 2
        nodes[0].next = "c:3"  # healed: b's place taken by c, whose link is 10 ms a hop
        engine._refresh_groups()
        assert engine._hop_s == {"a>c:3": pytest.approx(0.01)} and engine.groups == 4
    finally:
        engine.close()


@pytest.mark.parametrize("how", ["lost", "failed", "link"])
def test_a_join_let_go_on_its_way_is_freed_when_its_round_is_lost(dense_ckpt: Path, how: str) -> None:
    """The client lets a row go while the round that joins it is on its way (no release goes around:
    the round would take it out); that round is then lost (idle), fails, or the ring's link breaks.
    The last node frees the row with the group: it is in no group and no one else would."""
    worker, groups, prefill, arrive = last_node(dense_ckpt)
    _, first = groups.joined("c", 1, prefill("a"), 50, ())
    assert groups.joined("c", 1, prefill("x"), 50, ()) == (True, None)  # waits for the next round
    _, second = arrive(first)
    assert {r.seq_id for r in second.rows if r.join} == {"x"}
    assert groups.client_release("x") is True
    if how == "lost":
        ended = groups.end_idle(0.0)
        assert "x" not in [row[2] for row in ended.rows]  # (not reported lost: its client is gone)
    elif how == "failed":
        groups.failed(("c", 1))
    else:
        groups.end_all()
    assert "x" not in worker.sequences and not groups.holds("x")


def test_a_client_callback_that_fails_ends_its_request_alone(ring: Any, references: dict) -> None:
    """A sink that raises (on the subscription's thread) or an `admitted` that raises (on the pool's)
    ends that request like a cancel, its row freed; the rows beside it and the requests after it
    decode as on one node."""
    engine, servers, ckpt = ring

    def failing(item: Any) -> None:
        if getattr(item, "tokens", None):
            raise RuntimeError("the client is gone")

    def admitted() -> None:
        raise RuntimeError("the client is gone")

    good = request(engine, 1, 2, 24)
    want = alone(references, ckpt, good)
    for bad in (dict(sink=failing), dict(sink=lambda item: None, admitted=admitted)):
        engine.open(request(engine, 0, 2, 200), **bad)
        assert engine.complete(good).tokens == want
    assert quiet(servers) == [0] * len(servers)


def test_closing_ends_every_request_even_those_waiting_for_a_row(dense_ckpt: Path) -> None:
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32", max_rows=1)
        prompt = engine.tokenizer.encode(PROMPTS[0])
        never = SamplingParams(logit_bias=tuple((t, -100.0) for t in sorted(engine.eos)))
        sinks: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(4)]  # (the last: not yet in the pool)
        for q in sinks:
            engine.open(GenerationRequest(prompt, max_tokens=3000, params=never), q.put)
        sinks[0].get(timeout=WAIT_S)  # the first decodes, the others wait for its row
        engine.close()
        for q in sinks:
            while q.get(timeout=WAIT_S) is not END:  # (a queue.Empty here: a request left hanging)
                pass
