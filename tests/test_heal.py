"""A node that stays lost has its layers taken by the nodes left (coordinator/cluster/heal.py,
pipeline/reform.py): placed again over them when they can hold the model, else nothing changes; the
requests under way resume with the tokens they would have had."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
from helpers import PROMPTS, undisturbed

from mtpipe.coordinator.cluster.formation import Formation
from mtpipe.coordinator.cluster.heal import Healer, heal_plan
from mtpipe.coordinator.cluster.placement import GiB, ModelFootprint, NodeResources, PlacementError, StagePlan
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


@pytest.mark.parametrize(("survivors", "why"), [
    ([node("me", 100)], "a ring needs two"),
    ([node("me", 4), node("b", 4)], "short"),
])
def test_nodes_that_cannot_take_the_layers_wait(survivors: list[NodeResources], why: str) -> None:
    with pytest.raises(PlacementError, match=why):
        heal_plan(footprint(), survivors, "me", {})


@pytest.mark.timeout(240)
def test_the_nodes_left_take_a_lost_nodes_layers_and_requests_resume(dense_ckpt: Path) -> None:
    """Three nodes; the middle one is killed mid-generation and never comes back. After the heal
    delay the first and last take its layers (a first attempt whose shards the nodes refuse puts
    the old pipeline back), and the greedy requests under way finish with an undisturbed run's tokens."""
    from mtpipe.coordinator.bench.nodes import NodeProcesses
    from mtpipe.coordinator.cluster.placement import model_footprint
    from mtpipe.coordinator.engine.build import ring_engine
    from mtpipe.coordinator.engine.request import GenerationRequest
    from mtpipe.coordinator.engine.sinks import END

    with NodeProcesses(3, model_dirs=[dense_ckpt]) as nodes:
        engine = ring_engine(dense_ckpt, nodes.addresses, dtype="float32")
        try:
            pipeline = engine.pipeline
            health = pipeline.health()
            ids = [h.node_id for h in health]
            layers = health[-1].num_layers
            formation = Formation(
                [StagePlan(h.node_id, h.start, h.end, 0, 0) for h in health], dict(zip(ids, nodes.addresses)), [],
                order=[NodeResources(i, 0, (), int(a.rsplit(":", 1)[1]), ("127.0.0.1",))
                       for i, a in zip(ids, nodes.addresses)])
            placed: list[Formation] = []
            healer = Healer(formation, model_footprint(dense_ckpt), ids[0], None, 0, on_placed=placed.append)
            healer.attach(pipeline, 1.0)
            asked: list[list[str]] = []

            def heal(addresses: list[str], missing: list[str]) -> Layout | None:
                asked.append(addresses)
                layout = healer(addresses, missing)
                if layout is not None and len(asked) == 1:  # shards of a model of another depth: refused
                    return Layout(layout.addresses, [ShardSpec(s.start, s.end, layers + 1) for s in layout.specs],
                                  layout.sources, layout.ring_targets)
                return layout

            pipeline.heal = heal
            reqs = [GenerationRequest(engine.tokenizer.encode(PROMPTS[i]), max_tokens=40, mtp_depth=d)
                    for i, d in enumerate([0, 2])]
            want = undisturbed(dense_ckpt, reqs)
            sinks: list[queue.SimpleQueue] = []
            for r in reqs:
                sinks.append(q := queue.SimpleQueue())
                engine.open(r, q.put)
            got: list[list[int]] = [[] for _ in reqs]
            for i, q in enumerate(sinks):
                while len(got[i]) < 8:
                    got[i] += q.get(timeout=60).tokens
            lost_at = time.monotonic()
            nodes.kill(1)
            for i, q in enumerate(sinks):
                while (item := q.get(timeout=90)) is not END:
                    assert not isinstance(item, BaseException), item
                    got[i] += item.tokens
            assert got == want
            assert time.monotonic() - lost_at >= 1.0  # (not before the heal delay)
            assert len(asked) >= 2 and asked[1] == nodes.addresses  # the refused layout was undone
            survivors = [nodes.addresses[0], nodes.addresses[2]]
            assert pipeline.addresses == survivors
            assert pipeline._renewer.addresses == survivors  # (their leases renewed on the nodes left)
            now = pipeline.health()
            assert [h.node_id for h in now] == [ids[0], ids[2]]
            assert now[0].start == 0 and now[0].end == now[1].start and now[1].end == layers
            assert [h.last_error for h in now] == ["", ""]  # (the first node's link to the lost one is gone)
            assert placed and [s.node_id for s in formation.plan] == [ids[0], ids[2]]
            assert [(h.source, h.target) for h in formation.hops] == [(ids[0], ids[2])] and formation.hops[0].rtt_ms
            assert engine.complete(reqs[1]).tokens == want[1]  # and it serves new requests
        finally:
            engine.close()
