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
from mtpipe.node.protocol import StageUnavailable
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
        with pytest.raises(StageUnavailable):
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
