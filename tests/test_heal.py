"""A node that stays lost has its layers taken by the nodes left (coordinator/cluster/heal.py,
pipeline/reform.py): placed again over them when they can hold the model, else nothing changes; the
requests under way resume with the tokens they would have had."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import PROMPTS, undisturbed

from mtpipe.coordinator.cluster.formation import Formation
from mtpipe.coordinator.cluster.heal import Healer, heal_plan
from mtpipe.coordinator.cluster.placement import GiB, ModelFootprint, NodeResources, PlacementError
from mtpipe.coordinator.pipeline.reform import Layout
from mtpipe.models.shard import ShardSpec


def footprint(layers: int = 12) -> ModelFootprint:
    return ModelFootprint((GiB,) * layers, GiB, GiB, GiB, True)


def node(node_id: str, gib: float) -> NodeResources:
    return NodeResources(node_id, int(gib * GiB))


def test_the_nodes_left_share_the_layers_the_coordinator_first() -> None:
    order, plan = heal_plan(footprint(), [node("b", 40), node("me", 20)], "me", {})
    assert [n.node_id for n in order] == ["me", "b"]
    assert [(s.node_id, s.start) for s in plan] == [("me", 0), ("b", plan[1].start)] and plan[-1].end == 12
    assert plan[1].layers > plan[0].layers  # (in proportion to memory)


def test_a_lost_nodes_layer_count_goes_with_it_and_the_others_keep_theirs() -> None:
    _, plan = heal_plan(footprint(), [node("me", 30), node("b", 30), node("c", 30)], "me", {"gone": 6, "b": 2})
    assert {s.node_id: s.layers for s in plan}["b"] == 2 and sum(s.layers for s in plan) == 12


def test_layer_counts_that_leave_the_nodes_left_no_room_give_way_to_memory() -> None:
    _, plan = heal_plan(footprint(), [node("me", 30), node("b", 30)], "me", {"me": 4, "b": 4, "gone": 4})
    assert sum(s.layers for s in plan) == 12 and all(s.layers > 4 for s in plan)  # (by memory, not as pinned)


def test_a_failed_heal_puts_back_the_nodes_and_hops_it_had_and_a_closed_pipeline_opens_nothing() -> None:
    """(No node needed: channels connect on first use.)"""
    from mtpipe.coordinator.pipeline.remote import RemotePipeline

    a, b, c = "10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"
    pipeline = RemotePipeline([a, b, c], ring_targets=["169.254.0.1:7000"])
    try:
        pipeline._load_args = ("/m", [ShardSpec(0, 4, 12), ShardSpec(4, 8, 12), ShardSpec(8, 12, 12)], True, None)
        pipeline.keep_next_targets(["169.254.0.2:7000", "169.254.0.3:7000"])  # (hops confirmed at launch)
        kept, lost = pipeline.nodes[:2], pipeline.nodes[2]
        before = pipeline._relayout(Layout([a, b], [ShardSpec(0, 6, 12), ShardSpec(6, 12, 12)], [[a], [a]], [a]))
        assert pipeline.addresses == [a, b] and pipeline.nodes == kept and pipeline.retired(lost)
        assert pipeline.next_targets == [b, ""] and pipeline._load_args[1][1] == ShardSpec(6, 12, 12)
        pipeline._relayout(before)
        assert pipeline.addresses == [a, b, c] and pipeline.nodes[:2] == kept
        assert pipeline.next_targets == ["169.254.0.2:7000", "169.254.0.3:7000", ""]
        assert pipeline.ring_targets[0] == "169.254.0.1:7000" and pipeline._load_args[1] == before.specs
    finally:
        pipeline.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipeline._relayout(before)


def test_heal_after_null_in_cluster_yaml_never_heals() -> None:
    from mtpipe.coordinator.cluster.config import parse_cluster_config
    from mtpipe.coordinator.pipeline.remote import RemotePipeline

    assert parse_cluster_config({}).placement.heal_after_s == 10.0
    never = parse_cluster_config({"placement": {"heal_after_s": None}}).placement.heal_after_s
    formation = Formation([], {}, [])
    for heal_after, heals in ((never, False), (2.5, True)):
        pipeline = RemotePipeline(["10.0.0.1:7000", "10.0.0.2:7000"])
        try:
            Healer(formation, footprint(), "me", None, 0).attach(pipeline, heal_after)
            assert (pipeline.heal is not None) == heals and pipeline.heal_after == (heal_after or 10.0)
        finally:
            pipeline.close()


@pytest.mark.parametrize(("survivors", "why"), [
    ([], "no node is left"),
    ([node("me", 4)], "short"),
    ([node("me", 4), node("b", 4)], "short"),
])
def test_nodes_that_cannot_take_the_layers_wait(survivors: list[NodeResources], why: str) -> None:
    with pytest.raises(PlacementError, match=why):
        heal_plan(footprint(), survivors, "me", {})


def test_nodes_named_by_address_without_an_id_each_cannot_heal(dense_ckpt: Path) -> None:
    from types import SimpleNamespace

    health = [SimpleNamespace(node_id="same", start=a, end=b, parameter_bytes=1) for a, b in ((0, 2), (2, 4))]
    pipeline = SimpleNamespace(addresses=["127.0.0.1:1", "127.0.0.1:2"], health=lambda: health)
    with pytest.raises(ValueError, match="--node-id"):
        Healer.over_nodes(dense_ckpt, pipeline)


def streams_under_way(engine: Any, reqs: list[Any], tokens: int) -> tuple[list[queue.SimpleQueue], list[list[int]]]:
    """The requests opened, each with at least `tokens` tokens streamed: their sinks and tokens so far."""
    sinks: list[queue.SimpleQueue] = []
    for r in reqs:
        sinks.append(q := queue.SimpleQueue())
        engine.open(r, q.put)
    got: list[list[int]] = [[] for _ in reqs]
    for i, q in enumerate(sinks):
        while len(got[i]) < tokens:
            got[i] += q.get(timeout=60).tokens
    return sinks, got


def streams_ended(sinks: list[queue.SimpleQueue], got: list[list[int]], timeout: float) -> list[list[int]]:
    """Each stream's tokens once it ended, none with an error."""
    from mtpipe.coordinator.engine.sinks import END

    for i, q in enumerate(sinks):
        while (item := q.get(timeout=timeout)) is not END:
            assert not isinstance(item, BaseException), item
            got[i] += item.tokens
    return got


