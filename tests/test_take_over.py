"""Coordinators may share the shards nodes hold; another's Load of other shards is refused while the first
is connected, unless it takes the nodes over, which ends the first one's requests there (they fail, none
hangs)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from helpers import PROMPTS, TINY_LAYERS

from mtpipe.coordinator.api.readiness import Readiness
from mtpipe.coordinator.engine.build import local_engine, remote_engine, ring_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.pipeline.nodes import NodeInUse
from mtpipe.models.shard import ShardSpec
from mtpipe.node.protocol import StageError, StageUnavailable
from mtpipe.node.server import NodeServer

SPECS = [ShardSpec(0, 2, TINY_LAYERS), ShardSpec(2, 4, TINY_LAYERS)]
OTHER = [ShardSpec(0, 1, TINY_LAYERS), ShardSpec(1, 4, TINY_LAYERS)]


@contextmanager
def running(dense_ckpt: Path, count: int) -> Iterator[tuple[list[NodeServer], list[Any]]]:
    """`count` node servers on this machine, and a list for the engines made over them: all closed after."""
    servers = [NodeServer("127.0.0.1", 0, model_dirs=[dense_ckpt]).start() for _ in range(count)]
    engines: list[Any] = []
    try:
        yield servers, engines
    finally:
        for e in engines:
            e.pipeline.close()
        for s in servers:
            s.stop(0)


def generate(engine: Any, text: str) -> list[int]:
    return engine.complete(GenerationRequest(engine.tokenizer.encode(text), max_tokens=12, mtp_depth=1)).tokens


def test_a_second_coordinator_is_refused_unless_it_takes_the_nodes_over(dense_ckpt: Path) -> None:
    servers = [NodeServer("127.0.0.1", 0, model_dirs=[dense_ckpt]).start() for _ in range(2)]
    addresses = [s.address for s in servers]
    engines: list[Engine] = []

    def engine(specs: list[ShardSpec] = SPECS, **kw: object) -> Engine:
        e = remote_engine(dense_ckpt, addresses, dtype="float32", specs=specs, **kw)
        engines.append(e)
        return e

    try:
        want = generate(local_engine(dense_ckpt, dtype=mx.float32), PROMPTS[0])
        first = engine()
        assert generate(first, PROMPTS[0]) == want
        sharing = engine()  # the same shards: both serve
        assert generate(sharing, PROMPTS[0]) == generate(first, PROMPTS[0]) == want
        sharing.pipeline.close()
        start = time.monotonic()
        with pytest.raises(NodeInUse, match="serves another coordinator"):
            engine(OTHER)
        assert time.monotonic() - start < 10
        assert generate(first, PROMPTS[0]) == want  # the refused Load changed nothing
        second = engine(OTHER, take_over=True)
        start = time.monotonic()
        with pytest.raises((StageUnavailable, StageError)):  # its subscription ended, or its frames refused
            generate(first, PROMPTS[0])
        assert time.monotonic() - start < 10
        assert generate(second, PROMPTS[0]) == want
        second.pipeline.close()
        third = engine()  # the nodes are free for other shards once their coordinator has closed
        assert generate(third, PROMPTS[0]) == want
    finally:
        for e in engines:
            e.pipeline.close()
        for s in servers:
            s.stop(0)


def test_a_coordinator_sharing_a_node_cannot_re_link_it_to_other_nodes(dense_ckpt: Path) -> None:
    """Two nodes hold the same shard (b and c): a second coordinator whose pipeline goes a -> c loads every
    node, but a refuses to link to c while the first, which runs a -> b, is subscribed: the first's
    requests go on. One that names b at another address shares a's link to b, which stays."""
    from mtpipe.coordinator.pipeline.nodes import NodeFailure

    with running(dense_ckpt, 3) as (servers, engines):
        a, b, c = (s.address for s in servers)
        want = generate(local_engine(dense_ckpt, dtype=mx.float32), PROMPTS[1])
        first = remote_engine(dense_ckpt, [a, b], dtype="float32", specs=SPECS)
        engines.append(first)
        assert generate(first, PROMPTS[1]) == want
        engines.append(remote_engine(dense_ckpt, [c], dtype="float32", specs=[SPECS[1]]))  # (c holds b's shard)
        engines[-1].pipeline.close()
        with pytest.raises(NodeFailure, match="serves another coordinator through its next stage"):
            engines.append(remote_engine(dense_ckpt, [a, c], dtype="float32", specs=SPECS))
        assert servers[0].service.next.target == b
        assert generate(first, PROMPTS[1]) == want
        other_name = b.replace("127.0.0.1", "localhost")
        sharing = remote_engine(dense_ckpt, [a, other_name], dtype="float32", specs=SPECS)
        engines.append(sharing)
        assert servers[0].service.next.target == b  # (the same node: the link the first one uses stays)
        assert generate(sharing, PROMPTS[1]) == generate(first, PROMPTS[1]) == want


