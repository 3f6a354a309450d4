"""`mtpipe bench serve`: aggregate decode speed of many concurrent streams, in-process and over HTTP,
against mlx-lm's own batch generation, plus greedy identity across batch sizes and the stall a long
prompt's prefill puts on running streams.

Levels, at every concurrency c, over the same prompts (held-out source windows, as `bench engine`
uses; as many as the highest concurrency) and the same max tokens, greedy, c streams at a time: the
prompts go in waves of c, so every level decodes the same text (a lone prompt whose drafts happen
to be rarely accepted would otherwise stand for all of c=1; where c does not divide their number,
the last wave wraps around to the first prompts, which then count twice):
- engine: c requests opened at once on one in-process BatchEngine, per method (no_mtp: depth 0;
  auto: up to 3 drafts, the depth picked each round);
- api: the real API app (uvicorn on 127.0.0.1, a free port, in a process of its own as `mtpipe serve`
  runs it, or in this one with `api_process` off) over the same engine, c streaming
  `POST /v1/completions` at once, timed by the client (in a process of its own);
- mlx_lm_batch: `mlx_lm.generate.batch_generate` over the same prompts, on the engine's MLX thread;
- single_stream (c=1 only): the per-sequence engine (`local_engine`, as `bench engine` and a lone user
  ran before batching), for the c1 ratios.

Decode tok/s excludes prefill by measuring from the moment every stream has produced its first token
(the engine prefills prompts one after another between decode rounds, so streams start staggered):
tokens that arrive after that moment, over the time from it to the last token of any stream. At c=1
this is `bench engine`'s (tokens - 1) / (last - first). A level's figure is its waves' tokens over
their seconds. Engine chunks carry exact token counts; API chunks carry text, so their tokens are the
usage's completion tokens shared out by characters. mlx-lm's figure is its own: generated tokens over
wall time minus prompt time. Each cell is the median of `reps` runs; every wave runs every level and
method back to back (interleaved), every other wave in the reverse order.

Closed loop (serve_steady.py; `closed`): at every concurrency c above 1 (one client alone is what the
c=1 waves measure), c clients each send their next request as the last one ends, on the engine (both
methods) and on mlx-lm's BatchGenerator (a prompt inserted as each row ends), after each repetition's
waves; tok/s while every slot is taken. A wave ends with its slowest stream, and with drafts rows end
apart, so its last rounds run with fewer rows; a busy server refills them at once.

Identity: the engine's outputs of every prompt at c=8 (the largest c when 8 is absent), both methods,
waves and closed loop, equal each prompt decoded alone (no_mtp). mlx-lm's batch tokens (greedy) are
checked against the same (`identity.mlx_lm_batch`: its own kernels, so not part of `identical`).

Sampled (`temperature` > 0, as the API serves requests that do not ask for greedy): every level samples
at that temperature, each prompt with a seed of its own (`SEED_BASE` + its index) on the engine and the
API, so its tokens are the same whatever the batch and the depth, and identity holds as for greedy;
mlx-lm's batch generation samples at the same temperature (its own randomness).

Prefill gap: 4 streams (no_mtp) decoding, then a ~4000-token prompt is submitted; the window runs
from its submission to its first token. Every gap between consecutive chunks of the 4 streams that
overlaps the window counts (timestamps taken as the engine emits the chunks); the report gives their
median, p99 and max, the ratio p99 / median, and the median gap before the window as the baseline
(`median_over_baseline`: how much slower rounds run while the prompt goes in).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...models import blas, cpu_jit
from ...node.protocol import SamplingParams
from ..engine.batch import DEFAULT_MAX_ROWS, BatchEngine, Handle
from ..engine.build import batch_engine, local_engine
from ..engine.request import AUTO, GenerationRequest, context_room, resolve_depth
from .engine import bench_prompts, long_prompt
from .serve_steady import PER_SLOT, engine_closed_loop, lengths, mlx_lm_closed_loop, steady_window
from .streams import WAIT_S, Decode, Recorder, decode_window, percentile

METHODS: dict[str, int | str] = {"no_mtp": 0, "auto": AUTO}
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
RATIO_C = 8
WARM_TOKENS = 8
GAP_TOKENS = 4000
GAP_STREAMS = 4
GAP_SETTLE = 16  # chunks each stream emits before the long prompt goes in
GAP_STREAM_TOKENS = 2048
SEED_BASE = 1000  # sampled runs: prompt i's seed is SEED_BASE + i


def waves(n: int, c: int) -> list[list[int]]:
    """Prompt indices 0..n-1, c streams at a time: every wave holds c, the last one wrapping around."""
    return [[(w * c + i) % n for i in range(c)] for w in range(-(-n // c))]


def sampling(temperature: float, index: int) -> SamplingParams:
    """Prompt `index`'s sampling: greedy at temperature 0, else seeded (`SEED_BASE` + index)."""
    return SamplingParams(temperature=temperature, seed=SEED_BASE + index) if temperature > 0 else SamplingParams()