def test_one_node_left_takes_every_layer() -> None:
    order, plan = heal_plan(footprint(), [node("b", 100)], "me", {"b": 2})
    assert [n.node_id for n in order] == ["b"] and [(s.start, s.end) for s in plan] == [(0, 12)]


@pytest.mark.timeout(120)
def test_the_node_left_of_two_runs_the_ring_by_itself(dense_ckpt: Path) -> None:
    """Two nodes; the last stops mid-generation. The first takes the whole model and runs the ring
    engine's groups by itself (a node holding the whole model otherwise runs a sequence at a time):
    the requests under way finish with an undisturbed run's tokens, and new ones are served."""
    from helpers import node_servers

    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.coordinator.engine.request import GenerationRequest
    from mtpipe.coordinator.engine.ring import RingEngine

    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        assert isinstance(engine, RingEngine)
        try:
            pipeline = engine.pipeline
            Healer.over_nodes(dense_ckpt, pipeline).attach(pipeline, 0.5)
            reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[i]), max_tokens=32, mtp_depth=d, mtp_auto=auto)
                    for i, (d, auto) in enumerate([(0, False), (2, False), (3, True)])]
            want = undisturbed(dense_ckpt, reqs)
            sinks, got = streams_under_way(engine, reqs, 4)
            servers[1].stop(0)
            assert streams_ended(sinks, got, 60) == want
            assert pipeline.addresses == [servers[0].address] and pipeline.rings
            assert pipeline.load_replies[-1].ring_groups  # (the node said it runs groups on the whole model)
            [h] = pipeline.health()
            assert (h.start, h.end) == (0, h.num_layers) and h.is_first and h.is_last
            service = servers[0].service
            assert not service.worker.overlap and service.ring_self  # (its rounds start in-process)
            assert engine.complete(reqs[1]).tokens == want[1]
            assert service.ring_groups.rows == 0 and not service.worker.sequences
        finally:
            engine.close()


