"""`mtpipe bench serve`'s table and lines for a person (the JSON is the record)."""

from __future__ import annotations

from typing import Any


def print_serve_report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    tok, mlx = result["tok_s"], result["mlx_lm_batch"]
    how = f"sampled at temperature {result['temperature']}" if result.get("temperature") else "greedy"
    table = Table(title=f"mtpipe bench serve: aggregate decode tok/s, {result['max_tokens']} tokens per stream, {how}")
    columns = [("engine", m) for m in tok["engine"]] + [("api", m) for m in tok["api"]]
    table.add_column("streams", justify="right")
    for level, m in columns:
        table.add_column(f"{level} {m}", justify="right")
    table.add_column("mlx-lm batch", justify="right")
    table.add_column("no_mtp / mlx-lm", justify="right")
    table.add_column("auto / mlx-lm", justify="right")
    for c in map(str, result["concurrency"]):
        ref = mlx.get(c)
        cells = [f"{tok[level][m][c]:.1f}" for level, m in columns]
        rel = [f"{tok['engine'][m][c] / ref:.2f}x" if ref else "-" for m in ("no_mtp", "auto")]
        table.add_row(c, *cells, f"{ref:.1f}" if ref else "-", *rel)
    console.print(table)
    if tok.get("single_stream"):
        console.print(f"one stream through the per-sequence engine: {tok['single_stream']}")
    if result.get("closed_loop"):
        loop = result["closed_loop"]
        console.print(f"closed loop (c clients, {loop['requests_per_client']} requests each of half to 1.5x the max "
                      f"tokens, the next sent as the last ends), tok/s while every slot is taken: {loop['tok_s']}")
    console.print(f"ratios: {result['ratios']}")
    ident = result["identity"]
    console.print(f"{how} outputs at c={ident['concurrency']} equal c=1: {result['identical']} {ident['per_method']}")
    if result["prefill_gap"]:
        g = result["prefill_gap"]
        console.print(f"prefill gap: {g['prompt_tokens']}-token prompt in {g['prefill_s']:.2f} s; "
                      f"{g['gaps']} gaps of {g['streams_through_window']}/{g['streams']} streams: median "
                      f"{g['median_ms']} ms, p99 {g['p99_ms']} ms, max {g['max_ms']} ms "
                      f"(p99/median {g['gap_p99_over_median']}; before: median {g['baseline_median_ms']} ms)")
