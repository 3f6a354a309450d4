"""Kept prompt prefixes over nodes (node/kept.py, coordinator/engine/kept.py): a prompt that starts with
one prefills only the rest, with the tokens (and drafts) of a whole prefill; the nodes hold exactly
what the engine keeps, within its budget; a lost pipeline forgets them; a bad key is refused without
touching a node; a client that goes leaves none behind. Each request keeps two: its prompt's prefix
and its state as it ended (its prompt and reply but the reply's last token)."""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Iterator
from contextlib import contextmanager
import threading
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
from mtpipe.coordinator.engine.sinks import END
from mtpipe.coordinator.pipeline.nodes import NodeFailure, RemoteStageError
from mtpipe.node.protocol import SamplingParams, StepKind, StepRequest

TOKENS = 16


def run(engine: Any, prompt: list[int], depth: int = 2, auto: bool = False, **kw: Any) -> GenerationResult:
    return engine.complete(GenerationRequest(prompt, max_tokens=TOKENS, mtp_depth=depth, mtp_auto=auto, **kw))


def held(servers: list[Any]) -> list[int]:
    return [len(s.service.worker.prefixes) for s in servers]


def settled(servers: list[Any], want: list[int], timeout: float = 5.0) -> list[int]:
    """The nodes' kept prefix counts once the frames sent to them arrived (or as they are after `timeout`):
    drops, and the round that carries a request's end to the nodes before the last."""
    deadline = time.monotonic() + timeout
    while (now := held(servers)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


@contextmanager
def cached_and_whole(path: Path, n: int) -> Iterator[tuple[list[Any], Any, Any]]:
    """Two rings of `n` nodes: one engine keeping prefixes and ends, one prefilling every prompt whole."""
    with node_servers(2 * n) as servers:
        cached = ring_engine(path, [s.address for s in servers[:n]], dtype="float32")
        whole = ring_engine(path, [s.address for s in servers[n:]], dtype="float32", prefix_cache=0)
        try:
            yield servers, cached, whole
        finally:
            cached.close()
            whole.close()


def engine_kept(engine: Any, want: int, timeout: float = 5.0) -> int:
    """The prefixes the engine counts as kept once the last node's word on the ends came (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while (now := engine.describe()["ring"]["kept_prefixes"]) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return now


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("model", "n"), [("dense", 2), ("moe", 3)])
def test_a_prompt_going_on_from_kept_prefixes_on_nodes_gives_the_tokens_of_a_whole_prefill(
        dense_ckpt: Path, moe_ckpt: Path, model: str, n: int) -> None:
    path = dense_ckpt if model == "dense" else moe_ckpt
    with cached_and_whole(path, n) as (servers, cached, whole):
        tok = cached.tokenizer
        first = list(tok.encode(PROMPTS[0]))
        reply = run(cached, first)
        assert reply.stats.cached_tokens == 0 and reply.tokens == run(whole, first).tokens
        assert engine_kept(cached, 2) == 2  # (its end: once the last node said every node kept it)
        turn = first + reply.tokens + list(tok.encode(PROMPTS[1]))  # a chat's next turn
        cases = [(2, False, {}), (0, False, {}), (3, True, {}),
                 (2, False, {"params": SamplingParams(temperature=0.9, top_p=0.95, seed=7)})]
        for i, (depth, auto, kw) in enumerate(cases):
            got, want = run(cached, turn, depth, auto, **kw), run(whole, turn, depth, auto, **kw)
            # the first goes on from where the first reply ended; the next ones from the turn's prefix
            assert got.stats.cached_tokens == (len(first) + len(reply.tokens) - 1 if i == 0 else len(turn) - 1)
            assert got.tokens == want.tokens, (depth, auto)
            if depth == 2 and not kw:  # the MTP head went on from the prefix too: the same drafts
                assert (got.stats.drafted, got.stats.accepted) == (want.stats.drafted, want.stats.accepted)
        # the first prompt's prefix and end, the turn's prefix, its greedy replies' end (the same
        # tokens at every depth: one) and its sampled reply's end
        assert engine_kept(cached, 5) == 5
        assert settled(servers, [5] * n + [0] * n) == [5] * n + [0] * n


def test_nodes_hold_what_the_engine_keeps_within_its_budget(dense_ckpt: Path) -> None:
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            prompts = [list(engine.tokenizer.encode(PROMPTS[i])) for i in (2, 3, 4)]
            last = len(prompts[-1])  # room for the last request's prefix and end, no more
            engine.kept.budget = engine.kept.nbytes(last - 1) + engine.kept.nbytes(last + TOKENS - 1)
            for p in prompts:
                assert len(run(engine, p).tokens) == TOKENS
            assert engine_kept(engine, 2) == 2
            assert engine.describe()["ring"]["kept_prefix_bytes"] <= engine.kept.budget
            assert settled(servers, [2, 2]) == [2, 2]
            rows = [probe_node(s.address, None) for s in servers]  # (`mtpipe health --json`)
            assert [r["kept_prefixes"] for r in rows] == [2, 2] and all(r["kept_prefix_bytes"] > 0 for r in rows)
            assert run(engine, prompts[2]).stats.cached_tokens == len(prompts[2]) - 1
            assert run(engine, prompts[0]).stats.cached_tokens == 0  # the least recently used went
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
            assert settled(servers, [2, 2]) == [2, 2]
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
                   StepRequest("keep-midway", 0, StepKind.PREFILL, tokens, keep="k"),
                   StepRequest("end-alone", 0, StepKind.PREFILL, tokens, final=True, keep_end="e")]
            for req, says in zip(bad, ("no kept prompt prefix", "no prefix before it", "last step keeps",
                                       "meant for a group keeps its end")):
                with pytest.raises(RemoteStageError, match=says):
                    engine.pipeline.steps([req])
            assert [len(s.service.worker.sequences) for s in servers] == [0, 0] and held(servers) == [0, 0]
            # another client's key is not this one's, whatever it is called
            run(engine, tokens)
            key = next(iter(servers[0].service.worker.prefixes)).split("/", 1)[1]
            with pytest.raises(RemoteStageError, match="kept already"):  # (it would hold other tokens)
                engine.pipeline.steps([StepRequest("again", 0, StepKind.PREFILL, tokens[-1:], final=True, prefix=key,
                                                   keep=key)])
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
        assert settled(servers, [2, 2]) == [2, 2]
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
            assert settled(servers, [2, 2]) == [2, 2]
            # behind the engine's back, on the node's loop (whose thread owns its arrays, freeing included)
            worker = servers[1].service.worker
            done = concurrent.futures.Future()
            servers[1]._loop.call_soon_threadsafe(lambda: done.set_result(worker.drop_prefixes(list(worker.prefixes))))
            done.result(timeout=10)
            assert held(servers) == [2, 0]
            again = run(engine, prompt)
            assert again.tokens == want and again.stats.cached_tokens == 0
            assert run(engine, prompt).stats.cached_tokens == len(prompt) - 1  # kept anew on the way
        finally:
            engine.close()


@pytest.mark.parametrize("full", [0, 1])
def test_a_full_node_keeps_nothing_more_and_the_engine_counts_on_none_of_it(dense_ckpt: Path, full: int) -> None:
    """A node keeps prefixes within its own share of memory, whatever the engine reckons: past it, it
    keeps nothing more, the nodes after it keep nothing either, and the last node's word makes the
    engine count on none of it (the nodes before drop theirs). The prompt goes in whole each time,
    never refused on the way."""
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            servers[full].service.worker.max_prefix_bytes = 0
            refused: list[str] = []
            for s in servers:
                inner = s.service._fail
                s.service._fail = lambda frame, code, message, inner=inner: (refused.append(message),
                                                                            inner(frame, code, message))
            prompt = list(engine.tokenizer.encode(PROMPTS[9]))
            want = run(engine, prompt).tokens
            assert settled(servers, [0, 0]) == [0, 0] and engine_kept(engine, 0) == 0
            for _ in range(2):
                again = run(engine, prompt)
                assert again.tokens == want and again.stats.cached_tokens == 0
            assert settled(servers, [0, 0]) == [0, 0] and refused == []
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


def test_a_prefix_kept_without_the_mtp_part_never_replaces_one_with_it() -> None:
    """Two prefills of one prompt at once, one drafting and one not, both asked to keep it: whichever
    finishes second, the kept prefix is the one with the MTP head's part (a drafting prompt reuses it),
    and the other is dropped on the nodes."""
    for order in (("A", "B"), ("B", "A")):
        dropped: list[str] = []
        kept = KeptPrefixes(ModelDims(kv_bytes_per_token=10, state_bytes=100), budget=10**6, drop=dropped.append)
        prompt = list(range(50))
        drafts = {"A": True, "B": False}
        assert [kept.keep_as(k, prompt, drafts[k], 0) for k in "AB"] == ["A", "B"]  # (neither kept yet)
        for key in order:
            kept.kept(key, prompt, drafts[key], 0.0)
        assert dropped == ["B"]
        hit = kept.reuse(prompt + [99], drafts=True, epoch=0.0)
        assert hit is not None and hit.key == "A"


def wait_for_end(engine: Any, fed: list[int], drafts: bool) -> None:
    """Until the engine counts a request's end (`fed` but the last token) as kept: the last node's word
    that every node kept it comes a round after the request's last tokens (a prompt waits for it so)."""
    hit = engine.kept.reuse(fed, drafts, engine.pipeline.reformer.down_at, wait=5.0)
    if hit is not None:
        engine.kept.done(hit.key)


def on_loop(server: Any, fn: Any) -> Any:
    """`fn()` on a node's loop thread, whose MLX stream holds its arrays."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except Exception as e:  # noqa: BLE001
            done.set_exception(e)

    server._loop.call_soon_threadsafe(call)
    return done.result(timeout=30)


@pytest.mark.timeout(120)
def test_what_nodes_keep_as_a_request_ends_is_what_a_prefill_of_its_tokens_leaves(dense_ckpt: Path) -> None:
    """On every node, a request's state kept as it ended (its prompt and reply but the last token)
    equals a prompt prefilled whole to the same point: attention entries, GatedDeltaNet states, and on
    the last node the MTP head's entries and pending hidden, to 1e-5. At `auto`, whose rounds without
    drafts hold pairs back for the MTP head's entries (the form itself is tests/test_prefix_cache.py's
    at fixed depths too)."""
    import numpy as np

    depth, auto = 3, True
    with node_servers(4) as servers:
        ended = ring_engine(dense_ckpt, [s.address for s in servers[:2]], dtype="float32")
        whole = ring_engine(dense_ckpt, [s.address for s in servers[2:]], dtype="float32")
        try:
            prompt = list(ended.tokenizer.encode(PROMPTS[10]))
            reply = run(ended, prompt, depth, auto).tokens
            tokens = prompt + reply[:-1]
            assert engine_kept(ended, 2) == 2 and settled(servers[:2], [2, 2]) == [2, 2]
            run(whole, tokens + reply[-1:], depth, auto)  # its prompt's prefix: `tokens`

            def arrays(server: Any, end: bool) -> tuple[dict[str, Any], list[np.ndarray]]:
                prefixes = server.service.worker.prefixes
                (p,) = [v for k, v in prefixes.items() if k.endswith("/end") == end and v.length == len(tokens)]
                meta = {"length": p.length, "mtp_len": p.mtp_len, "drafts": p.drafts, "recent": p.recent[-20:]}
                return meta, [np.array(a) for a in p.arrays()]

            for i, (a_node, b_node) in enumerate(zip(servers[:2], servers[2:])):
                (meta_a, a), (meta_b, b) = on_loop(a_node, lambda: arrays(a_node, True)), on_loop(
                    b_node, lambda: arrays(b_node, False))
                assert meta_a == meta_b and meta_a["length"] == len(tokens)
                assert meta_a["drafts"] == (i == 1) and meta_a["mtp_len"] == (len(tokens) - 1 if i == 1 else 0)
                assert [x.shape for x in a] == [y.shape for y in b]
                assert max(float(np.abs(x - y).max()) for x, y in zip(a, b)) <= 1e-5
        finally:
            ended.close()
            whole.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("model", "n"), [("dense", 2), ("moe", 3)])
def test_a_next_turn_over_nodes_goes_on_from_where_the_reply_ended(dense_ckpt: Path, moe_ckpt: Path, model: str,
                                                                   n: int) -> None:
    """A chat's next turn prefills only its new message, from the state the nodes kept as the reply
    ended, and gives the tokens of a whole prefill (and, at a fixed depth, its drafts): greedy at depths
    0-3 and auto, seeded top-p, a repetition penalty (MoE, the same code past the MLP: some of them)."""
    path = dense_ckpt if model == "dense" else moe_ckpt
    with cached_and_whole(path, n) as (servers, cached, whole):
        tok = cached.tokenizer
        cases = [(0, False, {}), (1, False, {}), (2, False, {}), (3, False, {}), (3, True, {}),
                 (2, False, {"params": SamplingParams(temperature=0.9, top_p=0.95, seed=3)}),
                 (2, False, {"params": SamplingParams(repetition_penalty=1.3)})]
        for i, (depth, auto, kw) in enumerate(cases if model == "dense" else cases[3:6]):
            first = list(tok.encode(PROMPTS[i]))
            reply = run(cached, first, depth, auto, **kw)  # (the turn waits for the word on its end)
            turn = first + reply.tokens + list(tok.encode(PROMPTS[i + 1]))
            got, want = run(cached, turn, depth, auto, **kw), run(whole, turn, depth, auto, **kw)
            assert got.stats.cached_tokens == len(first) + len(reply.tokens) - 1, (depth, auto, kw)
            assert got.tokens == want.tokens, (depth, auto, kw)
            if not auto:
                assert (got.stats.drafted, got.stats.accepted) == (want.stats.drafted, want.stats.accepted)


def test_a_request_that_does_not_end_keeps_no_end(dense_ckpt: Path) -> None:
    """A request cancelled while it decodes keeps only its prompt's prefix: no node keeps its end."""
    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            items: queue.SimpleQueue = queue.SimpleQueue()
            handle = engine.open(GenerationRequest(list(engine.tokenizer.encode(PROMPTS[11])), max_tokens=400,
                                                   mtp_depth=2), items.put)
            assert not isinstance(items.get(timeout=30), BaseException)
            handle.cancel()
            while items.get(timeout=30) is not END:
                pass
            through_every_node(engine, PROMPTS[12])  # (+ its prompt's prefix and end)
            assert settled(servers, [3, 3]) == [3, 3] and engine_kept(engine, 3) == 3
            assert len(ends_held(servers)) == 2  # (the marker's, on each node)
        finally:
            engine.close()


