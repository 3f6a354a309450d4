"""`mtpipe bench engine`'s timing: what a decode speed counts, and decodes after long prompts timed back to back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load

from mtpipe.coordinator.bench import engine as bench
from mtpipe.coordinator.engine.build import local_engine


def clocked(chunks: list[tuple[float, list[int]]], clock: list[float], stats: object = None) -> Iterator[tuple[list[int], object]]:
    """Chunks handed back at the given times (`clock[0]` is what perf_counter reads meanwhile); the last
    carries `stats`, as the engine's last chunk does."""
    for i, (at, tokens) in enumerate(chunks):
        clock[0] = at
        yield tokens, stats if i == len(chunks) - 1 else None


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    return now


def test_timed_counts_the_tokens_after_the_first(clock: list[float]) -> None:
    # A prompt chunk without tokens, the first token at t=1, then rounds of 2 and 1 tokens.
    tokens, tps, _ = bench.timed(clocked([(0.5, []), (1.0, [5]), (2.0, [6, 7]), (4.0, [8])], clock))
    assert tokens == [5, 6, 7, 8] and tps == pytest.approx(3 / 3.0)


def test_timed_without_a_second_chunk_has_no_speed(clock: list[float]) -> None:
    assert bench.timed(clocked([], clock)) == ([], 0.0, None)
    assert bench.timed(clocked([(1.0, [5])], clock, stats="s")) == ([5], 0.0, "s")


def test_paused_decode_that_ends_at_its_first_token_keeps_its_stats(clock: list[float]) -> None:
    run = bench.Paused(clocked([(0.5, []), (1.0, [5])], clock, stats="s"))
    assert run.finish() == ([5], 0.0, "s")


def test_paused_decode_is_timed_from_its_first_round_after_the_pause(clock: list[float]) -> None:
    # The first token comes before the pause; the round after it was computed during the pause
    # (handed back at once, t=10): the clock starts there, and the tokens it carried do not count.
    run = bench.Paused(clocked([(1.0, [1]), (10.0, [2, 3]), (11.0, [4]), (12.0, [5, 6])], clock))
    assert run.tokens == [1]
    tokens, tps, _ = run.finish()
    assert tokens == [1, 2, 3, 4, 5, 6] and tps == pytest.approx(3 / 2.0)


def test_paired_ratios_are_the_median_of_each_pair() -> None:
    # One pair timed while the machine ran at twice its pace moves a ratio of means, not the median.
    assert bench.paired([100.0, 100.0, 200.0, 100.0], [100.0, 98.0, 100.0, 101.0]) == (1.01, [1.0, 1.02, 2.0, 0.99])
    assert bench.paired([], []) == (0.0, []) and bench.paired([1.0], [0.0]) == (0.0, [0.0])


def test_long_context_decodes_are_paired_and_identical(dense_ckpt: Path) -> None:
    """Past the window drafting attends to (32 here), auto also runs attending to the whole context."""
    engine = local_engine(dense_ckpt, dtype=mx.float32, mtp_window=32)
    whole = local_engine(dense_ckpt, dtype=mx.float32, mtp_window=0)
    model, tok = mlx_load(str(dense_ckpt))
    stream = mx.default_stream(mx.default_device())
    result = bench.bench_long_context(engine, model, tok, [24, 40], reps=2, max_tokens=12, whole_window=whole)
    assert set(result) == {"24", "40"}
    assert "mtp_auto_whole_window" not in result["24"]["tok_s"]
    assert len(result["40"]["auto_vs_whole_window_per_rep"]) == 2 and result["40"]["ratios"]["auto_vs_whole_window"] > 0
    for r in result.values():
        assert r["identical"], r  # every method's tokens equal mlx-lm's, after being paused
        assert all(v > 0 for v in r["tok_s"].values())
        assert len(r["auto_vs_no_mtp_per_rep"]) == len(r["no_mtp_vs_mlx_lm_per_rep"]) == 2
        assert r["ratios"]["auto_vs_no_mtp"] == pytest.approx(sum(r["auto_vs_no_mtp_per_rep"]) / 2, abs=1e-3)
        assert sum(int(n) for n in r["auto_depths"].values()) > 0
    for e in (engine, whole):  # every paused decode ran to its end and was released
        assert not e.pipeline.stages[-1].sequences
        e.pipeline.close()
    assert mx.default_stream(mx.default_device()) == stream  # mlx-lm's paused decode left its stream


def test_a_failure_between_paused_decodes_releases_them(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = local_engine(dense_ckpt, dtype=mx.float32)
    model, tok = mlx_load(str(dense_ckpt))
    stream = mx.default_stream(mx.default_device())

    def fail(*args: object, **kwargs: object) -> Iterator[tuple[list[int], None]]:
        raise RuntimeError("mlx-lm failed")
        yield

    monkeypatch.setattr(bench, "mlx_lm_chunks", fail)  # after both engine decodes were prefilled
    try:
        bench.bench_long_context(engine, model, tok, [24], reps=1, max_tokens=12)
    except RuntimeError as e:  # its traceback keeps the failed call's frames, and what they hold, alive
        assert str(e) == "mlx-lm failed" and e.__traceback__ is not None
        assert not engine.pipeline.stages[-1].sequences
    else:
        pytest.fail("the failure did not propagate")
    assert mx.default_stream(mx.default_device()) == stream


def test_bench_prefill_tiny(dense_ckpt: Path) -> None:
    """`mtpipe bench prefill`: every length timed against mlx-lm, the same greedy first token."""
    import json

    from mtpipe.coordinator.bench.prefill import bench_prefill

    result = bench_prefill(dense_ckpt, lengths=[40, 100], reps=1)
    json.dumps(result)  # the CLI prints it as one JSON line
    assert set(result["lengths"]) == {"40", "100"} and "blas" in result
    for r in result["lengths"].values():
        assert r["mtpipe_tok_s"] > 0 and r["mlx_lm_tok_s"] > 0 and r["mtpipe_vs_mlx_lm"] > 0
        assert r["first_token_identical"] is True
    assert set(result["ratios"]) == {"prefill_40_vs_mlx_lm", "prefill_100_vs_mlx_lm"}
    with pytest.raises(ValueError, match="positive"):
        bench_prefill(dense_ckpt, lengths=[], reps=1)


def test_the_ring_bench_compares_c8_also_with_the_single_nodes_faster_method() -> None:
    """Auto against auto flatters the ring where the single node runs faster without drafts at c8."""
    from mtpipe.coordinator.bench.serve_nodes import ratios

    tok_s = {"single": {"auto": {"1": 100.0, "8": 400.0}, "no_mtp": {"1": 90.0, "8": 500.0}},
             "pipe2": {"auto": {"1": 110.0, "8": 300.0}, "no_mtp": {"1": 60.0, "8": 200.0}}}
    r = ratios(tok_s, ring=25.0, nodes=[2], top=8)
    assert r["pipe2_c8_vs_single_c8"] == 0.75 and r["pipe2_c8_vs_single_c8_best"] == 0.6
    assert r["pipe2_c8_no_mtp_vs_single_c8_no_mtp"] == 0.4 and r["pipe2_auto_vs_mlx_lm_ring"] == 4.4
