"""Kept prompt prefixes over nodes (node/kept.py, coordinator/engine/kept.py): a prompt that starts with
one prefills only the rest, with the tokens (and drafts) of a whole prefill; the nodes hold exactly
what the engine keeps, within its budget; a lost pipeline forgets them; a bad key is refused without
touching a node; a client that goes leaves none behind."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import PROMPTS, node_servers

from mtpipe.coordinator.cluster.health import probe_node
from mtpipe.coordinator.engine.build import ring_engine
from mtpipe.coordinator.engine.kept import KeptPrefixes
from mtpipe.coordinator.engine.request import GenerationRequest, GenerationResult
from mtpipe.coordinator.engine.scheduler import ModelDims
from mtpipe.coordinator.pipeline.nodes import NodeFailure, RemoteStageError
from mtpipe.node.protocol import SamplingParams, StepKind, StepRequest

TOKENS = 16


def run(engine: Any, prompt: list[int], depth: int = 2, auto: bool = False, **kw: Any) -> GenerationResult:
    return engine.complete(GenerationRequest(prompt, max_tokens=TOKENS, mtp_depth=depth, mtp_auto=auto, **kw))


def held(servers: list[Any]) -> list[int]:
    return [len(s.service.worker.prefixes) for s in servers]


def settled(servers: list[Any], want: list[int], timeout: float = 5.0) -> list[int]:
    """The nodes' kept prefix counts once the drops sent to them arrived (or as they are after `timeout`)."""
    deadline = time.monotonic() + timeout
    while (now := held(servers)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("model", "n"), [("dense", 2), ("moe", 3)])
def test_a_prompt_going_on_from_kept_prefixes_on_nodes_gives_the_tokens_of_a_whole_prefill(
        dense_ckpt: Path, moe_ckpt: Path, model: str, n: int) -> None:
    path = dense_ckpt if model == "dense" else moe_ckpt
    with node_servers(2 * n) as servers:
        cached = ring_engine(path, [s.address for s in servers[:n]], dtype="float32")
        whole = ring_engine(path, [s.address for s in servers[n:]], dtype="float32", prefix_cache=0)
        try:
            tok = cached.tokenizer
            first = list(tok.encode(PROMPTS[0]))
            reply = run(cached, first)
            assert reply.stats.cached_tokens == 0 and reply.tokens == run(whole, first).tokens
            turn = first + reply.tokens + list(tok.encode(PROMPTS[1]))  # a chat's next turn
            cases = [(2, False, {}), (0, False, {}), (3, True, {}),
                     (2, False, {"params": SamplingParams(temperature=0.9, top_p=0.95, seed=7)})]
            for i, (depth, auto, kw) in enumerate(cases):
                got, want = run(cached, turn, depth, auto, **kw), run(whole, turn, depth, auto, **kw)
                # the first goes on from the first prompt's prefix; the next ones from the turn's own
                assert got.stats.cached_tokens == (len(first) - 1 if i == 0 else len(turn) - 1)
                assert got.tokens == want.tokens, (depth, auto)
                if depth == 2 and not kw:  # the MTP head went on from the prefix too: the same drafts
                    assert (got.stats.drafted, got.stats.accepted) == (want.stats.drafted, want.stats.accepted)
            assert cached.describe()["ring"]["kept_prefixes"] == 2
            assert held(servers) == [2] * n + [0] * n
        finally:
            cached.close()
            whole.close()


def test_nodes_hold_what_the_engine_keeps_within_its_budget(dense_ckpt: Path) -> None:
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            prompts = [list(engine.tokenizer.encode(PROMPTS[i])) for i in (2, 3, 4)]
            engine.kept.budget = int(2.5 * max(engine.kept.nbytes(len(p) - 1) for p in prompts))
            for p in prompts:
                run(engine, p)
            ring = engine.describe()["ring"]
            assert ring["kept_prefixes"] == 2 and ring["kept_prefix_bytes"] <= engine.kept.budget
            assert settled(servers, [2, 2]) == [2, 2]
            rows = [probe_node(s.address, None) for s in servers]  # (`mtpipe health --json`)
            assert [r["kept_prefixes"] for r in rows] == [2, 2] and all(r["kept_prefix_bytes"] > 0 for r in rows)
            assert run(engine, prompts[0]).stats.cached_tokens == 0  # the least recently used went
            assert run(engine, prompts[2]).stats.cached_tokens == len(prompts[2]) - 1
        finally:
            engine.close()


def test_a_lost_pipeline_forgets_its_kept_prefixes(dense_ckpt: Path) -> None:
    """Formed again, the nodes may have restarted and kept nothing: the engine forgets what it kept, and
    each node, loaded again, drops what it held of this client's."""
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            prompt = list(engine.tokenizer.encode(PROMPTS[5]))
            want = run(engine, prompt).tokens
            assert held(servers) == [1, 1]
            reformer = engine.pipeline.reformer
            engine.pipeline._lost(NodeFailure(servers[1].address, "lost for the test"))
            assert reformer.wait(30) and reformer.down is None
            assert held(servers) == [0, 0]
            again = run(engine, prompt)
            assert again.stats.cached_tokens == 0 and again.tokens == want
        finally:
            engine.close()