def test_an_end_and_the_word_that_it_was_kept_are_noted_in_either_order() -> None:
    """The last node's word that every node kept a request's end, and the request's own end, come on
    different threads in either order: the second notes it. An end whose request failed, or whose
    length is not what the request fed, goes from the nodes; so does a word no request ever claims."""
    from mtpipe.coordinator.engine import kept as kept_module
    from mtpipe.node.protocol import Commit, GroupEnd

    dropped: list[str] = []
    kept = KeptPrefixes(ModelDims(kv_bytes_per_token=10, state_bytes=100), budget=10**6, drop=dropped.append)
    fed = [1, 2, 3, 4, 5]

    def end(key: str, position: int = 4) -> GroupEnd:
        return GroupEnd("s", Commit(0, 0, 0), key, position, drafts=True)

    kept.ended("a/end", fed, 0.0)
    kept.heard(end("a/end"))
    hit = kept.reuse(fed + [9], drafts=True, epoch=0.0)
    assert hit is not None and hit.key == "a/end" and hit.tokens == tuple(fed[:-1])
    kept.done(hit.key)
    kept.heard(GroupEnd("s", Commit(0, 0, 0), "b/end", 4, drafts=False))
    kept.ended("b/end", fed, 0.0)  # the same tokens, without the MTP head's part: a's stays
    assert dropped == ["b/end"] and kept.reuse(fed, drafts=True, epoch=0.0).key == "a/end"
    kept.done("a/end")
    kept.ended("c/end", None, 0.0)  # cancelled: the nodes drop what they kept
    kept.heard(end("c/end"))
    kept.heard(end("d/end", position=9))
    kept.ended("d/end", fed, 0.0)  # the nodes kept another length than the request fed
    assert dropped == ["b/end", "c/end", "d/end"] and kept.describe()["kept_prefixes"] == 1
    # A prompt that starts with an end still on its way waits for the word on it, for a while
    longer = fed + [6, 7]
    kept.ended("w/end", longer, 0.0)
    threading.Timer(0.1, kept.heard, [end("w/end", position=6)]).start()
    start = time.monotonic()
    hit = kept.reuse(longer + [8], drafts=True, epoch=0.0, wait=5.0)
    assert hit is not None and hit.key == "w/end" and time.monotonic() - start < 2.5  # (woken by the word)
    kept.done(hit.key)
    kept.ended("z/end", longer + [8, 9], 0.0)  # no word comes in time: it is given up, and goes once it does
    start = time.monotonic()
    assert kept.reuse(longer + [8, 9, 10], drafts=True, epoch=0.0, wait=0.2).key == "w/end"
    assert 0.2 <= time.monotonic() - start < 2
    kept.done("w/end")
    kept.heard(end("z/end", position=8))
    assert dropped[-1] == "z/end" and kept.describe()["kept_prefixes"] == 2
    for i in range(kept_module.MAX_UNMATCHED + 1):  # words nobody claims: the oldest goes from the nodes
        kept.heard(end(f"x{i}/end"))
    assert dropped[-1] == "x0/end"


