"""Admission by memory in the ring engine (issues 12 and 13): each node's rows, in the groups they run in,
must fit that node's budget for its own layers, with room for each row to grow by a horizon; where they
outgrow a node after all, the last admitted leave for the head of the queue and go on where they stopped
once there is room, giving the tokens they give without it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from batch_streams import (Stream, cancel_while_preempted, check_preemption_mix, encode, never_ends, nothing_scheduled,
                           preemption_mix, request)
from helpers import PROMPTS, node_servers
from test_ring import quiet

from mtpipe.coordinator.api.serve import nodes_cluster_info
from mtpipe.coordinator.engine import scheduler as plan
from mtpipe.coordinator.engine.build import local_engine, ring_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.engine.ring import RingEngine
from mtpipe.coordinator.engine.ring_live import RingLive
from mtpipe.coordinator.engine.ring_room import RingRoom
from mtpipe.coordinator.engine.sinks import ServerBusy
from mtpipe.models.config import load_config
from mtpipe.models.registry import DEMO_MODEL
from mtpipe.node.protocol import StageUnavailable

HORIZON = 8
TOKENS = 48
GROUPS = 2


def test_each_node_counts_its_own_layers_and_the_plan_admits_and_preempts_by_the_fullest() -> None:
    args = SimpleNamespace(num_hidden_layers=8, full_attention_interval=4, num_key_value_heads=2, head_dim=4,
                           linear_num_key_heads=2, linear_key_head_dim=4, linear_num_value_heads=2,
                           linear_value_head_dim=4, linear_conv_kernel_dim=4)
    whole = plan.ModelDims.of(args, 2, mtp=True)
    first, last = plan.ModelDims.of(args, 2, mtp=False, layers=(0, 3)), plan.ModelDims.of(args, 2, mtp=True,
                                                                                         layers=(3, 8))
    assert first.kv_bytes_per_token == 0 and first.state_bytes == last.state_bytes  # (3 linear layers each)
    assert first.kv_bytes_per_token + last.kv_bytes_per_token == whole.kv_bytes_per_token  # (layers 3, 7 and MTP)
    assert first.state_bytes + last.state_bytes == whole.state_bytes
    row = plan.Footprint(100, 0)
    nodes = [plan.NodeRoom(first, 10**9), plan.NodeRoom(last, plan.batch_bytes(last, [row]) * 2)]
    waiting = [plan.Waiting(s, row, 0.0) for s in "abcd"]
    # Two groups: two rows fit the last node, one in each group; the third waits, and the fourth behind it.
    assert plan.admit_ring(waiting, {}, 2, nodes, 32) == [("a", 1), ("b", 2)]
    assert plan.admit_ring(waiting, {}, 2, nodes, 1) == [("a", 1)]
    assert plan.admit_ring(waiting[2:], {1: [row], 2: [row]}, 2, nodes, 32) == []
    # One alone is admitted whatever it costs.
    huge = plan.Waiting("e", plan.Footprint(10**6, 3), 0.0)
    assert plan.admit_ring([huge], {}, 2, nodes, 32) == [("e", 1)]
    grown = plan.Footprint(150, 0)
    assert plan.ring_to_preempt([(1, row), (2, row)], nodes, [True] * 2) == []
    # The last admitted leave first; a prompt on its way stays (and counts), and the first never leaves.
    assert plan.ring_to_preempt([(1, grown), (2, grown), (1, row)], nodes, [True] * 3) == [2, 1]
    assert plan.ring_to_preempt([(1, grown), (2, grown), (1, row)], nodes, [True, True, False]) == [1]
    assert plan.ring_to_preempt([(1, grown), (2, grown), (1, row)], nodes, [True, False, False]) == []
    assert plan.ring_to_preempt([(1, huge.need)], nodes, [True]) == []


def squeeze(engine: RingEngine, reqs: list[Any], horizon: int) -> list[int]:
    """Each node's budget: room (on the fullest node) for these rows, in the groups they join in this order,
    once each has `horizon` tokens, not at their ends (KV counted token by token, not in the steps a batch
    grows by). What each node needs for them."""
    room, health = engine.room, engine.pipeline.health()
    room.kv_step = 1
    room.rebudget(0, health)
    groups: dict[int, list[plan.Footprint]] = {}
    for r in reqs:
        g = plan.pick_group({k: len(v) for k, v in groups.items()}, engine.groups)
        groups.setdefault(g, []).append(plan.Footprint(len(r.prompt_tokens) + horizon + r.mtp_depth, r.mtp_depth))
    needs = [sum(plan.batch_bytes(n.dims, rows) for rows in groups.values()) for n in room.nodes]
    room.rebudget(max(needs), health)
    return needs


@pytest.mark.parametrize(("model", "nodes"), [("dense", 2), ("moe", 3)])
def test_preempted_rows_go_on_where_they_stopped_token_identical(dense_ckpt: Path, moe_ckpt: Path, model: str,
                                                                 nodes: int) -> None:
    path = dense_ckpt if model == "dense" else moe_ckpt
    reference = local_engine(path, dtype=mx.float32)
    with node_servers(nodes) as servers:
        engine = ring_engine(path, [s.address for s in servers], dtype="float32", horizon=HORIZON, prefix_cache=0,
                             groups=GROUPS)
        try:
            reqs = preemption_mix(engine, [encode(engine, p) for p in PROMPTS[:4]], TOKENS)
            ends_at = squeeze(engine, reqs, TOKENS)
            assert max(squeeze(engine, reqs, HORIZON)) < max(ends_at)  # (not all four at their ends)
            check_preemption_mix([Stream(engine, r) for r in reqs], reference, TOKENS,
                                 lambda: engine.room.preemptions)
            assert quiet(servers) == [0] * nodes
            assert not engine.room.held and not engine.room.waiting
            ring = nodes_cluster_info(engine, "tiny")()["ring"]  # (GET /v1/cluster)
            assert ring["preemptions"] == engine.room.preemptions and ring["admit_horizon"] == HORIZON
            assert ring["waiting"] == 0 and ring["budget_bytes"] == [n.budget for n in engine.room.nodes]
            assert ring["cache_usage"] == [0.0] * nodes  # (each node's share of its budget held now: no rows)
        finally:
            engine.close()
    reference.close()


def test_a_preempted_request_cancelled_while_it_waits_ends_and_holds_nothing(dense_ckpt: Path) -> None:
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32", horizon=HORIZON,
                             prefix_cache=0, groups=GROUPS)
        try:
            ends = never_ends(engine)
            first = request(encode(engine, PROMPTS[5]), 0, 2000, params=ends)
            second = request(encode(engine, PROMPTS[6]), 0, 2000, params=ends)
            squeeze(engine, [first, second], HORIZON)
            running, waiting = Stream(engine, first), Stream(engine, second)  # (both admitted before either grows)
            running.first(), waiting.first()
            cancel_while_preempted(engine, running, waiting, lambda: engine.room.preemptions)
            assert quiet(servers) == [0, 0]
            assert not engine.room.held and not engine.room.waiting and not engine._queued
            assert nothing_scheduled(engine)
        finally:
            engine.close()


def test_a_request_without_room_waits_then_is_refused_and_the_nodes_budgets_come_from_their_memory(
        dense_ckpt: Path) -> None:
    """Beside a row that fills a node, a new request waits in the queue; after the queue timeout it is refused
    with a retry hint, and nothing of it reached a node. By default each node's budget is half of what it had
    free, less its share of kept prefixes; a budget given holds on every node."""
    with node_servers(2) as servers:
        addresses = [s.address for s in servers]
        engine = ring_engine(dense_ckpt, addresses, dtype="float32", horizon=HORIZON, groups=GROUPS)
        try:
            health = engine.pipeline.health()  # (free memory read again: a little off what it was at the start)
            assert engine.kept is not None
            share = engine.kept.budget // 2
            assert len({h.machine for h in health}) == 1  # (one machine: its free memory is theirs together)
            for n, h in zip(engine.room.nodes, health):
                assert n.budget == pytest.approx(max(64 * 2**20, h.memory_available // 4 - share), rel=0.25)
            whole = plan.ModelDims.of(load_config(dense_ckpt).args, 4, mtp=True)  # (the MTP layer: on the last node)
            assert sum(n.dims.kv_bytes_per_token for n in engine.room.nodes) == whole.kv_bytes_per_token
            assert sum(n.dims.state_bytes for n in engine.room.nodes) == whole.state_bytes
        finally:
            engine.close()
        engine = ring_engine(dense_ckpt, addresses, dtype="float32", horizon=HORIZON, groups=GROUPS, prefix_cache=0,
                             memory_budget=12345)
        try:
            assert [n.budget for n in engine.room.nodes] == [12345, 12345]
            engine.queue_timeout = 0.5
            ends = never_ends(engine)
            first = request(encode(engine, PROMPTS[5]), 0, 2000, params=ends)
            running = Stream(engine, first).first()  # (one alone is admitted whatever it costs)
            late = Stream(engine, request(encode(engine, PROMPTS[6]), 0, 8, params=ends))
            with pytest.raises(ServerBusy, match="no room for this request") as refused:
                late.finish()
            assert refused.value.retry_after >= 1 and not late.chunks
            running.handle.cancel()
            running.finish()
            assert quiet(servers) == [0, 0] and not engine.room.held and not engine.room.waiting
            assert not engine._queued  # (one refused leaves nothing for close() to end)
        finally:
            engine.close()


def test_close_ends_a_preempted_request_waiting_for_room(dense_ckpt: Path) -> None:
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32", horizon=HORIZON,
                             prefix_cache=0, groups=GROUPS)
        ends = never_ends(engine)
        first = request(encode(engine, PROMPTS[5]), 0, 2000, params=ends)
        second = request(encode(engine, PROMPTS[6]), 0, 2000, params=ends)
        squeeze(engine, [first, second], HORIZON)
        running, waiting = Stream(engine, first), Stream(engine, second)
        running.first(), waiting.first()
        deadline = time.monotonic() + 60
        while not engine.room.waiting:
            assert time.monotonic() < deadline, "never preempted"
            time.sleep(0.01)
        engine.close()
        with pytest.raises(StageUnavailable, match="the engine was stopped"):
            waiting.finish()
        with pytest.raises(Exception):  # (the pipeline closed under it)
            running.finish()
        assert not engine.room.waiting and not engine._queued


def test_a_nodes_budget_is_half_its_free_memory_within_what_it_offers_shared_with_nodes_on_its_machine() -> None:
    room = RingRoom(load_config(DEMO_MODEL).args, True, max_rows=8, prefix_share=10)

    def reply(node: str, start: int, end: int, available: int, offered: int = 0, machine: str = "") -> SimpleNamespace:
        return SimpleNamespace(node_id=node, start=start, end=end, num_layers=8, loaded=True, dtype="bfloat16",
                               memory_available=available, memory_offered=offered, parameter_bytes=1000,
                               machine=machine)

    room.measure([reply("a", 0, 4, 2**31), reply("b", 4, 8, 2**31, offered=2**30 + 1000)])
    assert [n.budget for n in room.nodes] == [2**30 - 10, 2**29 - 10]  # (b's cap: 1 GiB beside its weights)
    room.measure([reply("a", 0, 4, 2**20), reply("b", 4, 8, 2**33)])
    assert [n.budget for n in room.nodes] == [2**30 - 10, 2**29 - 10]  # (read once per shard a node holds)
    room.measure([reply("a", 0, 8, 2**28)])  # (healed: one node holds every layer now)
    assert [n.budget for n in room.nodes] == [2**27 - 10] and room.nodes[0].dims.state_bytes > 0
    room.measure([reply("a", 0, 8, 1), SimpleNamespace(loaded=False)])  # (one being formed again: no reading)
    assert [n.budget for n in room.nodes] == [2**27 - 10]
    room.rebudget(None, [reply("a", 0, 2, 3 * 2**30, machine="m"), reply("b", 2, 4, 3 * 2**30, machine="m"),
                         reply("c", 4, 6, 3 * 2**30, machine="n"), reply("d", 6, 8, 3 * 2**30, offered=2**30 + 1000, machine="m")])
    # (a, b and d share one machine's free memory; c has one of its own; d's cap holds within its share)
    assert [n.budget for n in room.nodes] == [2**29 - 10, 2**29 - 10, 3 * 2**29 - 10, 2**29 - 10]
    room.rebudget(None, [reply("a", 0, 4, 2**32, offered=2**32 + 1000, machine="m"),
                         reply("b", 4, 8, 2**32, offered=2**32 + 1000, machine="m")])
    # (two launched nodes without a cap, on one machine: each offers all of it, and they share it)
    assert [n.budget for n in room.nodes] == [2**30 - 10, 2**30 - 10]


def test_a_room_without_the_models_config_admits_by_count() -> None:
    room = RingRoom(None, False, max_rows=2)
    room.measure([SimpleNamespace()])  # (nothing to measure by)
    lives = [RingLive(f"s{i}", GenerationRequest([1], max_tokens=4), print, None, None, 0.0) for i in range(3)]
    for x in lives:
        room.queue(x)
    admitted, refused = room.admit(2, 0.0, 60.0)
    assert admitted == lives[:2] and not refused and sorted(x.group for x in admitted) == [1, 2]
    assert room.admit(2, 61.0, 60.0) == ([], [lives[2]]) and not room.waiting


@pytest.mark.timeout(180)
def test_a_node_frozen_while_a_row_waits_preempted_loses_no_token(dense_ckpt: Path) -> None:
    """A node frozen while one row decodes and another waits preempted: the decoding row resumes once the
    node is back, the preempted one is admitted again later, and each gives the tokens of an undisturbed run;
    nothing is left on the nodes."""
    from helpers import undisturbed
    from test_faults import FREEZE_S, SETTLE_S, active

    from mtpipe.coordinator.bench.nodes import NodeProcesses

    with NodeProcesses(2, model_dirs=[dense_ckpt]) as nodes:
        engine = ring_engine(dense_ckpt, nodes.addresses, dtype="float32", horizon=HORIZON, prefix_cache=0,
                             groups=GROUPS)
        try:
            ends = never_ends(engine)
            reqs = [request(encode(engine, PROMPTS[i]), 0, 160, params=ends) for i in (5, 6)]
            want = undisturbed(dense_ckpt, reqs)
            squeeze(engine, reqs, HORIZON)
            streams = [Stream(engine, r) for r in reqs]  # (both admitted before either grows)
            deadline = time.monotonic() + 60
            while not engine.room.waiting:  # (the second outgrows the budget within a few rounds)
                assert time.monotonic() < deadline, "never preempted"
                time.sleep(0.01)
            nodes.freeze(1, FREEZE_S)
            assert [s.finish() for s in streams] == want
            assert streams[1].stats.preempted >= 1
            stamps = streams[0].stamps  # (the running row stood still while the node was frozen)
            assert max(b - a for a, b in zip(stamps, stamps[1:])) > FREEZE_S / 2
            deadline = time.monotonic() + SETTLE_S
            while any(left := active(engine)) and time.monotonic() < deadline:
                time.sleep(0.25)
            assert left == [0, 0] and nothing_scheduled(engine)
        finally:
            engine.close()


def test_a_late_error_for_a_preempted_rows_old_sequence_is_dropped() -> None:
    """A node's error for a row's sequence, dispatched on another thread just as the row is preempted:
    the sequence it names is freed, the request goes on as a new one and never sees that error."""
    import queue
    import threading

    from mtpipe.node.protocol import StageError, StepOutput

    class Pipeline:  # (one that answers every prompt with token 7 and nothing else)
        nodes = ("a", "b")

        def __init__(self) -> None:
            self.row_sinks: dict[str, Any] = {}
            self.reformer = SimpleNamespace(down=None, down_at=0.0, given_up=False, attempt_error=None,
                                            wait=lambda t: True)

        def steps(self, steps: list[Any], stop: Any = None) -> list[StepOutput]:
            return [StepOutput(steps[-1].seq_id, steps[-1].step, [7], continued=True)]

        def release(self, seq_id: str, group: int = 0) -> None: ...
        def health(self, **kw: Any) -> list[Any]: raise RuntimeError("none")  # noqa: E704
        def describe(self) -> dict[str, Any]: return {}  # noqa: E704
        def close(self) -> None: ...

    detok = SimpleNamespace(add_token=lambda t: None, last_segment="", finalize=lambda: None, tokens=[])
    pipeline, room = Pipeline(), RingRoom(None, False, max_rows=4)
    engine = RingEngine(pipeline, SimpleNamespace(detokenizer=detok), [0], 100000, False, 100, prefill_chunk=8,
                        room=room, groups=1, resume_window=5.0)
    try:
        got: queue.SimpleQueue = queue.SimpleQueue()
        engine.open(GenerationRequest([1, 2, 3], max_tokens=50), got.put)
        assert got.get(timeout=10).tokens == [7]
        live = next(iter(room.held.values()))
        old, old_sink = live.seq_id, pipeline.row_sinks[live.seq_id]
        room.nodes = [plan.NodeRoom(plan.ModelDims(1, 0), 1)]
        leaving = [live]  # (the room says it must leave, once: the engine's own thread may check the room too)
        room.over = lambda movable: [leaving.pop()] if leaving else []
        end_kept = engine._end_kept

        class Watched:  # (the request's lock, telling when a thread waits for it while another holds it)
            def __init__(self, lock: Any) -> None:
                self.lock, self.contended = lock, threading.Event()
                self.owner: Any = None
                self.depth = 0

            def __enter__(self) -> Any:
                if self.owner not in (None, threading.current_thread()):
                    self.contended.set()
                out = self.lock.__enter__()
                self.owner, self.depth = threading.current_thread(), self.depth + 1
                return out

            def __exit__(self, *exc: Any) -> Any:
                self.depth -= 1
                if not self.depth:
                    self.owner = None
                return self.lock.__exit__(*exc)

        live.lock = watched = Watched(live.lock)
        error = threading.Thread(target=old_sink, args=(StageError(f"node b: boom for {old}"),))

        began = threading.Event()

        def error_meanwhile(x: RingLive, fed: Any) -> None:  # (under its lock, before its sequence changes)
            if x is live and x.resuming and not began.is_set():  # (its first end as it leaves)
                error.start()
                began.set()
                assert watched.contended.wait(10)  # (the error's thread is past its first check, at the lock)
            end_kept(x, fed)

        engine._end_kept = error_meanwhile
        engine._room_checked = 0.0
        engine._make_room()  # (here, or on the engine's thread where it checks the room first)
        assert began.wait(10)
        error.join(10)
        assert not error.is_alive()
        assert live.stats.preempted == 1 and live.seq_id != old and not live.done
        while not got.empty():
            assert not isinstance(got.get(), BaseException)
    finally:
        engine.close()


def test_the_rooms_queue_goes_by_priority_and_the_lowest_priority_leaves_first() -> None:
    room = RingRoom(None, False, max_rows=1)  # (by count)
    lives = [RingLive(f"s{i}", GenerationRequest([1], max_tokens=4, priority=p), print, None, None, 0.0)
             for i, p in enumerate([3, 0, -2, 0])]
    for x in lives:
        room.queue(x)
    assert room.admit(1, 0.0, 60.0)[0] == [lives[2]]
    room.give_back(lives[2])
    assert room.admit(1, 0.0, 60.0)[0] == [lives[1]]  # (of two of one priority, the first come)
    reply = SimpleNamespace(node_id="a", start=0, end=8, num_layers=8, loaded=True, dtype="bfloat16", machine="",
                            memory_available=2**30, memory_offered=0, parameter_bytes=0)
    room = RingRoom(load_config(DEMO_MODEL).args, True, max_rows=4)
    room.measure([reply])
    first, second = (RingLive(f"r{p}", GenerationRequest([1] * 8, max_tokens=4, priority=p), print, None, None, 0.0)
                     for p in (1, 0))
    for x in (first, second):
        room.queue(x)
        room.admit(1, 0.0, 60.0)
    assert list(room.held.values()) == [first, second] and first.order < second.order
    room.rebudget(1, [reply])  # (neither fits now: the one kept is the higher priority's)
    assert room.over({id(first), id(second)}) == [first]  # (admitted first, but of the lower priority)