def test_a_bad_prefix_is_refused_without_touching_a_node(dense_ckpt: Path) -> None:
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            tokens = list(engine.tokenizer.encode(PROMPTS[6]))
            bad = [StepRequest("unknown-prefix", 0, StepKind.PREFILL, tokens, final=True, prefix="nope"),
                   StepRequest("keep-at-start", 0, StepKind.PREFILL, tokens, final=True, keep="k"),
                   StepRequest("keep-midway", 0, StepKind.PREFILL, tokens, keep="k")]
            for req, says in zip(bad, ("no kept prompt prefix", "no prefix before it", "last step keeps")):
                with pytest.raises(RemoteStageError, match=says):
                    engine.pipeline.steps([req])
            assert [len(s.service.worker.sequences) for s in servers] == [0, 0] and held(servers) == [0, 0]
            # another client's key is not this one's, whatever it is called
            run(engine, tokens)
            key = next(iter(servers[0].service.worker.prefixes)).split("/", 1)[1]
            other = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32", take_over=True)
            try:
                with pytest.raises(RemoteStageError, match="no kept prompt prefix"):
                    other.pipeline.steps([StepRequest("thief", 0, StepKind.PREFILL, tokens[-1:], final=True,
                                                      prefix=key)])
            finally:
                other.close()
        finally:
            engine.close()


def test_a_client_that_goes_leaves_no_kept_prefix(dense_ckpt: Path) -> None:
    with node_servers(2) as servers:
        for s in servers:
            s.service.orphan_grace = 0.2
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        run(engine, list(engine.tokenizer.encode(PROMPTS[7])))
        assert held(servers) == [1, 1]
        engine.close()
        assert settled(servers, [0, 0]) == [0, 0]


def test_a_node_that_forgot_a_prefix_costs_a_whole_prefill_not_the_request(dense_ckpt: Path) -> None:
    """A prefix the engine counts on and a node no longer holds (it kept no more, or lost it): the node
    refuses the step, and the prompt goes in again whole, with the same tokens."""
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            prompt = list(engine.tokenizer.encode(PROMPTS[8]))
            want = run(engine, prompt).tokens
            # behind the engine's back, on the node's loop (whose thread owns its arrays, freeing included)
            worker = servers[1].service.worker
            done = concurrent.futures.Future()
            servers[1]._loop.call_soon_threadsafe(lambda: done.set_result(worker.drop_prefixes(list(worker.prefixes))))
            done.result(timeout=10)
            assert held(servers) == [1, 0]
            again = run(engine, prompt)
            assert again.tokens == want and again.stats.cached_tokens == 0
            assert run(engine, prompt).stats.cached_tokens == len(prompt) - 1  # kept anew on the way
        finally:
            engine.close()


def test_a_full_node_keeps_nothing_more_and_the_prompt_goes_in_whole(dense_ckpt: Path) -> None:
    """A node keeps prefixes within its own share of memory, whatever the engine reckons: past it, it
    keeps nothing more, and a prompt that counted on one goes in whole (each time: the others keep it
    again as it goes in)."""
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            servers[1].service.worker.max_prefix_bytes = 0
            prompt = list(engine.tokenizer.encode(PROMPTS[9]))
            want = run(engine, prompt).tokens
            assert held(servers) == [1, 0] and engine.describe()["ring"]["kept_prefixes"] == 1
            for _ in range(2):
                again = run(engine, prompt)
                assert again.tokens == want and again.stats.cached_tokens == 0
                assert held(servers) == [1, 0]  # (the one it counted on dropped, the new one kept)
        finally:
            engine.close()


def test_a_prefix_a_prompt_is_about_to_start_from_is_never_dropped() -> None:
    """Pinned from the choice to the prompt's going in: neither the same prompt kept again (with the MTP
    head's part) nor the count limit drops it; once unpinned, the least recently used goes first."""
    dropped: list[str] = []
    kept = KeptPrefixes(ModelDims(kv_bytes_per_token=10, state_bytes=100), budget=10**6, drop=dropped.append, most=2)
    prompt = [1, 2, 3, 4, 5]
    kept.kept("a", prompt, drafts=False, epoch=0.0)
    hit = kept.reuse(prompt + [6], drafts=False, epoch=0.0)
    assert hit is not None and hit.key == "a"
    kept.kept("b", prompt, drafts=True, epoch=0.0)
    kept.kept("c", [7, 8, 9], drafts=True, epoch=0.0)
    assert "a" not in dropped and dropped == ["b"]  # over the count: the least recently used that is free
    kept.done("a")
    kept.kept("d", [9, 9, 9], drafts=True, epoch=0.0)
    assert dropped == ["b", "a"]
    assert kept.reuse(prompt + [6], drafts=False, epoch=1.0) is None  # the pipeline was lost: all forgotten