def through_every_node(engine: Any, *texts: str) -> None:
    """Requests one after another, each to its end and the last node's word on it. Every frame sent
    around before a request's steps (ends, drops) has been through every node once its word is in, as
    each link keeps its frames' order; a drop the engine sends on a word heard meanwhile is behind the
    next request's steps."""
    for text in texts:
        prompt = list(engine.tokenizer.encode(text))
        wait_for_end(engine, prompt + run(engine, prompt, 0).tokens, False)


def ends_held(servers: list[Any]) -> list[str]:
    return [k for s in servers for k in s.service.worker.prefixes if k.endswith("/end")]


def test_an_end_the_engine_does_not_count_is_held_by_no_node(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes hold a request's end only where the engine counts it: not after a stop string ended the
    request on its first token while its row went on to its budget, not where a node before the last
    had no room for it (the nodes that kept it drop it), and not where copying it failed (the rows go on)."""
    from mtpipe.node.batch import BatchStage

    with node_servers(2) as servers:
        engine = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        try:
            prompt = list(engine.tokenizer.encode(PROMPTS[3]))
            reply = run(engine, prompt, 0).tokens
            first = engine.tokenizer.decode(reply[:1])
            wait_for_end(engine, prompt + reply, False)
            assert len(ends_held(servers)) == 2
            for i, budget in enumerate((2, 40)):  # its row runs out with the round after, or is released
                got = engine.complete(GenerationRequest(prompt, max_tokens=budget, mtp_depth=0, stop=[first]))
                assert got.finish_reason == "stop"
                start = time.monotonic()  # a prompt that starts with it waits for no word on its end
                hit = engine.kept.reuse(prompt + reply[:1] + [0], False, engine.pipeline.reformer.down_at, wait=5.0)
                assert time.monotonic() - start < 2.5 and hit is not None and len(hit.tokens) == len(prompt) - 1
                engine.kept.done(hit.key)
                through_every_node(engine, PROMPTS[13 + 2 * i], PROMPTS[14 + 2 * i])  # (+ their prefixes and ends)
                assert len(ends_held(servers)) == 6 + 4 * i and engine_kept(engine, 6 + 4 * i) == 6 + 4 * i

            servers[0].service.worker.max_prefix_bytes = 0  # the first node: no room for more
            prompt = list(engine.tokenizer.encode(PROMPTS[4]))
            wait_for_end(engine, prompt + run(engine, prompt).tokens, True)  # (the word on it: refused)
            assert settled(servers, [10, 10]) == [10, 10] and engine_kept(engine, 10) == 10  # (nor its prompt's)
            servers[0].service.worker.max_prefix_bytes = None

            def fail(*_: Any) -> None:
                raise MemoryError("no memory for the copy")

            monkeypatch.setattr(BatchStage, "end_prefix", fail)
            prompt = list(engine.tokenizer.encode(PROMPTS[5]))
            reply = run(engine, prompt).tokens
            assert len(reply) == TOKENS
            wait_for_end(engine, prompt + reply, True)  # (the word on it: refused)
            assert settled(servers, [11, 11]) == [11, 11] and engine_kept(engine, 11) == 11  # (+ its prompt's)
            assert len(ends_held(servers)) == 10
        finally:
            engine.close()