def _request(engine: BatchEngine, prompt: list[int], max_tokens: int, method: str,
             params: SamplingParams | None = None) -> GenerationRequest:
    depth, auto = resolve_depth(METHODS[method], engine.has_mtp)
    return GenerationRequest(prompt, max_tokens=max_tokens, params=params or SamplingParams(), mtp_depth=depth,
                             mtp_auto=auto)


def _kept(result: tuple[Decode, list[list[int]]], outputs: dict[str, list[tuple[int, list[int]]]], name: str,
          wave: list[int], keep: bool) -> Decode:
    """A run's decode figures; its tokens kept under `name` by prompt index when `keep`."""
    decode, toks = result
    if keep:
        outputs.setdefault(name, []).extend(zip(wave, toks))
    return decode


def run_streams(engine: Any, prompts: list[list[int]], max_tokens: int, method: str,
                params: list[SamplingParams] | None = None) -> list[Recorder]:
    """All prompts opened at once on an engine (batch or ring), each recorded until it ends (greedy
    unless `params` gives each prompt's sampling)."""
    recs = [Recorder() for _ in prompts]
    for i, (prompt, rec) in enumerate(zip(prompts, recs)):
        engine.open(_request(engine, prompt, max_tokens, method, params[i] if params else None), rec)
    for rec in recs:
        rec.wait()
    return recs


def engine_run(engine: BatchEngine, prompts: list[list[int]], max_tokens: int, method: str,
               params: list[SamplingParams] | None = None) -> tuple[Decode, list[list[int]]]:
    """All prompts opened at once; their aggregate decode window and each prompt's tokens."""
    recs = run_streams(engine, prompts, max_tokens, method, params)
    return decode_window([(r.times, r.counts) for r in recs]), [r.tokens for r in recs]


def single_run(engine: BatchEngine, single: Any, prompt: list[int], max_tokens: int, method: str,
               params: SamplingParams | None = None) -> Decode:
    """One stream through the per-sequence engine (`local_engine`, as `bench engine` runs it), on the
    batch engine's idle MLX thread: what a lone user got before batching."""
    def run() -> Decode:
        rec = Recorder()
        for chunk in single.generate(_request(engine, prompt, max_tokens, method, params)):
            rec(chunk)
        return decode_window([(rec.times, rec.counts)])

    return engine.thread.call(run)


def api_run(clients: Any, url: str, prompts: list[list[int]], max_tokens: int, method: str,
            params: list[SamplingParams] | None = None) -> Decode:
    sampled = [(p.temperature, p.seed) for p in params] if params else None
    records = clients.stream(url, prompts, max_tokens, METHODS[method], sampled)
    return decode_window([(r.times, r.token_counts()) for r in records])