@pytest.mark.timeout(240)
def test_the_nodes_left_take_a_lost_nodes_layers_and_requests_resume(dense_ckpt: Path) -> None:
    """Three nodes; the middle one is killed mid-generation and never comes back. After the heal
    delay the first and last take its layers (a first attempt whose shards the nodes refuse puts
    the old pipeline back), and the greedy requests under way finish with an undisturbed run's tokens."""
    from mtpipe.coordinator.bench.nodes import NodeProcesses
    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.coordinator.engine.request import GenerationRequest

    with NodeProcesses(3, model_dirs=[dense_ckpt]) as nodes:
        engine = ring_engine(dense_ckpt, nodes.addresses, dtype="float32")
        try:
            pipeline = engine.pipeline
            health = pipeline.health()
            ids = [h.node_id for h in health]
            layers = health[-1].num_layers
            placed: list[Formation] = []
            healer = Healer.over_nodes(dense_ckpt, pipeline)  # (as `serve --nodes --heal-after` makes it)
            healer.on_placed = placed.append
            healer.attach(pipeline, 1.0)
            asked: list[list[str]] = []  # the pipeline's nodes at each heal that had a layout

            def heal(addresses: list[str], missing: list[str]) -> Layout | None:
                layout = healer(addresses, missing)
                if layout is None:
                    return None
                asked.append(addresses)
                if len(asked) == 1:  # the first node takes its new shard; the last refuses one of another model
                    last = layout.specs[-1]
                    return Layout(layout.addresses, [*layout.specs[:-1], ShardSpec(last.start, last.end, layers + 1)],
                                  layout.sources, layout.ring_targets)
                return layout

            pipeline.heal = heal
            reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[i]), max_tokens=40, mtp_depth=d)
                    for i, d in enumerate([0, 2])]
            want = undisturbed(dense_ckpt, reqs)
            sinks, got = streams_under_way(engine, reqs, 8)
            lost_at = time.monotonic()
            nodes.kill(1)
            assert streams_ended(sinks, got, 90) == want
            assert time.monotonic() - lost_at >= 1.0  # (not before the heal delay)
            assert len(asked) >= 2 and asked[1] == nodes.addresses  # the refused layout was undone
            survivors = [nodes.addresses[0], nodes.addresses[2]]
            assert pipeline.addresses == survivors
            assert pipeline._renewer.addresses == survivors  # (their leases renewed on the nodes left)
            now = pipeline.health()
            assert [h.node_id for h in now] == [ids[0], ids[2]]
            assert now[0].start == 0 and now[0].end == now[1].start and now[1].end == layers
            assert [h.last_error for h in now] == ["", ""]  # (the first node's link to the lost one is gone)
            formation = healer.formation
            assert placed == [formation] and [s.node_id for s in formation.plan] == [ids[0], ids[2]]
            assert [(h.source, h.target) for h in formation.hops] == [(ids[0], ids[2])] and formation.hops[0].rtt_ms
            assert engine.complete(reqs[1]).tokens == want[1]  # and it serves new requests
        finally:
            engine.close()


