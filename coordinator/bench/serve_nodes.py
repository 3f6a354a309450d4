"""`mtpipe bench serve --nodes 2,3`: ring batches over node processes against one node, in one run.

Node processes are spawned on 127.0.0.1 (each group of n nodes shares this machine's cores, as
`bench pipeline` spawns them); the single node is the in-process batch engine `bench serve` measures.
At every concurrency c, the same prompts (as many as the highest c) in waves of c streams, as `bench
serve` runs them, and the same max tokens, greedy; each wave runs every topology and method back to
back (interleaved, every other wave in reverse; `reps` times, the median reported): no_mtp (depth 0)
and auto (up to 3 drafts).
Decode tok/s is `bench serve`'s aggregate: tokens after every stream's first one, over the time from
that moment to the last token, summed over the waves. The peer is mlx-lm's own 2-rank ring pipeline
(mlx.launch, `bench pipeline`'s run), one stream at a time over the same prompts: its pipeline does
not batch.

Per-hop breakdown (2 nodes, c=1, no MTP, one more stream after the timed runs): each node's compute
per round, how busy it was and the bytes of a round on each hop (the last node's: its ring hop), from
the nodes' own counters over the decode rounds alone, against the single node's time per token.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ...models import blas, cpu_jit
from ..engine.batch import DEFAULT_MAX_ROWS
from ..engine.build import batch_engine, ring_engine
from ..engine.ring import RingEngine
from .engine import bench_prompts
from .nodes import spawn_nodes
from .pipeline import run_mlx_ring
from .serve import METHODS, WARM_TOKENS, _request, engine_run, prefill_gap, run_streams, waves
from .streams import Decode, Recorder, decode_window

RING_RANKS = 2


def _node_counters(engine: RingEngine) -> list[dict[str, float]]:
    out = []
    for h in engine.pipeline.health():
        out.append({"steps": h.steps, "seconds": h.steps * h.mean_step_ms / 1000.0,
                    "bytes": h.forwarded_bytes if not h.is_last else h.ring_bytes,
                    "frames": h.forwarded_frames if not h.is_last else h.ring_frames})
    return out


def _breakdown(before: list[dict[str, float]], after: list[dict[str, float]], tokens: int,
               seconds: float) -> dict[str, Any]:
    """Per node: ms of compute per frame it handled; per hop: bytes per frame (the last: its ring hop)."""
    nodes = []
    for b, a in zip(before, after):
        steps, frames = a["steps"] - b["steps"], a["frames"] - b["frames"]
        nodes.append({"ms_per_step": round(1000 * (a["seconds"] - b["seconds"]) / steps, 3) if steps else None,
                      "steps": steps, "bytes_per_frame": round((a["bytes"] - b["bytes"]) / frames, 1) if frames else None,
                      "busy": round((a["seconds"] - b["seconds"]) / seconds, 3) if seconds else None})
    return {"nodes": nodes, "ms_per_token": round(1000 * seconds / tokens, 3) if tokens else None}


def probe_run(engine: RingEngine, prompt: list[int], max_tokens: int, method: str) -> dict[str, Any]:
    """One stream, the nodes' counters read once its first token is out and again at its end: the
    decode rounds alone (the prompt's steps excluded)."""
    rec = Recorder()
    engine.open(_request(engine, prompt, max_tokens, method), rec)
    while not rec.times and not rec.done.is_set():
        time.sleep(0.0005)
    before, start, first = _node_counters(engine), time.perf_counter(), len(rec.tokens)
    rec.wait()
    seconds = rec.times[-1] - start if rec.times else 0.0
    return _breakdown(before, _node_counters(engine), len(rec.tokens) - first, seconds)


def bench_serve_nodes(model_path: Path | str, *, nodes: list[int], concurrency: list[int], max_tokens: int = 128,
                      reps: int = 1, mlx_ring: bool = True, gap: bool = True) -> dict[str, Any]:
    levels = sorted(set(concurrency))
    if min(nodes) < 2:
        raise ValueError(f"--nodes: a ring needs 2 nodes or more, got {nodes}")
    top = levels[-1]
    # No kept prefixes on either side: the reps repeat prompts, and mlx-lm's ring keeps nothing.
    single = batch_engine(model_path, max_rows=max(DEFAULT_MAX_ROWS, top), prefix_cache=0)
    engines: dict[str, Any] = {"single": single}
    prompts = [list(single.tokenizer.encode(t)) for t in bench_prompts(top)]
    with ExitStack() as stack:
        stack.callback(single.close)
        for n in nodes:
            engine = ring_engine(model_path, stack.enter_context(spawn_nodes(n, model_path)), mtp=True,
                                 max_rows=max(DEFAULT_MAX_ROWS, top), prefix_cache=0)
            stack.callback(engine.close)
            if not engine.pipeline.rings:
                raise RuntimeError(f"{n} nodes gave no ring: the last node cannot reach the first (see the log)")
            engines[f"pipe{n}"] = engine
        for c in levels:  # warm-up: compilation, allocators, every batch size
            for engine in engines.values():
                for method in METHODS:
                    engine_run(engine, prompts[:c], WARM_TOKENS, method)
        runs: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name in engines}
        full_runs: dict[str, dict[str, dict[str, list[float]]]] = {name: {} for name in engines}
        outputs: dict[str, dict[int, list[int]]] = {}
        hops: dict[str, Any] = {}
        for rep in range(reps):
            for c in levels:
                sums: dict[tuple[str, str], tuple[Decode, Decode]] = {}
                for w, wave in enumerate(waves(top, c)):
                    order = [(method, name, engine) for method in METHODS for name, engine in engines.items()]
                    for method, name, engine in order[::-1] if (w + rep) % 2 else order:  # (as bench serve's)
                        decode, full, toks = _run(engine, [prompts[i] for i in wave], max_tokens, method)
                        was = sums.get((name, method), (Decode(), Decode()))
                        sums[(name, method)] = (was[0] + decode, was[1] + full)
                        if c == top and rep == 0:
                            outputs.setdefault(f"{name}/{method}", {}).update(zip(wave, toks))
                for (name, method), (decode, full) in sums.items():
                    runs[name].setdefault(method, {}).setdefault(str(c), []).append(decode.tps)
                    full_runs[name].setdefault(method, {}).setdefault(str(c), []).append(full.tps)
        if "pipe2" in engines:
            hops = probe_run(engines["pipe2"], prompts[0], max_tokens, "no_mtp")
        # a long prompt while streams decode, on every topology: how much it holds them up
        gaps = {name: prefill_gap(engine, prompts) for name, engine in engines.items()} if gap else {}
    # after the nodes are gone: mlx-lm's ranks get the machine to themselves, as the nodes had
    ring = run_mlx_ring(Path(model_path), prompts[:top], max_tokens, ranks=RING_RANKS) if mlx_ring else None
    tok_s, full_tok_s = _medians(runs), _medians(full_runs)
    ring_tok_s = round(statistics.median(ring["tok_s"]), 2) if ring and "tok_s" in ring else None
    reference = outputs["single/no_mtp"]
    identity = {key: toks == reference for key, toks in outputs.items()}
    return {
        "model": str(model_path),
        "blas": blas.info().to_dict(), "cpu_jit": cpu_jit.info(),
        "nodes": nodes,
        "concurrency": levels,
        "max_tokens": max_tokens,
        "reps": reps,
        "waves": {str(c): len(waves(top, c)) for c in levels},
        "measure": "aggregate decode tok/s (bench serve's: from every stream's first token to the last token, "
                   "over every wave of c streams); "
                   "full_window: to the first stream's end, while all streams run; mlx_lm_ring: one stream at a "
                   "time, its decode tok/s",
        "tok_s": tok_s,
        "full_window_tok_s": full_tok_s,
        "mlx_lm_ring": {"ranks": RING_RANKS, "tok_s": ring_tok_s, **({"error": ring["error"]} if ring and
                                                                    "error" in ring else {})},
        "hop_breakdown_pipe2_c1_no_mtp": {**hops, "single_ms_per_token": _ms(tok_s["single"]["no_mtp"].get("1"))},
        "identical": all(identity.values()),
        "identity": {"concurrency": top, "per_engine_method": identity},
        "prefill_gap": gaps,
        "ratios": ratios(tok_s, ring_tok_s, nodes, top),
        "full_window_ratios": {k: v for k, v in ratios(full_tok_s, ring_tok_s, nodes, top).items() if "c8" in k},
    }


