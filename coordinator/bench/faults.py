"""`mtpipe bench faults`: faults injected into node processes on 127.0.0.1 while requests stream.

Each scenario starts its own nodes, opens greedy streams (MTP on), waits until every stream has
tokens, then freezes a node (SIGSTOP, then SIGCONT), kills one and starts it again on its address, or
kills one for good (the middle of three or more, the last of two), the others (or the one left) taking
its layers once it has been lost for the fault's seconds (cluster/heal.py, as `mtpipe launch` does after
`placement.heal_after_s`). It reports what the clients saw (a pause, or errors), the longest pause in
a stream, the time from the end of the fault (for a heal: the heal delay) to the first token after
it, whether each finished stream holds exactly the tokens of an undisturbed run (single node, same
requests), and the sequences still held by the nodes once the cluster is quiet (and how long that
took). The ring engine resumes its requests; the
per-sequence engine (`generate --nodes`, or a pipeline without a ring) fails them, naming the node.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

from ..cluster.heal import Healer
from ..engine.build import local_engine, remote_engine, ring_engine
from ..engine.request import GenerationRequest
from ..engine.sinks import END, open_stream
from .engine import bench_prompts
from .nodes import NodeProcesses

log = logging.getLogger(__name__)

SCENARIOS = (  # (name, engine, what happens, node index: -1 the last)
    ("freeze-last", "ring", "freeze", -1),
    ("freeze-first", "ring", "freeze", 0),
    ("kill-restart-last", "ring", "restart", -1),
    ("freeze-last", "per_sequence", "freeze", -1),
    ("kill-middle-heal", "ring", "heal", 1),  # (three nodes or more)
    ("kill-last-heal", "ring", "heal", -1),  # (two nodes: the first is left to run the ring by itself)
)
SETTLE_S = 30.0
STREAM_TIMEOUT_S = 180.0


@dataclass
class Stream:
    chunks: list[tuple[float, list[int]]] = field(default_factory=list)  # (arrival, tokens)
    error: str | None = None


@dataclass
class Outcome:
    scenario: str
    engine: str
    nodes: int
    fault_s: float  # how long the node was frozen or gone
    clients_saw: str
    max_pause_s: float  # the longest wait between two chunks of a stream
    recovery_s: float | None  # end of the fault to the first token after it (None: nothing came)
    identical: str  # finished streams with the undisturbed run's tokens, of all streams
    held_at_end: list[int]  # sequences per node when every stream had ended
    sequences_left: list[int]  # per node, once quiet (or after SETTLE_S)
    quiet_after_s: float | None  # from the streams' end until every node held no sequence


def _open(engine: Any, req: GenerationRequest, stream: Stream, done: threading.Event) -> None:
    """Collect a stream's chunks with their arrival times, on the engine's threads or one of its own."""
    def sink(item: Any) -> None:
        if item is END:
            done.set()
        elif isinstance(item, BaseException):
            stream.error = str(item)
        else:
            stream.chunks.append((time.monotonic(), list(item.tokens)))

    open_stream(engine, req, sink)


def _active(engine: Any) -> list[int]:
    try:
        return [h.active_sequences for h in engine.pipeline.health(timeout=5.0)]
    except Exception:  # noqa: BLE001 - a node not back yet
        return [-1]


def _quiet(held: list[int]) -> bool:
    return bool(held) and all(n == 0 for n in held)


def run_scenario(model: str, n: int, scenario: tuple[str, str, str, int], reqs: list[GenerationRequest],
                 want: list[list[int]], fault_s: float) -> Outcome:
    name, kind, fault, victim = scenario
    nodes = NodeProcesses(n, model_dirs=[model])
    build = ring_engine if kind == "ring" else remote_engine
    engine = build(model, nodes.addresses, dtype="float32")
    try:
        if fault == "heal":
            Healer.over_nodes(model, engine.pipeline).attach(engine.pipeline, fault_s)
        streams = [Stream() for _ in reqs]
        ends = [threading.Event() for _ in reqs]
        for r, s, e in zip(reqs, streams, ends):
            _open(engine, r, s, e)
        deadline = time.monotonic() + STREAM_TIMEOUT_S
        while not all(s.chunks or e.is_set() for s, e in zip(streams, ends)) and time.monotonic() < deadline:
            time.sleep(0.01)
        if fault == "freeze":
            nodes.freeze(victim, fault_s)
        elif fault == "heal":  # (the heal delay runs from when the pipeline knew, at once for a killed node)
            nodes.kill(victim)
            time.sleep(fault_s)
        else:
            nodes.kill(victim)
            time.sleep(fault_s)
            nodes.start(victim)
        end = time.monotonic()
        for e in ends:
            e.wait(max(0.0, deadline - time.monotonic()))
        ended = time.monotonic()
        held = left = _active(engine)  # (per node of the pipeline: after a heal, fewer than n)
        quiet_at = ended if _quiet(left) else None
        while quiet_at is None and time.monotonic() < ended + SETTLE_S:
            time.sleep(0.25)
            if _quiet(left := _active(engine)):
                quiet_at = time.monotonic()
        after = [t for s in streams for t, _ in s.chunks if t > end]
        pauses = [b[0] - a[0] for s in streams for a, b in zip(s.chunks, s.chunks[1:])]
        errors = [s.error for s in streams if s.error]
        got = [[t for _, toks in s.chunks for t in toks] for s in streams]
        same = sum(1 for s, g, w in zip(streams, got, want) if not s.error and g == w)
        saw = f"{len(errors)} errors: {errors[0]}" if errors else "a pause"
        return Outcome(name, kind, n, fault_s, saw, max(pauses, default=0.0),
                       min(after) - end if after else None, f"{same}/{len(reqs)}", held, left,
                       quiet_at - ended if quiet_at is not None else None)
    finally:
        engine.close()
        nodes.close()


def bench_faults(model: str, nodes: list[int], streams: int = 4, max_tokens: int = 384,
                 fault_s: float = 4.0) -> dict[str, Any]:
    reference = local_engine(model, dtype=mx.float32)
    tok = reference.tokenizer
    reqs = [GenerationRequest(tok.encode(p), max_tokens=max_tokens, mtp_depth=2) for p in bench_prompts(streams)]
    want = [reference.complete(r).tokens for r in reqs]
    outcomes = []
    for n in nodes:
        for scenario in SCENARIOS:
            if scenario[0] == "kill-middle-heal" and n < 3 or scenario[0] == "kill-last-heal" and n != 2:
                continue
            log.info("fault scenario %s (%s engine) over %d nodes", scenario[0], scenario[1], n)
            outcomes.append(run_scenario(model, n, scenario, reqs, want, fault_s))
    return {"streams": streams, "max_tokens": max_tokens, "fault_s": fault_s,
            "outcomes": [asdict(o) for o in outcomes]}


def print_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"faults: {result['streams']} greedy streams (MTP 2, {result['max_tokens']} tokens), "
                        f"node frozen or gone {result['fault_s']:g} s")
    for col in ("fault", "engine", "nodes", "clients saw", "longest pause", "recovery", "identical",
                "held at end", "left", "quiet after"):
        table.add_column(col, overflow="fold")

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    for o in result["outcomes"]:
        saw = o["clients_saw"].split(":", 1)[0]  # the whole message is in --json
        table.add_row(o["scenario"], o["engine"], str(o["nodes"]), saw, secs(o["max_pause_s"]), secs(o["recovery_s"]),
                      o["identical"], str(o["held_at_end"]), str(o["sequences_left"]), secs(o["quiet_after_s"]))
    console.print(table)