def test_nodes_that_keep_their_shards_as_the_pipeline_forms_again_drop_what_its_client_had(dense_ckpt: Path) -> None:
    """The re-forming's Load of a shard a node keeps: the client's groups went with the rounds that
    were lost (its engine starts their rows again), so they go, with the rows waiting to join them. A
    last node that kept a group would otherwise start rounds with rows the nodes that took a new shard
    no longer hold. A sequence alone stays: a request may have started while the pipeline formed."""
    from helpers import node_servers

    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.node.protocol import StageUnavailable, StepKind, StepRequest

    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            pipeline, prompt = engine.pipeline, engine.tokenizer.encode(PROMPTS[0])
            heard: queue.SimpleQueue = queue.SimpleQueue()
            pipeline.row_sinks["grouped"] = heard.put  # (its rounds circle the nodes on their own)
            pipeline.steps([StepRequest("alone", 0, StepKind.PREFILL, prompt, final=True)])
            pipeline.steps([StepRequest("grouped", 0, StepKind.PREFILL, prompt, final=True, group=1, budget=10**6)])
            assert all({"alone", "grouped"} <= held(s) for s in servers)
            # The group's first round reaches the first node on a link the last node opens then: until it
            # has, the first node holds the row as a sequence alone, which a re-forming keeps.
            deadline = time.monotonic() + 10
            while not any("grouped" in g.stage.ids for g in servers[0].service.ring_groups.groups.values()):
                assert time.monotonic() < deadline, "the group's first round never reached the first node"
                time.sleep(0.002)
            model_path, specs, mtp, dtype = pipeline._load_args
            pipeline.load(model_path, specs, mtp=mtp, dtype=dtype)
            assert [r.reused for r in pipeline.load_replies] == [True, True]
            assert [held(s) for s in servers] == [{"alone"}, {"alone"}]  # (perhaps a request started meanwhile)
            # The round that was on its way is lost, not refused: its row may go on anew.
            while not isinstance(item := heard.get(timeout=10), BaseException):
                pass
            assert isinstance(item, StageUnavailable) and "group 1 is" in str(item), item  # (not held, unknown)
        finally:
            engine.close()


def held(server: Any) -> set[str]:
    """A node's sequences, alone and in groups."""
    groups = server.service.ring_groups.groups.values()
    return set(server.service.worker.sequences) | {i for g in groups for i in g.stage.ids}


@pytest.mark.timeout(120)
def test_a_request_admitted_while_the_pipeline_is_down_waits_for_it(dense_ckpt: Path) -> None:
    """One row: the second request waits for it. The pipeline is lost, the first request is cancelled,
    and the second takes its row while the pipeline is still down: its prompt waits until the pipeline
    is formed again (a prompt sent meanwhile would join a group that the forming drops), then it
    gives the tokens it gives alone."""
    from helpers import node_servers

    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.coordinator.engine.request import GenerationRequest
    from mtpipe.coordinator.engine.sinks import END
    from mtpipe.coordinator.pipeline.nodes import NodeFailure

    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32", max_rows=1)
        try:
            first, second = (GenerationRequest(engine.tokenizer.encode(PROMPTS[i]), max_tokens=32) for i in (0, 1))
            want = undisturbed(dense_ckpt, [second])[0]
            started: queue.SimpleQueue = queue.SimpleQueue()
            handle = engine.open(first, started.put)
            started.get(timeout=60)
            seen: list[bool] = []  # whether the pipeline served as the second request got its row
            second_out: queue.SimpleQueue = queue.SimpleQueue()
            engine.open(second, second_out.put, admitted=lambda: seen.append(engine.pipeline.reformer.down is None))
            engine.pipeline._lost(NodeFailure(servers[-1].address, "lost for the test"))
            handle.cancel()
            tokens = []
            while (item := second_out.get(timeout=60)) is not END:
                assert not isinstance(item, BaseException), item
                tokens += item.tokens
            assert seen == [True] and tokens == want
        finally:
            engine.close()


