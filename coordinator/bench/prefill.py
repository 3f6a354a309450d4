"""`mtpipe bench prefill`: time to the first token after prompts of several lengths, mtpipe against
mlx-lm's `stream_generate`, alternated so machine noise hits both alike.

Each figure is prompt tokens over the time from the request to its first token (the prefill and one
forward more). mtpipe runs the request as a user's default does (auto MTP depth, whose head also
takes in the prompt); both take the same prompt tokens (held-out library source, as the long-context
engine bench uses) and both pick the first token greedily, which the report compares.
"""

from __future__ import annotations

import statistics
import time
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from ...models import blas, cpu_jit
from ..engine.build import local_engine
from ..engine.engine import Engine
from ..engine.request import AUTO, GenerationRequest, resolve_depth
from .engine import long_prompt

DEFAULT_LENGTHS = (512, 2048)
REPS = 5


def time_mtpipe(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the token. Work queued past it (a next verify) finishes before
    this returns, outside the time."""
    drafts, auto = resolve_depth(AUTO, engine.has_mtp)
    start = time.perf_counter()
    result = engine.complete(GenerationRequest(prompt, max_tokens=1, mtp_depth=drafts, mtp_auto=auto))
    seconds = time.perf_counter() - start
    mx.synchronize()
    return seconds, result.tokens[0]


def time_mlx_lm(model: Any, tokenizer: Any, prompt: list[int]) -> tuple[float, int]:
    """The same for mlx-lm: its generator is closed and its queued step finished outside the time."""
    from mlx_lm import stream_generate
    from mlx_lm.generate import generation_stream

    with closing(stream_generate(model, tokenizer, prompt, max_tokens=1)) as responses:
        start = time.perf_counter()
        response = next(responses)
        seconds = time.perf_counter() - start
    mx.synchronize(generation_stream)
    return seconds, response.token


def bench_prefill(model_path: Path | str, *, lengths: list[int] | tuple[int, ...] = DEFAULT_LENGTHS,
                  reps: int = REPS) -> dict[str, Any]:
    """Each length: `reps` alternated pairs after one warm-up of each. tok/s from each side's median
    time; the ratio is the median of the pairs' ratios (what the noise of one moment hits alike)."""
    from mlx_lm import load as mlx_load

    if not lengths or min(lengths) < 1 or reps < 1:
        raise ValueError(f"prompt lengths and reps must be positive, got {list(lengths)} and {reps}")
    engine = local_engine(model_path)
    model, tokenizer = mlx_load(str(model_path))
    out: dict[str, Any] = {"model": str(model_path), "blas": blas.info().to_dict(), "cpu_jit": cpu_jit.info(),
                           "reps": reps, "lengths": {}}
    for length in lengths:
        prompt = long_prompt(engine.tokenizer, length)
        time_mtpipe(engine, prompt)
        time_mlx_lm(model, tokenizer, prompt)
        ours: list[float] = []
        theirs: list[float] = []
        same = True
        pair = [("mtpipe", partial(time_mtpipe, engine, prompt)), ("mlx_lm", partial(time_mlx_lm, model, tokenizer, prompt))]
        for rep in range(reps):
            got = {name: fn() for name, fn in (pair if rep % 2 == 0 else pair[::-1])}
            ours.append(got["mtpipe"][0])
            theirs.append(got["mlx_lm"][0])
            same = same and got["mtpipe"][1] == got["mlx_lm"][1]
        out["lengths"][str(length)] = {
            "mtpipe_tok_s": round(length / statistics.median(ours), 1),
            "mlx_lm_tok_s": round(length / statistics.median(theirs), 1),
            "mtpipe_vs_mlx_lm": round(statistics.median(t / o for o, t in zip(ours, theirs)), 3),
            "first_token_identical": same,
        }
    out["ratios"] = {f"prefill_{n}_vs_mlx_lm": r["mtpipe_vs_mlx_lm"] for n, r in out["lengths"].items()}
    return out


def print_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"mtpipe bench prefill: time to the first token, {result['reps']} alternated pairs")
    for column in ("prompt tokens", "mtpipe tok/s", "mlx-lm tok/s", "mtpipe vs mlx-lm", "same first token"):
        table.add_column(column, justify="right")
    for length, r in result["lengths"].items():
        table.add_row(length, f"{r['mtpipe_tok_s']:.0f}", f"{r['mlx_lm_tok_s']:.0f}", f"{r['mtpipe_vs_mlx_lm']:.2f}x",
                      str(r["first_token_identical"]))
    console.print(table)
    console.print(f"BLAS: {result['blas']}")