def _run(engine: Any, prompts: list[list[int]], max_tokens: int, method: str) -> tuple[Decode, Decode, list[list[int]]]:
    """All prompts at once: the decode window to the last token and the one while all streams run,
    and the tokens."""
    recs = run_streams(engine, prompts, max_tokens, method)
    streams = [(r.times, r.counts) for r in recs]
    return decode_window(streams), decode_window(streams, full=True), [r.tokens for r in recs]


def _medians(runs: dict[str, dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    return {name: {m: {c: round(statistics.median(v), 2) for c, v in cells.items()} for m, cells in by.items()}
            for name, by in runs.items()}


def _ms(tps: float | None) -> float | None:
    return round(1000 / tps, 3) if tps else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(tok_s: dict[str, Any], ring: float | None, nodes: list[int], top: int) -> dict[str, Any]:
    single = tok_s["single"]
    hi = str(8 if "8" in single["auto"] else top)
    out: dict[str, Any] = {"concurrency": int(hi)}
    for n in nodes:
        p = tok_s[f"pipe{n}"]
        out[f"pipe{n}_c8_vs_single_c8"] = _ratio(p["auto"].get(hi), single["auto"].get(hi))  # (auto on both)
        # against the single node's faster method at c8 (auto may be the slower one there)
        out[f"pipe{n}_c8_vs_single_c8_best"] = _ratio(p["auto"].get(hi), max(single["auto"].get(hi) or 0.0,
                                                                               single["no_mtp"].get(hi) or 0.0))
        out[f"pipe{n}_c8_no_mtp_vs_single_c8_no_mtp"] = _ratio(p["no_mtp"].get(hi), single["no_mtp"].get(hi))
        out[f"pipe{n}_c1_auto_vs_single_no_mtp"] = _ratio(p["auto"].get("1"), single["no_mtp"].get("1"))
        out[f"pipe{n}_c1_no_mtp_vs_single"] = _ratio(p["no_mtp"].get("1"), single["no_mtp"].get("1"))
    if 2 in nodes:  # the peer runs one stream: compared at the same concurrency, 1
        out["pipe2_auto_vs_mlx_lm_ring"] = _ratio(tok_s["pipe2"]["auto"].get("1"), ring)
    return out


def print_nodes_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    tok = result["tok_s"]
    table = Table(title=f"mtpipe bench serve --nodes: aggregate decode tok/s, {result['max_tokens']} tokens per stream")
    table.add_column("streams", justify="right")
    names = list(tok)
    for name in names:
        for m in METHODS:
            table.add_column(f"{name} {m}", justify="right")
    for c in map(str, result["concurrency"]):
        table.add_row(c, *[f"{tok[n][m].get(c, 0):.1f}" for n in names for m in METHODS])
    console.print(table)
    console.print(f"mlx-lm ring ({result['mlx_lm_ring']['ranks']} ranks, one stream): {result['mlx_lm_ring']}")
    console.print(f"hop breakdown (2 nodes, c=1, no MTP): {result['hop_breakdown_pipe2_c1_no_mtp']}")
    console.print(f"ratios: {result['ratios']}")
    console.print(f"while every stream runs: {result['full_window_tok_s']}; ratios {result['full_window_ratios']}")
    console.print(f"greedy outputs at c={result['identity']['concurrency']} equal the single node's: "
                  f"{result['identical']} {result['identity']['per_engine_method']}")
    for name, g in result.get("prefill_gap", {}).items():
        console.print(f"prefill gap, {name}: {g['prompt_tokens']}-token prompt in {g['prefill_s']:.2f} s; gaps of "
                      f"{g['streams']} streams: median {g['median_ms']} ms, p99 {g['p99_ms']} ms (p99/median "
                      f"{g['gap_p99_over_median']}; before: median {g['baseline_median_ms']} ms)")