@pytest.mark.timeout(180)
def test_a_node_that_comes_back_after_the_heal_gives_its_old_shard_back(dense_ckpt: Path) -> None:
    """Two node processes; the last freezes mid-generation, the first takes every layer, and the frozen
    one then comes back still holding its old shard: the healer has it unloaded (it serves nothing now),
    and the pipeline goes on serving over the one node."""
    import os
    import signal

    from mtpipe.coordinator.bench.nodes import NodeProcesses
    from mtpipe.coordinator.cluster.health import probe_node
    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.coordinator.engine.request import GenerationRequest
    from mtpipe.node.wire import make_channel
    from mtpipe.proto import mtpipe_pb2 as pb
    from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

    with NodeProcesses(2, model_dirs=[dense_ckpt]) as nodes:
        engine = ring_engine(dense_ckpt, nodes.addresses, dtype="float32")
        try:
            pipeline = engine.pipeline
            healer = Healer.over_nodes(dense_ckpt, pipeline)
            healer.check_left_s = 0.2
            healer.attach(pipeline, 0.5)
            reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[0]), max_tokens=48, mtp_depth=2)]
            want = undisturbed(dense_ckpt, reqs)
            sinks, got = streams_under_way(engine, reqs, 4)
            held = pipeline.health()[1]
            os.kill(nodes.procs[1].pid, signal.SIGSTOP)
            try:
                assert streams_ended(sinks, got, 90) == want
                assert pipeline.addresses == [nodes.addresses[0]]
            finally:
                os.kill(nodes.procs[1].pid, signal.SIGCONT)
            deadline = time.monotonic() + 60
            while (row := probe_node(nodes.addresses[1], None)).get("layers"):
                assert time.monotonic() < deadline, f"the node that came back kept its shard: {row}"
                time.sleep(0.2)
            assert row["reachable"] and row["status"] == "idle" and not healer._left
            from mtpipe.coordinator.api.serve import nodes_cluster_info

            info = nodes_cluster_info(engine, "m")()  # (GET /v1/cluster: the node left out is named)
            assert list(info["left_out"]) == [nodes.addresses[1]] and info["healthy"]
            with make_channel(nodes.addresses[1], None) as channel:  # (its memory given back)
                now = pb_grpc.NodeStub(channel).Health(pb.HealthRequest(), timeout=10)
            assert now.mlx_active_memory < held.mlx_active_memory - held.parameter_bytes // 2
            assert engine.complete(reqs[0]).tokens == want[0]  # (the pipeline of one serves on)
        finally:
            engine.close()


def test_unload_frees_a_shard_for_its_own_coordinator_only(dense_ckpt: Path) -> None:
    """Unload drops the shard a node holds for the coordinator that asks; another coordinator connected
    to it keeps it; a node without a shard has nothing to unload, and loads again when asked."""
    import grpc
    from helpers import node_servers

    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.coordinator.engine.request import GenerationRequest
    from mtpipe.node.wire import make_channel
    from mtpipe.proto import mtpipe_pb2 as pb
    from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            pipeline = engine.pipeline
            before = pipeline.health()
            stub = pipeline.nodes[1].stub
            for other in ("someone-else", ""):  # (this coordinator loaded it and is connected: no other may)
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Unload(pb.UnloadRequest(client_id=other), timeout=10)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert pipeline.health()[1].loaded
            reply = stub.Unload(pb.UnloadRequest(client_id=pipeline.client_id), timeout=10)
            assert reply.unloaded and reply.freed_bytes == before[1].parameter_bytes
            service = servers[1].service
            assert service.worker is None and service.next is None and service.ring is None and not service._owners
            after = stub.Health(pb.HealthRequest(), timeout=10)
            assert not after.loaded and after.fingerprint == "" and after.parameter_bytes == 0
            assert not stub.Unload(pb.UnloadRequest(client_id=pipeline.client_id), timeout=10).unloaded
        finally:
            engine.close()
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")  # (it loads again)
        try:
            prompt = engine.tokenizer.encode(PROMPTS[1])
            assert len(engine.complete(GenerationRequest(prompt, max_tokens=6)).tokens) == 6
            owner = engine.pipeline.client_id
        finally:
            engine.close()
        with make_channel(servers[1].address, None) as channel:
            stub = pb_grpc.NodeStub(channel)
            for other in ("someone-else", ""):  # (its coordinator gone: still none but it may unload its shard)
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Unload(pb.UnloadRequest(client_id=other), timeout=10)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert servers[1].service.worker is not None
            assert stub.Unload(pb.UnloadRequest(client_id=owner), timeout=10).unloaded


