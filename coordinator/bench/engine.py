"""`mtpipe bench engine`: mlx-lm, mtpipe without MTP and with MTP at several depths, side by side.

Every prompt runs every method back to back (interleaved), so machine noise hits all of them alike;
the report gives ratios. Decode speed is (tokens - 1) / (last token time - first token time). After
long prompts, whose prefills take seconds, the methods are prefilled first and their decodes timed
back to back (`Paused`).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Generator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...models import blas, cpu_jit
from ...node.protocol import SamplingParams
from ..engine.build import local_engine
from ..engine.engine import Engine
from ..engine.request import AUTO, GenerationRequest, resolve_depth


def bench_prompts(n: int) -> list[str]:
    from ...training.corpus import heldout_prompts

    return heldout_prompts(n)


Chunks = Generator[tuple[list[int], Any], None, None]  # (tokens, stats or None), one item per round handed back


def mlx_lm_chunks(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> Chunks:
    """mlx-lm's stream_generate, a token at a time, up to its end-of-sequence token."""
    from mlx_lm import stream_generate

    with closing(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)) as responses:
        for r in responses:
            if r.finish_reason == "stop" and r.token in tokenizer.eos_token_ids:
                return
            yield [r.token], None


def engine_chunks(engine: Engine, prompt: list[int], max_tokens: int, depth: int | str,
                  params: SamplingParams | None = None) -> Chunks:
    """A greedy decode of `prompt` at a depth (a number or "auto"), a round at a time."""
    drafts, auto = resolve_depth(depth, engine.has_mtp)
    req = GenerationRequest(prompt, max_tokens=max_tokens, params=params or SamplingParams(), mtp_depth=drafts,
                            mtp_auto=auto)
    with closing(engine.generate(req)) as chunks:  # closed early, the engine releases the sequence
        for chunk in chunks:
            yield chunk.shown, chunk.stats


def timed(chunks: Chunks) -> tuple[list[int], float, Any]:
    """Tokens, decode tok/s and the last stats: the tokens after the first chunk that has any, over the
    time from that chunk to the last. The first carries the first token after the prompt, whose time
    is the prefill's; a round handed back may carry several tokens."""
    tokens: list[int] = []
    first, stats = 0, None
    start: float | None = None
    last: float | None = None
    for toks, chunk_stats in chunks:
        now = time.perf_counter()
        tokens += toks
        stats = chunk_stats or stats
        if toks:
            if start is None:
                start, first = now, len(tokens)
            last = now
    tps = (len(tokens) - first) / (last - start) if start is not None and last > start else 0.0
    return tokens, tps, stats


class Paused:
    """A decode whose prompt is in and first token out, waiting its turn: decodes after long prompts are
    timed back to back, as their prefills take seconds and this kind of machine changes pace over tens
    of seconds. The first round after the pause, which may have computed during it, is not timed."""

    def __init__(self, chunks: Chunks):
        self.chunks = chunks
        self.tokens: list[int] = []
        self.stats: Any = None  # a decode that ends at its first token hands its stats back with it
        for toks, stats in chunks:
            self.tokens += toks
            self.stats = stats or self.stats
            if self.tokens:
                break

    def finish(self) -> tuple[list[int], float, Any]:
        tokens, tps, stats = timed(self.chunks)
        return self.tokens + tokens, tps, stats or self.stats

    def close(self) -> None:
        """Ends the decode where it is (its engine releases the sequence, mlx-lm leaves its stream)."""
        self.chunks.close()