def mlx_lm_run(engine: BatchEngine, ref: tuple[Any, Any], prompts: list[list[int]], max_tokens: int,
               temperature: float = 0.0) -> tuple[Decode, list[list[int]]]:
    """mlx-lm's batch_generate on the engine's MLX thread (idle between runs), sampled at `temperature`
    when above 0: the tokens it returns (its `generation_tokens` counts end tokens too) over its time,
    and each prompt's tokens."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = ref

    def run() -> Any:  # (the sampler is made on the MLX thread too)
        extra = {"sampler": make_sampler(temp=temperature)} if temperature > 0 else {}
        return batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True, **extra)

    out = engine.thread.call(run)
    return Decode(sum(len(t) for t in out.token_ids), out.stats.generation_time), [list(t) for t in out.token_ids]


def prefill_gap(engine: BatchEngine, prompts: list[list[int]], long_tokens: int = GAP_TOKENS,
                streams: int = GAP_STREAMS) -> dict[str, Any]:
    """Inter-chunk gaps of `streams` decoding streams while a long prompt is prefilled."""
    length = min(long_tokens, engine.max_context // 2)
    long = long_prompt(engine.tokenizer, length)
    chosen = [prompts[i % len(prompts)] for i in range(streams)]
    recs = [Recorder() for _ in chosen]
    handles: list[Handle] = []
    for prompt, rec in zip(chosen, recs):
        room = context_room(len(prompt), 0, engine.max_context)
        handles.append(engine.open(_request(engine, prompt, min(GAP_STREAM_TOKENS, room), "no_mtp"), rec))
    deadline = time.monotonic() + WAIT_S
    while not all(len(r.times) >= GAP_SETTLE or r.done.is_set() for r in recs):
        if time.monotonic() > deadline:
            raise TimeoutError("the gap bench's streams did not start")
        time.sleep(0.005)
    first = Recorder()
    submitted = time.perf_counter()
    engine.open(_request(engine, long, 1, "no_mtp"), first)
    first.wait()
    ended = first.times[0] if first.times else time.perf_counter()
    for h in handles:
        h.cancel()
    for r in recs:
        r.wait()
    window, before = [], []
    for r in recs:
        for a, b in zip(r.times, r.times[1:]):
            if b > submitted and a < ended:
                window.append(b - a)
            elif b <= submitted:
                before.append(b - a)
    out: dict[str, Any] = {
        "prompt_tokens": len(long),
        "streams": streams,
        "streams_through_window": sum(1 for r in recs if r.times and r.times[-1] >= ended),
        "prefill_s": round(ended - submitted, 4),
        "prefill_tok_s": round(len(long) / (ended - submitted), 1) if ended > submitted else 0.0,
        "gaps": len(window),
        "baseline_median_ms": round(1000 * statistics.median(before), 3) if before else None,
    }
    if not window:
        return {**out, "median_ms": None, "p99_ms": None, "max_ms": None, "gap_p99_over_median": None,
                "median_over_baseline": None}
    median, p99 = statistics.median(window), percentile(window, 99)
    return {**out, "median_ms": round(1000 * median, 3), "p99_ms": round(1000 * p99, 3),
            "max_ms": round(1000 * max(window), 3), "gap_p99_over_median": round(p99 / median, 3),
            "median_over_baseline": round(1000 * median / out["baseline_median_ms"], 3) if before else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(tok_s: dict[str, Any], mlx: dict[str, float], levels: list[int],
           closed: dict[str, dict[str, float]] | None = None) -> dict[str, Any]:
    """Engine-level ratios at c=8 (the largest c present when 8 is absent), named c8 either way; with
    `closed` (the closed loop's tok/s), its ratios too."""
    hi = RATIO_C if RATIO_C in levels else max(levels)
    lo = 1 if 1 in levels else min(levels)
    eng, api, single = tok_s["engine"], tok_s["api"], tok_s.get("single_stream", {})
    k, k1 = str(hi), str(lo)
    out: dict[str, Any] = {
        "c8_no_mtp_vs_mlx_lm": _ratio(eng["no_mtp"][k], mlx.get(k)),
        "c8_auto_vs_mlx_lm": _ratio(eng["auto"][k], mlx.get(k)),
        "c8_auto_vs_no_mtp": _ratio(eng["auto"][k], eng["no_mtp"][k]),
        "c8_vs_c1_no_mtp": _ratio(eng["no_mtp"][k], eng["no_mtp"][k1]),
        "c8_vs_c1_auto": _ratio(eng["auto"][k], eng["auto"][k1]),
        "api_vs_engine_c8": _ratio(api.get("no_mtp", {}).get(k), eng["no_mtp"][k]),
        "api_vs_engine_c8_auto": _ratio(api.get("auto", {}).get(k), eng["auto"][k]),
        "c1_no_mtp_vs_single_stream": _ratio(eng["no_mtp"].get("1"), single.get("no_mtp", {}).get("1")),
        "c1_auto_vs_single_stream": _ratio(eng["auto"].get("1"), single.get("auto", {}).get("1")),
        "concurrency": hi,
        "baseline_concurrency": lo,
    }
    if closed is not None:
        no_mtp, auto, ref = (closed.get(m, {}).get(k) for m in ("no_mtp", "auto", "mlx_lm"))
        out.update(closed_c8_no_mtp_vs_mlx_lm=_ratio(no_mtp, ref), closed_c8_auto_vs_mlx_lm=_ratio(auto, ref),
                   closed_c8_auto_vs_no_mtp=_ratio(auto, no_mtp))
    if hi != RATIO_C or lo != 1:
        out["note"] = f"c8 ratios are taken at c={hi}, c1 at c={lo} (8 or 1 not in the levels run)"
    return out


def closed_loop(engine: BatchEngine, ref: tuple[Any, Any] | None, prompts: list[list[int]],
                params: list[SamplingParams], c: int, max_tokens: int, temperature: float,
                per_client: int = PER_SLOT) -> tuple[dict[str, float], dict[str, list[tuple[int, int, list[int]]]]]:
    """Every method, then mlx-lm (given `ref`), through the closed loop at c clients of `per_client`
    requests each (serve_steady.py): tok/s by method (mlx-lm's as "mlx_lm"), and each method's outputs
    as (prompt index, max tokens, tokens). A request asks for no more than its prompt leaves room for."""
    n = len(prompts)
    deepest = max(resolve_depth(METHODS[m], engine.has_mtp)[0] for m in METHODS)
    sizes = [min(size, context_room(len(prompts[i % n]), deepest, engine.max_context))
             for i, size in enumerate(lengths(per_client * c, max_tokens))]
    tps: dict[str, float] = {}
    outputs: dict[str, list[tuple[int, int, list[int]]]] = {}
    for method in METHODS:
        def request(i: int, method: str = method) -> GenerationRequest:
            return _request(engine, prompts[i % n], sizes[i], method, params[i % n])

        recs = engine_closed_loop(engine, request, c, len(sizes))
        tps[method] = steady_window([(r.times, r.counts, r.ended) for r in recs], c).tps
        outputs[method] = [(i % n, sizes[i], r.tokens) for i, r in enumerate(recs)]
    if ref:
        streams = engine.thread.call(mlx_lm_closed_loop, *ref, prompts, c, sizes, temperature)
        tps["mlx_lm"] = steady_window(streams, c).tps
    return tps, outputs


def bench_serve(
    model_path: Path | str,
    *,
    concurrency: list[int] | tuple[int, ...] = DEFAULT_CONCURRENCY,
    max_tokens: int = 128,
    api: bool = True,
    gap: bool = True,
    mlx_lm: bool = True,
    gap_tokens: int = GAP_TOKENS,
    reps: int = 1,
    dtype: Any = None,
    temperature: float = 0.0,
    closed: bool = True,
    closed_requests: int = PER_SLOT,
    api_process: bool = True,
) -> dict[str, Any]:
    """Every level at every concurrency (see the module docstring); the result as one dict. `closed`:
    the closed loop too (serve_steady.py), after the waves of each repetition, `closed_requests` per
    client (at least 2: the first of each is the ramp)."""
    levels = sorted(set(concurrency))
    if not levels or levels[0] < 1:
        raise ValueError(f"concurrency levels must be positive, got {concurrency}")
    if not 0 <= temperature <= 2:  # (the API's range)
        raise ValueError(f"temperature must be in [0, 2], got {temperature}")
    if closed and closed_requests < 2:
        raise ValueError(f"the closed loop needs at least 2 requests per client, got {closed_requests}")
    top = levels[-1]
    engine = batch_engine(model_path, dtype=dtype, max_rows=max(DEFAULT_MAX_ROWS, top), prefix_cache=0)  # (as mlx-lm)
    server = clients = None
    try:
        prompts = [list(engine.tokenizer.encode(t)) for t in bench_prompts(top)]
        ref = engine.thread.call(_mlx_load, str(model_path)) if mlx_lm else None
        single = engine.thread.call(local_engine, model_path, dtype=dtype) if 1 in levels else None
        if api:
            from .serve_api import Clients, LiveServer

            server = LiveServer(engine, model_path if api_process else None)
            server.start()
            clients = Clients()
        params = [sampling(temperature, i) for i in range(len(prompts))]  # prompt i's, whatever its wave
        for c in levels:  # warm every path up once at every batch size (compilation, allocator)
            for method in METHODS:
                engine_run(engine, prompts[:c], WARM_TOKENS, method, params[:c])
                if server:
                    api_run(clients, server.url, prompts[:c], WARM_TOKENS, method, params[:c])
            if ref:
                mlx_lm_run(engine, ref, prompts[:c], WARM_TOKENS, temperature)
            if closed and c > 1:
                closed_loop(engine, ref, prompts, params, c, WARM_TOKENS, temperature, closed_requests)
        if single:
            for method in METHODS:
                single_run(engine, single, prompts[0], WARM_TOKENS, method, params[0])
        runs: dict[str, dict[str, dict[str, list[float]]]] = {"engine": {}, "api": {}, "single_stream": {}}
        mlx_runs: dict[str, list[float]] = {}
        outputs: dict[str, list[tuple[int, list[int]]]] = {}
        closed_runs: dict[str, dict[str, list[float]]] = {}  # method or "mlx_lm" -> c -> tok/s per rep
        closed_outputs: dict[str, list[tuple[int, int, list[int]]]] = {}
        id_c = RATIO_C if RATIO_C in levels else top

        for c in levels:
            for rep in range(reps):
                sums: dict[tuple[str, str], Decode] = {}
                for w, wave in enumerate(waves(top, c)):
                    batch, sampled = [prompts[i] for i in wave], [params[i] for i in wave]
                    keep = c == id_c and rep == 0  # (the identity check's outputs)
                    runs_here: list[tuple[str, str, Callable[[], Decode]]] = []
                    for method in METHODS:
                        runs_here.append(("engine", method, lambda m=method: _kept(
                            engine_run(engine, batch, max_tokens, m, sampled), outputs, m, wave, keep)))
                        if server:
                            runs_here.append(("api", method, lambda m=method: api_run(
                                clients, server.url, batch, max_tokens, m, sampled)))
                        if single and c == 1:
                            runs_here.append(("single_stream", method, lambda m=method: single_run(
                                engine, single, batch[0], max_tokens, m, sampled[0])))
                    if ref:  # (sampled, mlx-lm's randomness is its own: its tokens are not compared)
                        runs_here.append(("mlx_lm", "batch", lambda: _kept(mlx_lm_run(
                            engine, ref, batch, max_tokens, temperature), outputs, "mlx_lm", wave,
                            keep and temperature == 0)))
                    # Every other wave the other way round: no peer always runs first, or last, on a noisy machine.
                    for level, method, run in runs_here[::-1] if (w + rep) % 2 else runs_here:
                        sums[(level, method)] = sums.get((level, method), Decode()) + run()
                for (level, method), total in sums.items():
                    cells = mlx_runs if level == "mlx_lm" else runs[level].setdefault(method, {})
                    cells.setdefault(str(c), []).append(total.tps)
                if closed and c > 1:
                    tps, outs = closed_loop(engine, ref, prompts, params, c, max_tokens, temperature,
                                            closed_requests)
                    for name, value in tps.items():
                        closed_runs.setdefault(name, {}).setdefault(str(c), []).append(value)
                    if c == id_c and rep == 0:
                        closed_outputs = outs
        # each prompt alone, as long as its longest request: a shorter request's tokens are its first ones
        longest = {i: max_tokens for i, _ in outputs["no_mtp"]}
        for i, size, _ in (t for triples in closed_outputs.values() for t in triples):
            longest[i] = max(longest.get(i, 0), size)
        singles = {i: engine_run(engine, [prompts[i]], n, "no_mtp", [params[i]])[1][0] for i, n in longest.items()}
        per_method = {m: all(toks == singles[i][:max_tokens] for i, toks in outputs[m]) for m in outputs}
        peer = per_method.pop("mlx_lm", None)  # (its own kernels: reported, not part of `identical`)
        per_method_closed = {m: all(toks == singles[i][:size] for i, size, toks in triples)
                             for m, triples in closed_outputs.items()}

        def med(cells: dict[str, list[float]]) -> dict[str, float]:
            return {c: round(statistics.median(v), 2) for c, v in cells.items()}

        tok_s = {level: {m: med(cells) for m, cells in by.items()} for level, by in runs.items()}
        mlx = med(mlx_runs)
        closed_tok_s = {name: med(cells) for name, cells in closed_runs.items()}
        result = {
            "model": str(model_path),
            "blas": blas.info().to_dict(), "cpu_jit": cpu_jit.info(),
            "has_mtp": engine.has_mtp,
            "concurrency": levels, "max_tokens": max_tokens, "reps": reps,
            "api": ("a process of its own" if api_process else "the engine's process") if api else None,
            "temperature": temperature,
            "seeds": f"{SEED_BASE} + prompt index" if temperature > 0 else None,
            "prompt_tokens": [len(p) for p in prompts],
            "waves": {str(c): len(waves(top, c)) for c in levels},
            "measure": "decode tok/s: tokens after every stream's first token / (last token - that moment), "
                       "over every wave of c streams; mlx_lm_batch: generated tokens / generation time",
            "tok_s": tok_s, "mlx_lm_batch": mlx,
            "ratios": ratios(tok_s, mlx, levels, closed_tok_s if closed else None),
            "closed_loop": {"requests_per_client": closed_requests, "tok_s": closed_tok_s} if closed else None,
            "identical": all(per_method.values()) and all(per_method_closed.values()),
            "identity": {"concurrency": id_c, "per_method": per_method, "closed_loop": per_method_closed,
                         "mlx_lm_batch": peer},
            "prefill_gap": prefill_gap(engine, prompts, gap_tokens) if gap else None,
        }
    finally:
        if clients:
            clients.close()
        if server:
            server.stop()
        engine.close()
    return result


def _mlx_load(path: str) -> tuple[Any, Any]:
    from mlx_lm import load

    return load(path)


def parse_levels(value: str, option: str = "--concurrency") -> list[int]:
    """--concurrency, --nodes: comma-separated positive counts."""
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated counts, got {value!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"{option}: expected positive counts, got {value!r}")
    return levels