def test_a_node_without_unload_is_left_alone(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node of an earlier version, without the Unload RPC, is left alone (not asked again and again)."""
    from helpers import node_servers

    from mtpipe.coordinator.cluster.heal import unload_left_out
    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.node.service import NodeService
    from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

    monkeypatch.setattr(NodeService, "Unload", pb_grpc.NodeServicer.Unload)
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        client = engine.pipeline.client_id
        engine.close()
        node = servers[1]
        assert unload_left_out(node.service.node_id, node.address, None, client) is False
        assert unload_left_out("another-id", node.address, None, client) is False  # (someone else there now)
        assert node.service.worker is not None


def test_a_heal_shares_a_machines_free_memory_among_the_nodes_left_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes on this machine, one lost: the two left offer the heal what they share, as at formation."""
    from helpers import node_servers

    from mtpipe.coordinator.cluster import heal as heal_module
    from mtpipe.coordinator.cluster.config import StaticNode
    from mtpipe.coordinator.cluster.formation import static_resources

    with node_servers(3) as servers:
        found = static_resources([StaticNode(host="127.0.0.1", port=s.port) for s in servers], None, reserve=0)
        control = {r.node_id: f"127.0.0.1:{r.port}" for r in found}
        healer = Healer(Formation([], control, [], order=found), footprint(), found[0].node_id, None, 0)
        offered: list[list[NodeResources]] = []

        def plan(fp: ModelFootprint, survivors: list[NodeResources], *args: Any, **kw: Any) -> Any:
            offered.append(survivors)
            raise PlacementError("(only what each node offers is looked at)")

        monkeypatch.setattr(heal_module, "heal_plan", plan)
        addresses = [s.address for s in servers]
        assert healer(addresses, [addresses[2]]) is None
        pair = static_resources([StaticNode(host="127.0.0.1", port=s.port) for s in servers[:2]], None, reserve=0)
        assert [n.available for n in offered[0]] == pytest.approx([n.available for n in pair], rel=0.2)
        assert sum(n.available for n in offered[0]) < 1.3 * sum(n.available for n in found)


def test_a_node_an_earlier_heal_left_out_takes_layers_again_when_another_is_lost() -> None:
    """Three nodes; an earlier heal left the third out (it came back idle: a spare). Now the second is
    lost: the heal places the model over the first and the spare, not the first alone; a spare that does
    not answer is left out of it."""
    from helpers import node_servers

    from mtpipe.coordinator.cluster.config import StaticNode
    from mtpipe.coordinator.cluster.formation import static_resources

    small = ModelFootprint((2**20,) * 4, 2**20, 2**20, 2**20, True)
    with node_servers(3) as servers:
        found = static_resources([StaticNode(host="127.0.0.1", port=s.port) for s in servers], None, reserve=0)
        control = {r.node_id: f"127.0.0.1:{r.port}" for r in found}
        a, b, c = (control[n.node_id] for n in found)
        healer = Healer(Formation([], control, [], order=found), small, found[0].node_id, None, 0)
        healer.formation.order = found[:2]  # (as the earlier heal left it)
        healer.left_out = {found[2].node_id: c}
        healer._left = dict(healer.left_out)  # (the sweep's list: what may come back holding a shard)
        layout = healer([a, b], [b])
        assert layout is not None and layout.addresses == [a, c]
        assert not healer._left  # (idle, and the shard it loads now is this pipeline's: never swept)
        (first, second) = layout.specs
        assert first.start == 0 < first.end == second.start < second.end == 4
        servers[2].stop(0)
        layout = healer([a, b], [b])
        assert layout is not None and layout.addresses == [a]  # (the first alone, as without a spare)


def test_a_member_that_joined_after_placement_takes_layers_when_a_node_is_lost() -> None:
    """Two nodes placed; a third joined since (a launch's member, not placed). The second is lost: the
    heal places the model over the first and the one that joined."""
    from helpers import node_servers

    from mtpipe.coordinator.cluster.config import StaticNode
    from mtpipe.coordinator.cluster.formation import static_resources

    small = ModelFootprint((2**20,) * 4, 2**20, 2**20, 2**20, True)
    with node_servers(3) as servers:
        found = static_resources([StaticNode(host="127.0.0.1", port=s.port) for s in servers], None, reserve=0)
        control = {r.node_id: f"127.0.0.1:{r.port}" for r in found}
        a, b, c = (control[n.node_id] for n in found)
        late = found[2]
        healer = Healer(Formation([], {k: v for k, v in control.items() if k != late.node_id}, [], order=found[:2]),
                        small, found[0].node_id, None, 0, joined=lambda: {late.node_id: (late, c)})
        layout = healer([a, b], [b])
        assert layout is not None and layout.addresses == [a, c]
