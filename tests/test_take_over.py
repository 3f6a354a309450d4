"""Coordinators may share the shards nodes hold; another's Load of other shards is refused while the first
is connected, unless it takes the nodes over, which ends the first one's requests there (they fail, none
hangs)."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import PROMPTS, TINY_LAYERS

from mtpipe.coordinator.engine.build import local_engine, remote_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.pipeline.nodes import NodeInUse
from mtpipe.models.shard import ShardSpec
from mtpipe.node.protocol import StageError, StageUnavailable
from mtpipe.node.server import NodeServer

SPECS = [ShardSpec(0, 2, TINY_LAYERS), ShardSpec(2, 4, TINY_LAYERS)]
OTHER = [ShardSpec(0, 1, TINY_LAYERS), ShardSpec(1, 4, TINY_LAYERS)]


def generate(engine: Engine, text: str) -> list[int]:
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
        first.pipeline.close()  # (else it would form its pipeline again once the nodes are free)
        second.pipeline.close()
        third = engine()  # the nodes are free for other shards once their coordinator has closed
        assert generate(third, PROMPTS[0]) == want
    finally:
        for e in engines:
            e.pipeline.close()
        for s in servers:
            s.stop(0)


def test_a_taken_over_coordinator_does_not_take_the_nodes_back(dense_ckpt: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards that take a while to load (as real ones do): the first coordinator, whose pipeline is down once
    taken over, keeps trying to form it again meanwhile, and never gets the nodes back while the second is
    connected. A copy of the model at another path is the same shard: its coordinator shares the nodes."""
    import asyncio
    import shutil

    from mtpipe.node import service

    real = service.load_stage

    async def slow(*args: object, **kw: object) -> object:
        await asyncio.sleep(1.0)
        return await real(*args, **kw)

    monkeypatch.setattr(service, "load_stage", slow)
    servers = [NodeServer("127.0.0.1", 0, model_dirs=[dense_ckpt]).start() for _ in range(2)]
    addresses = [s.address for s in servers]
    engines: list[Engine] = []
    try:
        want = generate(local_engine(dense_ckpt, dtype=mx.float32), PROMPTS[0])
        first = remote_engine(dense_ckpt, addresses, dtype="float32", specs=SPECS)
        engines.append(first)
        tried: list[BaseException | None] = []
        reform = first.pipeline.reformer._reform

        def counted() -> None:  # the first one's attempts to form its pipeline again
            try:
                reform()
            except BaseException as e:
                tried.append(e)
                raise
            tried.append(None)

        first.pipeline.reformer._reform = counted
        second = remote_engine(dense_ckpt, addresses, dtype="float32", specs=OTHER, take_over=True)
        engines.append(second)
        deadline = time.monotonic() + 30
        while len(tried) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(tried) >= 2 and all(isinstance(e, NodeInUse) for e in tried), tried  # each one refused
        assert [(s.service.key.start, s.service.key.end) for s in servers] == [(0, 1), (1, 4)]
        assert generate(second, PROMPTS[0]) == want
        copy = shutil.copytree(dense_ckpt, tmp_path / "copy")
        sharing = remote_engine(copy, addresses, dtype="float32", specs=OTHER)
        engines.append(sharing)
        assert all(r.reused for r in sharing.pipeline.load_replies)
        assert generate(sharing, PROMPTS[0]) == generate(second, PROMPTS[0]) == want
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
    # The displaced one, subscribed again, does not count as holding the node: only its own Loads are refused.
    assert c.admit_load("a", ["a", "c"], reused=False, take_over=False) is None
    assert c.admit_load("d", ["a"], reused=False, take_over=False) == [] and c.clients == {"d"}
    # A coordinator that does not say who it is opens the node to all, and sharing keeps it open.
    assert c.admit_load("", ["d"], reused=True, take_over=False) == [] and c.clients == set()
    assert c.admit_load("e", ["d"], reused=True, take_over=False) == [] and c.clients == set() and c.admits("x")