@pytest.mark.parametrize("same_id", [True, False], ids=["same-id", "new-id"])
def test_coordinators_sharing_nodes_both_come_back_after_a_node_restarts(dense_ckpt: Path, same_id: bool) -> None:
    """Two coordinators share a -> b; b restarts on its port (with its id, or a new one, as `mtpipe node`
    without --node-id): each forms its pipeline again, the link to b is the one both use, and a is well
    once both have (its link open again: no condition that would keep /health 503)."""
    with running(dense_ckpt, 2) as (servers, engines):
        a, b = (s.address for s in servers)
        engines += [remote_engine(dense_ckpt, [a, b], dtype="float32", specs=SPECS) for _ in range(2)]
        want = generate(engines[0], PROMPTS[2])
        old_id, port = servers[1].service.node_id, int(b.rsplit(":", 1)[1])
        servers[1].stop(0)
        deadline = time.monotonic() + 30  # (both see it go, before it is back)
        while not all(e.pipeline.reformer.down for e in engines):
            assert time.monotonic() < deadline, "a coordinator did not see the node go"
            time.sleep(0.05)
        servers[1] = NodeServer("127.0.0.1", port, model_dirs=[dense_ckpt],
                                node_id=old_id if same_id else None).start()
        assert all(e.pipeline.reformer.wait(30) for e in engines), [e.pipeline.reformer.down for e in engines]
        assert [generate(e, PROMPTS[2]) for e in engines] == [want, want]
        assert servers[0].service.next.peer_id == servers[1].service.node_id
        assert servers[0].service.conditions.current() is None