def time_mlx_lm(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """mlx-lm's stream_generate: its tokens and decode speed, measured the way the engine's is."""
    tokens, tps, _ = timed(mlx_lm_chunks(model, tokenizer, prompt, max_tokens))
    return tokens, tps


CONTEXT_REPS = 4  # repetitions after each long prompt (`bench_long_context`)
PROCESSORS = SamplingParams(presence_penalty=0.5, top_logprobs=5)  # what an evaluation harness asks for


def _time_engine(engine: Engine, prompt: list[int], max_tokens: int, depth: int | str,
                 params: SamplingParams | None = None) -> tuple[list[int], float, Any]:
    """Greedy decode of `prompt` at a depth (a number or "auto"): tokens, decode tok/s, stats."""
    return timed(engine_chunks(engine, prompt, max_tokens, depth, params))


def _cost_terms(engine: Engine, prompt: list[int], depths: list[int], trials: int = 20) -> dict[str, float]:
    """Verify forward over K+1 tokens and one draft step, each over a single-token decode step."""
    worker = engine.pipeline.stages[-1]
    model = worker.model
    if len(engine.pipeline.stages) != 1 or not model.has_mtp:
        return {}
    cache = model.make_cache()
    h, _ = model.run_layers(model.embed(mx.array([prompt])), cache)
    mx.eval(h, [c.state for c in cache])

    def forward(T: int) -> float:
        # Shallow copies: writes land past the prefilled offset, which the original never reads.
        c = [copy.copy(x) for x in cache]
        for x in c:
            if hasattr(x, "cache"):
                x.cache = list(x.cache)
        t0 = time.perf_counter()
        out, snaps = model.run_layers(model.embed(mx.array([prompt[-T:]])), c, capture=T > 1)
        mx.eval(model.lm_logits(model.final_norm(out)), [s.states for s in snaps.values()])
        return time.perf_counter() - t0

    def draft(logits: Any) -> float:
        from mlx_lm.models.cache import KVCache

        mc = KVCache()
        hid = model.final_norm(h[:, -1:])
        mx.eval(hid)
        t0 = time.perf_counter()
        g = model.mtp(hid, model.embed(mx.array([[prompt[-1]]])), mc)
        mx.eval(mx.argmax(logits(g)))
        return time.perf_counter() - t0

    def med(fn: Any, *a: Any) -> float:
        fn(*a)
        return statistics.median(fn(*a) for _ in range(trials))

    decode = med(forward, 1)
    out = {"decode_ms": 1000 * decode, "draft_over_decode": med(draft, worker.head.vocab.logits) / decode,
           "draft_whole_vocab_over_decode": med(draft, model.lm_logits) / decode}
    for k in depths:
        out[f"verify_k{k}_over_decode"] = med(forward, k + 1) / decode
    return out


def bench_engine(
    model_path: Path,
    *,
    max_tokens: int = 128,
    prompts: int = 8,
    depths: list[int] | None = None,
    mtp_pre_norm: bool = False,
    contexts: list[int] | None = None,
    context_reps: int = CONTEXT_REPS,
    draft_vocab: int | None = None,
    mtp_window: int | None = None,
) -> dict[str, Any]:
    """Every method on the same prompts, interleaved; with `contexts`, also decode after long prompts.
    Where drafts score a subset of the vocabulary (models/draft_vocab.py), the deepest fixed depth and
    auto also run with drafts over the whole vocabulary, on a second engine (`*_whole_vocab`); where
    drafting attends to a window shorter than a long prompt (models/mtp.py), auto also runs with it
    over the whole context (`mtp_auto_whole_window`)."""
    from mlx_lm import load as mlx_load

    depths = depths or [1, 2, 3]
    engine = local_engine(model_path, mtp_pre_norm=mtp_pre_norm, draft_vocab=draft_vocab, mtp_window=mtp_window)
    if not engine.has_mtp:
        raise ValueError(f"{model_path} has no MTP head to benchmark")
    vocab = engine.pipeline.stages[-1].head.vocab
    window = engine.pipeline.stages[-1].head.mtp_window
    whole = None if vocab.whole else local_engine(model_path, mtp_pre_norm=mtp_pre_norm, draft_vocab=0,
                                                  mtp_window=mtp_window)
    ref_model, ref_tok = mlx_load(str(model_path))
    texts = bench_prompts(prompts)
    encoded = [engine.tokenizer.encode(t) for t in texts]
    runs: dict[str, int | str] = {"no_mtp": 0, **{f"mtp_k{k}": k for k in depths}, "mtp_auto": AUTO}
    kmax = max(depths)
    whole_runs: dict[str, int | str] = {f"mtp_k{kmax}_whole_vocab": kmax, "mtp_auto_whole_vocab": AUTO} if whole else {}
    methods = ["mlx_lm", *runs, *whole_runs]
    speeds: dict[str, list[float]] = {m: [] for m in methods}
    outputs: dict[str, list[list[int]]] = {m: [] for m in methods}
    drafted = {k: 0 for k in depths}
    accepted = {k: 0 for k in depths}
    per_position: dict[int, list[float]] = {}
    auto_depths: dict[int, int] = {}
    # Warm up every path once (compilation, allocator).
    time_mlx_lm(ref_model, ref_tok, encoded[0], 8)
    for depth in runs.values():
        _time_engine(engine, encoded[0], 8, depth)
    for depth in whole_runs.values():
        _time_engine(whole, encoded[0], 8, depth)
    _time_engine(engine, encoded[0], 8, AUTO, PROCESSORS)
    speeds["mtp_auto_processors"] = []
    def cell(name: str, prompt: list[int]) -> None:
        if name == "mlx_lm":
            toks, tps = time_mlx_lm(ref_model, ref_tok, prompt, max_tokens)
        elif name == "mtp_auto_processors":  # penalties and logprobs change the output (not compared)
            speeds[name].append(_time_engine(engine, prompt, max_tokens, AUTO, PROCESSORS)[1])
            return
        elif name in whole_runs:
            toks, tps, _ = _time_engine(whole, prompt, max_tokens, whole_runs[name])
        else:
            k = runs[name]
            toks, tps, stats = _time_engine(engine, prompt, max_tokens, k)
            if name == "mtp_auto":
                for d, n in stats.depths.items():
                    auto_depths[d] = auto_depths.get(d, 0) + n
            elif k:
                drafted[k] += stats.drafted
                accepted[k] += stats.accepted
                pos = per_position.setdefault(k, [0.0] * k)
                for i, a in enumerate(stats.accepted_per_position):
                    pos[i] += a
        outputs[name].append(toks)
        speeds[name].append(tps)

    # Each prompt times every method once, in an order rotated by one per prompt, so that no method
    # always runs first (or right after another) while the machine drifts.
    cells = [*methods, "mtp_auto_processors"]
    for i, prompt in enumerate(encoded):
        for name in cells[i % len(cells):] + cells[:i % len(cells)]:
            cell(name, prompt)
    tok_s = {m: round(statistics.mean(v), 2) for m, v in speeds.items()}
    best = max(depths, key=lambda k: tok_s[f"mtp_k{k}"])
    identical = all(outputs[m] == outputs["mlx_lm"] for m in methods)
    result = {
        "model": str(model_path),
        "blas": blas.info().to_dict(), "cpu_jit": cpu_jit.info(),
        "mtp_hidden": "pre_norm" if mtp_pre_norm else "post_norm",
        "prompts": len(encoded),
        "max_tokens": max_tokens,
        "identical": identical,
        "identical_per_method": {m: outputs[m] == outputs["mlx_lm"] for m in methods},
        "tok_s": tok_s,
        "draft_vocab": vocab.describe(),
        "mtp_window": window or 0,
        "acceptance": {str(k): round(accepted[k] / drafted[k], 4) if drafted[k] else 0.0 for k in depths},
        "acceptance_per_position": {
            str(k): [round(a / (drafted[k] / k), 4) if drafted[k] else 0.0 for a in per_position.get(k, [])]
            for k in depths
        },
        "best_k": best,
        "auto_depths": {str(k): v for k, v in sorted(auto_depths.items())},  # rounds by drafts carried
        "ratios": {
            "no_mtp_vs_mlx_lm": round(tok_s["no_mtp"] / tok_s["mlx_lm"], 3),
            "best_mtp_vs_no_mtp": round(tok_s[f"mtp_k{best}"] / tok_s["no_mtp"], 3),
            "auto_vs_no_mtp": round(tok_s["mtp_auto"] / tok_s["no_mtp"], 3),
            "auto_vs_best_fixed": round(tok_s["mtp_auto"] / max(tok_s["no_mtp"], tok_s[f"mtp_k{best}"]), 3),
            "processors_vs_plain_auto": round(tok_s["mtp_auto_processors"] / tok_s["mtp_auto"], 3),
            **{f"mtp_k{k}_vs_no_mtp": round(tok_s[f"mtp_k{k}"] / tok_s["no_mtp"], 3) for k in depths},
            **({f"draft_vocab_k{kmax}_vs_whole": round(tok_s[f"mtp_k{kmax}"] / tok_s[f"mtp_k{kmax}_whole_vocab"], 3),
                "draft_vocab_auto_vs_whole": round(tok_s["mtp_auto"] / tok_s["mtp_auto_whole_vocab"], 3)}
               if whole else {}),
        },
        "cost_terms": {k: round(v, 3) for k, v in _cost_terms(engine, encoded[0], depths).items()},
    }
    if contexts:
        unwindowed = (local_engine(model_path, mtp_pre_norm=mtp_pre_norm, draft_vocab=draft_vocab, mtp_window=0)
                      if window and max(contexts) > window else None)
        try:
            long = result["long_context"] = bench_long_context(engine, ref_model, ref_tok, contexts, context_reps,
                                                               whole_window=unwindowed)
        finally:
            if unwindowed is not None:
                unwindowed.close()
        result["ratios"]["min_auto_vs_no_mtp_long"] = min(r["ratios"]["auto_vs_no_mtp"] for r in long.values())
        result["ratios"]["min_no_mtp_vs_mlx_lm_long"] = min(r["ratios"]["no_mtp_vs_mlx_lm"] for r in long.values())
        result["identical"] = result["identical"] and all(r["identical"] for r in long.values())
    engine.close()
    if whole:
        whole.close()
    return result


LONG_CONTEXT_TOKENS = 96


def long_prompt(tokenizer: Any, length: int) -> list[int]:
    """`length` tokens of held-out standard-library source, files one after another."""
    from ...training.corpus import GENERATED_MARKER, held_out_files, read_text

    tokens: list[int] = []
    for path in held_out_files():
        text = read_text(path)
        if GENERATED_MARKER not in text:
            tokens += tokenizer.encode(text)
        if len(tokens) >= length:
            return tokens[:length]
    raise ValueError(f"the held-out corpus has fewer than {length} tokens")


def paired(a: list[float], b: list[float]) -> tuple[float, list[float]]:
    """The median of the ratios of speeds timed side by side, and those ratios. A decode after a long
    prompt lasts under a second, and this kind of machine sometimes runs one at twice its usual pace:
    one such pair would move a ratio of means."""
    ratios = [round(x / y, 3) if y else 0.0 for x, y in zip(a, b)]
    return (round(statistics.median(ratios), 3) if ratios else 0.0), ratios


def bench_long_context(engine: Engine, ref_model: Any, ref_tok: Any, lengths: list[int], reps: int = CONTEXT_REPS,
                       max_tokens: int = LONG_CONTEXT_TOKENS, whole_window: Engine | None = None) -> dict[str, Any]:
    """Decode speed after prompts of each length: mlx-lm, no MTP and auto depth, side by side. Each
    repetition prefills them all, then times their decodes back to back (`Paused`), the engine
    methods in turn forwards and backwards. mlx-lm's is prefilled last and timed first: its generator
    pauses inside its own stream's context, which must close before the engine computes again. The
    ratios are medians over the repetitions (`paired`); `tok_s` are means. Past the window drafting
    attends to, `whole_window` (an engine whose drafting attends to the whole context) runs auto too."""
    window = engine.pipeline.stages[-1].head.mtp_window
    out: dict[str, Any] = {}
    for length in lengths:
        methods: dict[str, tuple[Engine, int | str]] = {"no_mtp": (engine, 0), "mtp_auto": (engine, AUTO)}
        if whole_window is not None and window and length > window:
            methods["mtp_auto_whole_window"] = (whole_window, AUTO)
        prompt = long_prompt(engine.tokenizer, length)
        speeds: dict[str, list[float]] = {"mlx_lm": [], **{m: [] for m in methods}}
        outputs: dict[str, list[int]] = {}
        identical, depths = True, {}
        for rep in range(reps):
            order = list(methods) if rep % 2 == 0 else list(methods)[::-1]
            with ExitStack() as running:  # a failure leaves no paused decode holding its caches
                ours = {}
                for name in order:
                    runner, depth = methods[name]
                    ours[name] = running.enter_context(closing(Paused(engine_chunks(runner, prompt, max_tokens,
                                                                                    depth))))
                reference = running.enter_context(closing(Paused(mlx_lm_chunks(ref_model, ref_tok, prompt,
                                                                               max_tokens))))
                for name, run in {"mlx_lm": reference, **ours}.items():
                    outputs[name], tps, stats = run.finish()
                    speeds[name].append(tps)
                    if name == "mtp_auto":
                        for d, n in stats.depths.items():
                            depths[d] = depths.get(d, 0) + n
            identical = identical and all(outputs[m] == outputs["mlx_lm"] for m in methods)
        no_mtp, no_mtp_per_rep = paired(speeds["no_mtp"], speeds["mlx_lm"])
        auto, auto_per_rep = paired(speeds["mtp_auto"], speeds["no_mtp"])
        out[str(length)] = {
            "tok_s": {m: round(statistics.mean(v), 2) for m, v in speeds.items()},
            "identical": identical,
            "auto_depths": {str(k): v for k, v in sorted(depths.items())},
            "ratios": {"no_mtp_vs_mlx_lm": no_mtp, "auto_vs_no_mtp": auto},
            "no_mtp_vs_mlx_lm_per_rep": no_mtp_per_rep,
            "auto_vs_no_mtp_per_rep": auto_per_rep,
        }
        if "mtp_auto_whole_window" in methods:
            windowed, windowed_per_rep = paired(speeds["mtp_auto"], speeds["mtp_auto_whole_window"])
            out[str(length)]["ratios"]["auto_vs_whole_window"] = windowed
            out[str(length)]["auto_vs_whole_window_per_rep"] = windowed_per_rep
    return out


def print_engine_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"mtpipe bench engine: {result['prompts']} prompts x {result['max_tokens']} tokens")
    table.add_column("method")
    table.add_column("tok/s", justify="right")
    table.add_column("vs mlx-lm", justify="right")
    table.add_column("vs no-MTP", justify="right")
    table.add_column("acceptance", justify="right")
    table.add_column("identical")
    tok = result["tok_s"]
    for m, v in tok.items():
        k = m.removeprefix("mtp_k")
        table.add_row(
            m,
            f"{v:.1f}",
            f"{v / tok['mlx_lm']:.2f}x",
            f"{v / tok['no_mtp']:.2f}x",
            f"{100 * result['acceptance'][k]:.1f}% {result['acceptance_per_position'][k]}" if k.isdigit() else "",
            str(result["identical_per_method"].get(m, "- (penalized)")),
        )
    console.print(table)
    if result["cost_terms"]:
        console.print(f"cost terms: {result['cost_terms']}")
    console.print(f"draft vocabulary: {result['draft_vocab']}; drafting attends to the last "
                  f"{result['mtp_window'] or 'all'} positions")
    for length, r in result.get("long_context", {}).items():
        console.print(f"after {length} prompt tokens: {r['tok_s']} ratios {r['ratios']} auto depths "
                      f"{r['auto_depths']} identical {r['identical']}")
