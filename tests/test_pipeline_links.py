"""Where each node sends its results: the coordinator's addresses of the nodes are not always theirs.

The coordinator reaches its own node at 127.0.0.1, which on the last node's machine is the last node
itself; a Thunderbolt hop between two other nodes is on a subnet the coordinator is not on. The
pipeline takes the addresses cluster formation found (coordinator/cluster/formation.py), so that the
engine it builds runs ring groups, and keeps them for when it forms again after a fault.
(tests/test_discovery_netns.py forms such a cluster over network namespaces.)
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from helpers import PROMPTS, node_servers

from mtpipe.coordinator.engine.build import local_engine, ring_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.pipeline.local import even_split
from mtpipe.models.config import load_config


def test_the_last_node_links_back_where_the_first_node_answers_and_formed_again_keeps_the_links(
        dense_ckpt: Path) -> None:
    with node_servers(3) as servers:
        first, middle, last = (s.address for s in servers)
        # The first candidate is the last node itself (as 127.0.0.1 is there); the next one is the first node.
        first_by_name = f"localhost:{servers[0].port}"
        engine = ring_engine(dense_ckpt, [first, middle, last], dtype="float32", ring_targets=[last, first_by_name])
        try:
            assert engine.batching == "ring"
            pipeline = engine.pipeline
            assert pipeline.rings and pipeline.ring_targets[0] == first_by_name
            assert [h.ring for h in pipeline.health()] == ["", "", first_by_name]
            prompt = engine.tokenizer.encode(PROMPTS[0])
            want = local_engine(dense_ckpt, dtype=mx.float32).complete(GenerationRequest(prompt, max_tokens=12))
            assert engine.complete(GenerationRequest(prompt, max_tokens=12)).tokens == want.tokens

            # Hops confirmed after the load (formation's round trips) are what a load connects from then on.
            kept = [f"localhost:{servers[1].port}", f"localhost:{servers[2].port}"]
            pipeline.keep_next_targets(kept)
            specs = even_split(load_config(dense_ckpt).num_layers, 3)
            pipeline.load(dense_ckpt, specs, mtp=True, dtype="float32")  # as the pipeline formed again does
            assert [h.next for h in pipeline.health()] == [*kept, ""]
            assert pipeline.rings and [h.ring for h in pipeline.health()] == ["", "", first_by_name]
            assert engine.complete(GenerationRequest(prompt, max_tokens=12)).tokens == want.tokens
        finally:
            engine.close()
