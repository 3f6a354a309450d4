"""`mtpipe bench pipeline`: single node vs 2- and 3-node gRPC pipelines on loopback, with and without
MTP, and mlx-lm's own ring pipeline (2 ranks under mlx.launch) as the peer.

The node processes are spawned here on 127.0.0.1. Every prompt runs every mtpipe method back to
back, so machine noise hits all of them alike; mlx-lm's ring runs after, in its own processes.
Two more 2-node methods without MTP show what the pipeline's transport choices are worth: the
coordinator starting every round itself (no ring), and node-to-node frames on gRPC streams instead
of the TCP data plane. Decode speed is (tokens - 1) / (last token time - first token time), as in
`bench engine`. Wire figures come from the nodes' own counters (serialized Frame bytes per hop,
the last node's ring hop included) and the coordinator's (what it sends and receives per round).
Prefill is measured apart, on one long prompt: single node, 2 and 3 nodes with several prompt chunks
in flight, and 2 nodes taking one chunk at a time.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ...models import blas, cpu_jit
from ..engine.build import local_engine, remote_engine
from ..engine.engine import Engine
from ..engine.request import AUTO, AUTO_MAX_DEPTH, GenerationRequest
from ..pipeline.remote import RemotePipeline
from .auth import bench_auth
from .engine import _time_engine, bench_prompts
from .nodes import free_port, spawn_nodes

log = logging.getLogger(__name__)

DEFAULT_DEPTHS = (1, 2, 3)
COORDINATOR_ROUNDS = "pipe2_coordinator_rounds"  # 2 nodes, the ring off
PREFILL_ONE_CHUNK = "pipe2_one_chunk_in_flight"  # 2 nodes, prompt chunks one at a time
PREFILL_TOKENS = 2048
PREFILL_RUNS = 2
GRPC_HOPS = "pipe2_grpc_hops"  # 2 nodes without a data plane
RING_TIMEOUT_S = 900


def _wire_snapshot(pipeline: RemotePipeline) -> dict[str, Any]:
    health = pipeline.health()
    s = pipeline.stats
    return {  # node to node, then the last node's ring hop back to the first
        "hop_bytes": [h.forwarded_decode_bytes for h in health[:-1]] + [health[-1].ring_bytes],
        "hop_frames": [h.forwarded_decode_frames for h in health[:-1]] + [health[-1].ring_frames],
        "rounds": s.decode_rounds,
        "frames": s.decode_frames_sent,
        "sent": s.decode_bytes_sent,
        "received": s.decode_bytes_received,
    }


def _wire_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    rounds = after["rounds"] - before["rounds"]
    frames = [a - b for a, b in zip(after["hop_frames"], before["hop_frames"])]
    hop_bytes = [a - b for a, b in zip(after["hop_bytes"], before["hop_bytes"])]
    return {"rounds": rounds, "hop_frames": frames, "hop_bytes": hop_bytes, "frames": after["frames"] - before["frames"],
            "control_bytes": (after["sent"] - before["sent"]) + (after["received"] - before["received"])}


def _merge(total: dict[str, Any] | None, d: dict[str, Any]) -> dict[str, Any]:
    if total is None:
        return d
    return {
        "rounds": total["rounds"] + d["rounds"],
        "hop_frames": [a + b for a, b in zip(total["hop_frames"], d["hop_frames"])],
        "hop_bytes": [a + b for a, b in zip(total["hop_bytes"], d["hop_bytes"])],
        "frames": total["frames"] + d["frames"],
        "control_bytes": total["control_bytes"] + d["control_bytes"],
    }


def _wire_report(w: dict[str, Any], hidden_size: int, itemsize: int, depth: int) -> dict[str, Any]:
    rounds = max(w["rounds"], 1)
    return {
        "decode_rounds": w["rounds"],
        # Node to node (one frame per round each, payload (K+1) hidden vectors), then the ring hop from
        # the last node back to the first (tokens and commit only; 0 frames when the coordinator sends).
        "hops": len(w["hop_bytes"]),
        "bytes_per_round_per_hop": [round(b / f, 1) if f else 0.0 for b, f in zip(w["hop_bytes"], w["hop_frames"])],
        "hidden_payload_bytes_per_round": (depth + 1) * hidden_size * itemsize,
        "frames_per_round_per_hop": [round(f / rounds, 3) for f in w["hop_frames"]],
        "control_bytes_per_round": round(w["control_bytes"] / rounds, 1),
        # Rounds the coordinator sent and waited for (1.0 without the ring, 0.0 with it: it only listens).
        "round_trips_per_round": round(w["frames"] / rounds, 3),
    }


def run_mlx_ring(model_path: Path, prompts: list[list[int]], max_tokens: int, ranks: int = 2) -> dict[str, Any]:
    """mlx-lm's pipeline under `mlx.launch --backend ring` on loopback; {"error": ...} if it cannot run."""
    from .mlx_ring_peer import RESULT_PREFIX

    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    if not Path(launcher).exists():
        return {"error": "mlx.launch not found"}
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        cmd = [launcher, "--backend", "ring", "-n", str(ranks), "--hosts", "127.0.0.1", "--starting-port",
               str(free_port()), "--", sys.executable, "-m", "mtpipe.coordinator.bench.mlx_ring_peer",
               "--model", str(model_path), "--prompts", str(prompts_file), "--max-tokens", str(max_tokens)]
        log.info("running %s", " ".join(cmd))
        try:
            env = blas.child_env(ranks)  # (its ranks share the cores, as the nodes do)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RING_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"mlx.launch did not finish within {RING_TIMEOUT_S} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"mlx.launch exited with {proc.returncode}: {' | '.join(tail)}"}