@pytest.mark.parametrize("build", [remote_engine, ring_engine], ids=["steps", "ring"])
def test_a_taken_over_coordinator_gives_the_nodes_up(dense_ckpt: Path, tmp_path: Path, build: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards that take a while to load (as real ones do). The first coordinator hears that it was taken
    over: its pipeline is down for good, without one attempt to form it again, its requests fail at once
    naming the node, and it does not take the nodes back once the second has gone. A copy of the model at
    another path is the same shard: its coordinator shares the nodes."""
    import asyncio
    import shutil

    from mtpipe.coordinator.pipeline.nodes import TakenOver
    from mtpipe.node import loads

    real = loads.load_stage

    async def slow(*args: object, **kw: object) -> object:
        await asyncio.sleep(1.0)
        return await real(*args, **kw)

    monkeypatch.setattr(loads, "load_stage", slow)
    servers = [NodeServer("127.0.0.1", 0, model_dirs=[dense_ckpt]).start() for _ in range(2)]
    addresses = [s.address for s in servers]
    engines: list[Any] = []
    try:
        want = generate(local_engine(dense_ckpt, dtype=mx.float32), PROMPTS[0])
        first = build(dense_ckpt, addresses, dtype="float32", specs=SPECS)
        engines.append(first)
        reformer = first.pipeline.reformer
        tried: list[BaseException | None] = []
        reform = reformer._reform

        def counted() -> None:  # the first one's attempts to form its pipeline again
            try:
                reform()
            except BaseException as e:
                tried.append(e)
                raise
            tried.append(None)

        reformer._reform = counted
        second = remote_engine(dense_ckpt, addresses, dtype="float32", specs=OTHER, take_over=True)
        engines.append(second)
        deadline = time.monotonic() + 10  # (told as the load began: before the second one's engine is built)
        while not reformer.given_up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reformer.given_up and isinstance(reformer.down, TakenOver), reformer.down
        assert "taken over by coordinator " + second.pipeline.client_id in str(reformer.down)
        assert tried == [] and not reformer.wait(10.0)
        deadline = time.monotonic() + 10  # (each node tells it was taken over: both are named)
        while len(Readiness(first, timeout=2.0).check()[1]["unready"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        ready, details = Readiness(first, timeout=2.0).check()  # what /health says: the nodes, and why
        assert not ready and sorted(d["address"] for d in details["unready"]) == sorted(addresses)
        assert "taken over" in details["unready"][0]["reason"] and "formed again" not in details["unready"][0]["reason"]
        reason = details["unready"][0]["reason"]
        assert reason.count(details["unready"][0]["address"]) == 1, reason  # the node named once
        start = time.monotonic()
        with pytest.raises((StageError, StageUnavailable), match="another coordinator's shard|taken over"):
            generate(first, PROMPTS[0])
        assert time.monotonic() - start < 10
        assert [(s.service.key.start, s.service.key.end) for s in servers] == [(0, 1), (1, 4)]
        assert generate(second, PROMPTS[0]) == want
        # (the taken-over one's refused frames are its own trouble: the nodes are well, and the second ready)
        assert [s.service.conditions.current() for s in servers] == [None, None]
        assert Readiness(second, timeout=2.0).check()[0]
        copy = shutil.copytree(dense_ckpt, tmp_path / "copy")
        sharing = remote_engine(copy, addresses, dtype="float32", specs=OTHER)
        engines.append(sharing)
        assert all(r.reused for r in sharing.pipeline.load_replies)
        assert generate(sharing, PROMPTS[0]) == generate(second, PROMPTS[0]) == want
        second.pipeline.close()
        sharing.pipeline.close()
        with pytest.raises(TakenOver, match="taken over"):  # the nodes are free now, but not for it
            reform()
        assert [(s.service.key.start, s.service.key.end) for s in servers] == [(0, 1), (1, 4)]
        assert tried == []
    finally:
        for e in engines:
            e.pipeline.close()
        for s in servers:
            s.stop(0)


def test_which_coordinators_a_node_serves() -> None:
    from mtpipe.node.coordinators import Coordinators

    c = Coordinators()
    assert c.admit_load("a", [], reused=False, take_over=False) == [] and c.clients == {"a"}
    assert c.admit_load("b", ["a"], reused=True, take_over=False) == [] and c.clients == {"a", "b"}  # shared
    assert c.admit_load("c", ["a", "b"], reused=False, take_over=False) is None and c.clients == {"a", "b"}
    assert c.admit_load("c", ["a", "b", "c"], reused=False, take_over=True) == ["a", "b"] and c.clients == {"c"}
    assert not c.admits("a") and c.admits("c") and c.admits("")  # (frames without an id: an older coordinator)
    assert c.displaced == {"a": "c", "b": "c"}
    # The displaced one, subscribed again, does not count as holding the node: only its own Loads are refused,
    # even once the node is free again, unless it takes the node over.
    assert c.admit_load("a", ["a", "c"], reused=False, take_over=False) is None
    assert c.admit_load("d", ["a"], reused=False, take_over=False) == [] and c.clients == {"d"}
    assert c.admit_load("a", [], reused=False, take_over=False) is None
    assert c.admit_load("a", ["d"], reused=False, take_over=True) == ["d"] and c.clients == {"a"}
    assert c.displaced == {"b": "c", "d": "a"}
    assert c.admit_load("d", ["a"], reused=True, take_over=True) == ["a"] and c.clients == {"d"}
    # A coordinator that does not say who it is opens the node to all, and sharing keeps it open.
    assert c.admit_load("", ["d"], reused=True, take_over=False) == [] and c.clients == set()
    assert c.admit_load("e", ["d"], reused=True, take_over=False) == [] and c.clients == set() and c.admits("x")
    # Links: another's live link to another node stays; one to the node asked for (by id) is kept as it is.
    from mtpipe.node.coordinators import relink

    assert relink(True, "h:1", "n1", "h:2", "n2") == "refuse"
    assert relink(True, "h:1", "n1", "localhost:1", "n1") == "keep"
    assert relink(True, "h:1", "n9", "h:1", "n9") == "keep" and relink(True, "h:1", "n1", "h:1", "") == "keep"
    assert relink(True, "h:1", None, "h:2", "n2") == "set"  # (it leads nowhere now: a restart, a node gone)
    assert relink(False, "h:1", "n1", "h:2", "n2") == relink(True, "", None, "h:2", "n2") == "set"


def test_a_node_without_a_shard_refuses_no_one() -> None:
    """Coordinators subscribe before they load: on a node that holds no shard (new, or started again),
    the others subscribed hold nothing of it, so none is refused; the first shard loaded is what the
    others then share or are refused."""
    from mtpipe.node.coordinators import Coordinators

    c = Coordinators()
    assert c.admit_load("a", ["a", "b"], reused=False, take_over=False, loaded=False) == [] and c.clients == {"a"}
    assert c.admit_load("b", ["a", "b"], reused=True, take_over=False) == [] and c.clients == {"a", "b"}
    assert c.refuses("x", ["a", "b", "x"], reused=False, take_over=False)  # another shard, while theirs is held
    c = Coordinators()
    c.displaced["z"] = "a"
    assert c.refuses("z", [], reused=False, take_over=False, loaded=False)  # taken over stays taken over


STOPPED_CLIENT = """
import os, signal, sys
from mtpipe.node.wire import make_channel
from mtpipe.proto import mtpipe_pb2 as pb, mtpipe_pb2_grpc as pb_grpc
stream = pb_grpc.NodeStub(make_channel(sys.argv[1])).Subscribe(pb.SubscribeRequest(client_id="asleep"))
next(stream)
print("subscribed", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_coordinator_that_stops_leaves_the_node() -> None:
    """A coordinator stopped whole (a laptop asleep) answers no HTTP/2 ping: the node cuts it off, and
    its subscription ends, within seconds, rather than hold the node (its shard) for ever."""
    import subprocess
    import sys

    server = NodeServer("127.0.0.1", 0).start()
    try:
        proc = subprocess.Popen([sys.executable, "-c", STOPPED_CLIENT, server.address], stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "subscribed"
            deadline = time.monotonic() + 10
            while "asleep" in server.service._subs:
                assert time.monotonic() < deadline, "the stopped coordinator still holds its subscription"
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait()
    finally:
        server.stop(0)


def test_terms_order_coordinators() -> None:
    """The newer coordinator: the higher term, on one term the lower node id; no term never outranks."""
    from mtpipe.node.coordinators import Claim, Coordinators, next_term, outranks

    a1, b2, c2 = Claim(1, "node-a"), Claim(2, "node-b"), Claim(2, "node-c")
    assert outranks(b2, a1) and not outranks(a1, b2)
    assert outranks(b2, c2) and not outranks(c2, b2) and not outranks(b2, b2)
    assert not outranks(Claim(), a1) and not outranks(a1, Claim())
    assert next_term([]) == 1 and next_term([0, 2, 1]) == 3
    node = Coordinators()
    assert not node.stale(a1) and node.see(a1) and node.claim == a1
    assert node.supersedes(b2) and node.see(b2) and node.stale(a1) and node.stale(c2)
    assert not node.see(a1) and node.claim == b2  # (an older claim is never kept)
    assert not node.stale(Claim()) and not node.supersedes(Claim())  # coordinators without a term: as before


def test_a_coordinator_of_an_older_term_is_refused_and_a_newer_one_takes_over(dense_ckpt: Path) -> None:
    """A coordinator elected after another (a higher term) takes the nodes over, even where they hold the same
    shards; the older one's Loads are then refused (ABORTED: it steps down, its pipeline given up at once),
    and the nodes' Pings say which coordinator's term they serve."""
    from mtpipe.coordinator.pipeline.nodes import TakenOver
    from mtpipe.node.coordinators import Claim
    from mtpipe.node.wire import make_channel
    from mtpipe.proto import mtpipe_pb2 as pb
    from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

    def claims_at(addresses: list[str]) -> list[Claim]:
        out = []
        for address in addresses:
            with make_channel(address) as channel:
                reply = pb_grpc.NodeStub(channel).Ping(pb.PingRequest(), timeout=5)
            out.append(Claim(reply.term, reply.term_holder))
        return out

    with running(dense_ckpt, 2) as (servers, engines):
        addresses = [s.address for s in servers]
        want = generate(local_engine(dense_ckpt, dtype=mx.float32), PROMPTS[0])
        old = remote_engine(dense_ckpt, addresses, dtype="float32", specs=SPECS, claim=Claim(1, "node-a"))
        engines.append(old)
        assert generate(old, PROMPTS[0]) == want
        assert claims_at(addresses) == [Claim(1, "node-a")] * 2
        new = remote_engine(dense_ckpt, addresses, dtype="float32", specs=SPECS, claim=Claim(2, "node-b"))
        engines.append(new)
        assert generate(new, PROMPTS[0]) == want
        assert claims_at(addresses) == [Claim(2, "node-b")] * 2
        deadline = time.monotonic() + 10
        while not old.pipeline.reformer.given_up and time.monotonic() < deadline:
            time.sleep(0.05)
        reformer = old.pipeline.reformer
        assert reformer.given_up and "term 1 of this coordinator is over" in str(reformer.down)
        with pytest.raises((StageUnavailable, StageError)):
            generate(old, PROMPTS[0])
        with pytest.raises(TakenOver, match="serves coordinator node-b of term 2"):
            engines.append(remote_engine(dense_ckpt, addresses, dtype="float32", specs=SPECS,
                                         claim=Claim(1, "node-a")))
        assert generate(new, PROMPTS[0]) == want  # (the refused Load changed nothing)


def test_a_newer_term_leaves_a_coordinator_of_none_sharing_the_shards(dense_ckpt: Path) -> None:
    """`serve --nodes` (term 0) sharing the nodes' shards with a launched coordinator behaves as before
    when a newer launched coordinator loads the same shards: it shares them too, its requests go on; the
    coordinator of the older term alone is taken over."""
    from mtpipe.node.coordinators import Claim

    with running(dense_ckpt, 2) as (servers, engines):
        addresses = [s.address for s in servers]
        want = generate(local_engine(dense_ckpt, dtype=mx.float32), PROMPTS[0])
        plain = remote_engine(dense_ckpt, addresses, dtype="float32", specs=SPECS)
        engines.append(plain)
        old = remote_engine(dense_ckpt, addresses, dtype="float32", specs=SPECS, claim=Claim(1, "node-a"))
        engines.append(old)
        new = remote_engine(dense_ckpt, addresses, dtype="float32", specs=SPECS, claim=Claim(2, "node-b"))
        engines.append(new)
        assert generate(new, PROMPTS[0]) == want
        with pytest.raises((StageUnavailable, StageError)):
            generate(old, PROMPTS[0])
        assert generate(plain, PROMPTS[0]) == want