def bench_prefill(engines: dict[str, Engine], texts: list[str]) -> dict[str, Any]:
    """Prompt throughput on one long prompt (the held-out texts joined, PREFILL_TOKENS tokens, 512-token
    chunks), median of PREFILL_RUNS runs per engine, engines interleaved: several chunks in flight let
    the nodes of a pipeline work on different chunks at once."""
    text = engines["single"].tokenizer.encode("\n".join(texts))
    prompt = (text * (PREFILL_TOKENS // len(text) + 1))[:PREFILL_TOKENS]
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(PREFILL_RUNS):
        for name, engine in engines.items():
            stats = engine.complete(GenerationRequest(prompt, max_tokens=1)).stats
            speeds[name].append(stats.prefill_tps)
    tok_s = {name: round(statistics.median(v), 1) for name, v in speeds.items()}
    return {"prompt_tokens": len(prompt), "tok_s": tok_s,
            "ratios": {f"{name}_vs_single": round(v / tok_s["single"], 3) for name, v in tok_s.items() if name != "single"}}


def _method(topology: str, depth: int | str) -> str:
    if depth == AUTO:
        return f"{topology}_mtp"
    return f"{topology}_no_mtp" if depth == 0 else f"{topology}_mtp_k{depth}"


def bench_pipeline(
    model_path: Path, *, max_tokens: int = 128, prompts: int = 8, depths: list[int] | None = None, ring: bool = True,
    auth_reps: int = 3,
) -> dict[str, Any]:
    """Every topology (single, pipe2, pipe3) without MTP, at each depth and with auto depth (`<topology>_mtp`,
    what users get by default); `<topology>_mtp_best` is its best fixed depth. Then the cost of a
    cluster secret (auth.py, `auth_reps` passes over the prompts)."""
    from ...models.config import load_config

    depths = depths or list(DEFAULT_DEPTHS)
    config = load_config(Path(model_path))
    single = local_engine(model_path)
    if not single.has_mtp:
        raise ValueError(f"{model_path} has no MTP head to benchmark")
    dtype = single.pipeline.stages[0].dtype
    texts = bench_prompts(prompts)
    encoded = [single.tokenizer.encode(t) for t in texts]
    topologies = ("single", "pipe2", "pipe3")
    # Without MTP only: the same 2 nodes with the coordinator sending every round, and 2 nodes whose
    # frames travel gRPC streams instead of the TCP data plane. The cost of a cluster secret is
    # measured on its own pairs of nodes afterwards (auth.py).
    variants = (COORDINATOR_ROUNDS, GRPC_HOPS)
    runs = [(t, k) for t in topologies for k in [0, *depths, AUTO]] + [(v, 0) for v in variants]
    methods = [_method(t, k) for t, k in runs]
    speeds: dict[str, list[float]] = {m: [] for m in methods}
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    drafted = {m: 0 for m in methods}
    accepted = {m: 0 for m in methods}
    wire: dict[str, dict[str, Any] | None] = {m: None for m in methods if not m.startswith("single")}
    # (each topology its own group of processes: a node's BLAS threads are the cores over its group's size)
    with spawn_nodes(2, model_path) as pair, spawn_nodes(3, model_path) as triple, \
            spawn_nodes(2, model_path, data_plane="grpc") as grpc_addresses:
        engines: dict[str, Engine] = {"single": single}
        try:
            engines["pipe2"] = remote_engine(model_path, pair, mtp=True)
            engines["pipe3"] = remote_engine(model_path, triple, mtp=True)
            engines[COORDINATOR_ROUNDS] = remote_engine(model_path, pair, mtp=True, ring=False)
            engines[GRPC_HOPS] = remote_engine(model_path, grpc_addresses, mtp=True)
            engines[PREFILL_ONE_CHUNK] = remote_engine(model_path, pair, mtp=True, steps_in_flight=1)
            for topology, k in runs:  # warm up every path once
                _time_engine(engines[topology], encoded[0], 8, k)
            for prompt in encoded:
                for topology, k in runs:
                    m, engine = _method(topology, k), engines[topology]
                    before = _wire_snapshot(engine.pipeline) if m in wire else None
                    toks, tps, stats = _time_engine(engine, prompt, max_tokens, k)
                    if before is not None:
                        wire[m] = _merge(wire[m], _wire_delta(before, _wire_snapshot(engine.pipeline)))
                    outputs[m].append(toks)
                    speeds[m].append(tps)
                    drafted[m] += stats.drafted
                    accepted[m] += stats.accepted
            prefill = bench_prefill({n: engines[n] for n in ("single", "pipe2", "pipe3", PREFILL_ONE_CHUNK)}, texts)
            rtt = engines["pipe3"].pipeline.health(probe_next=True)
        finally:
            for name, engine in engines.items():
                if name != "single":
                    engine.close()
    single.close()
    auth = bench_auth(model_path, encoded, max_tokens, reps=auth_reps)
    ring_result = run_mlx_ring(model_path, encoded, max_tokens) if ring else {"error": "skipped"}

    tok_s: dict[str, float | None] = {m: round(statistics.mean(v), 2) for m, v in speeds.items()}
    best = {t: max([0, *depths], key=lambda k: tok_s[_method(t, k)]) for t in topologies}
    for t in topologies:  # beside the auto depth, each topology's best fixed depth (0, no drafts, included)
        tok_s[f"{t}_mtp_best"] = tok_s[_method(t, best[t])]
    ring_ok = "tok_s" in ring_result
    tok_s["mlx_lm_ring2"] = round(statistics.mean(ring_result["tok_s"]), 2) if ring_ok else None

    def ratio(a: str, b: str) -> float | None:
        return round(tok_s[a] / tok_s[b], 3) if tok_s.get(a) and tok_s.get(b) else None

    reference = {k: outputs[_method("single", k)] for k in [0, *depths, AUTO]}
    return {
        "model": str(model_path),
        "blas": blas.info().to_dict(), "cpu_jit": cpu_jit.info(),
        "prompts": len(encoded),
        "max_tokens": max_tokens,
        "depths": depths,
        "best_depth": best,
        "dtype": str(dtype).removeprefix("mlx.core."),
        "hidden_size": config.args.hidden_size,
        "num_layers": config.num_layers,
        "tok_s": tok_s,
        "acceptance": {m: round(accepted[m] / drafted[m], 4) for m in methods if drafted[m]},
        # Same kernels on the same shapes: every pipeline must match single-node at the same depth.
        "identical_to_single": {m: outputs[m] == reference[k] for m, (t, k) in zip(methods, runs)},
        "mtp_identical_to_no_mtp": {str(k): reference[k] == reference[0] for k in [*depths, AUTO]},
        "mlx_lm_ring_identical_to_single": (ring_result["tokens"] == reference[0]) if ring_ok else None,
        "mlx_lm_ring": {k: v for k, v in ring_result.items() if k != "tokens"},
        "wire": {m: _wire_report(w, config.args.hidden_size, dtype.size, AUTO_MAX_DEPTH if k == AUTO else k)
                 for m, (t, k) in zip(methods, runs) if (w := wire.get(m))},
        "next_stage_rtt_ms": [round(h.next_rtt_ms, 3) for h in rtt[:-1]],
        "prefill": prefill,
        "auth": auth,
        "ratios": {
            "pipe2_no_mtp_vs_single": ratio("pipe2_no_mtp", "single_no_mtp"),
            "pipe2_mtp_vs_single_no_mtp": ratio("pipe2_mtp", "single_no_mtp"),
            "pipe2_mtp_vs_mlx_lm_ring": ratio("pipe2_mtp", "mlx_lm_ring2"),
            "pipe2_auto_vs_best_fixed": ratio("pipe2_mtp", "pipe2_mtp_best"),
            "single_auto_vs_best_fixed": ratio("single_mtp", "single_mtp_best"),
            "pipe3_no_mtp_vs_single": ratio("pipe3_no_mtp", "single_no_mtp"),
            "pipe3_mtp_vs_single_no_mtp": ratio("pipe3_mtp", "single_no_mtp"),
            "single_mtp_vs_single_no_mtp": ratio("single_mtp", "single_no_mtp"),
            "pipe2_mtp_vs_single_mtp": ratio("pipe2_mtp", "single_mtp"),
            "pipe3_mtp_vs_single_mtp": ratio("pipe3_mtp", "single_mtp"),
            "pipe2_no_mtp_vs_mlx_lm_ring": ratio("pipe2_no_mtp", "mlx_lm_ring2"),
            "pipe2_ring_vs_coordinator_rounds": ratio("pipe2_no_mtp", _method(COORDINATOR_ROUNDS, 0)),
            "pipe2_tcp_vs_grpc_hops": ratio("pipe2_no_mtp", _method(GRPC_HOPS, 0)),
            "auth_on_vs_off": auth["ratios"]["auth_on_vs_off_no_mtp"],
            "auth_on_vs_off_mtp": auth["ratios"]["auth_on_vs_off_mtp"],
            "auth_control_b_vs_a": auth["ratios"]["control_b_vs_a_no_mtp"],
            "pipe2_prefill_vs_single": prefill["ratios"]["pipe2_vs_single"],
            "pipe2_prefill_vs_one_chunk_in_flight": round(
                prefill["tok_s"]["pipe2"] / prefill["tok_s"][PREFILL_ONE_CHUNK], 3),
        },
    }


def print_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"mtpipe bench pipeline: {result['prompts']} prompts x {result['max_tokens']} tokens, "
                        f"{result['dtype']}, loopback")
    for col in ("method", "tok/s", "vs single", "acceptance", "identical", "B/round/hop", "control B/round"):
        table.add_column(col, justify="left" if col in ("method", "identical") else "right")
    tok = result["tok_s"]
    base = tok["single_no_mtp"]
    for m, v in tok.items():
        if m.endswith("_mtp_best"):
            continue  # the best-depth aliases; their rows are the _mtp_kN ones
        w = result["wire"].get(m, {})
        best = any(m == f"{t}_mtp_k{k}" for t, k in result["best_depth"].items())
        identical = (result["mlx_lm_ring_identical_to_single"] if m.startswith("mlx")
                     else result["identical_to_single"][m])
        table.add_row(
            m + (" *" if best else ""),
            f"{v:.1f}" if v is not None else "n/a",
            f"{v / base:.2f}x" if v and base else "",
            f"{100 * result['acceptance'][m]:.1f}%" if m in result["acceptance"] else "",
            "" if identical is None else str(identical),
            ", ".join(f"{b:.0f}" for b in w.get("bytes_per_round_per_hop", [])),
            f"{w['control_bytes_per_round']:.0f}" if w else "",
        )
    console.print(table)
    console.print("* best depth of its topology. ratios: " + ", ".join(f"{k} {v}" for k, v in result["ratios"].items()))
    if "error" in result["mlx_lm_ring"]:
        console.print(f"mlx-lm ring: {result['mlx_lm_ring']['error']}")
    p = result["prefill"]
    console.print(f"prefill, one {p['prompt_tokens']}-token prompt (tok/s): "
                  + ", ".join(f"{name} {v:.0f}" for name, v in p["tok_s"].items()))
    console.print(f"round trip to the next stage (3-node, unary ping): {result['next_stage_rtt_ms']} ms; a decode "
                  "round is one trip around the nodes (first -> ... -> last -> first); the coordinator only listens, "
                  f"except in {COORDINATOR_ROUNDS}")
