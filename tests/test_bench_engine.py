"""`mtpipe bench engine`'s timing: what a decode speed counts, and decodes after long prompts timed back to back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load

from mtpipe.coordinator.bench import engine as bench
from mtpipe.coordinator.engine.build import local_engine


def clocked(chunks: list[tuple[float, list[int]]], clock: list[float]) -> Iterator[tuple[list[int], None]]:
    """Chunks handed back at the given times: `clock[0]` is what perf_counter reads meanwhile."""
    for at, tokens in chunks:
        clock[0] = at
        yield tokens, None


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    return now


def test_timed_counts_the_tokens_after_the_first(clock: list[float]) -> None:
    # A prompt chunk without tokens, the first token at t=1, then rounds of 2 and 1 tokens.
    tokens, tps, _ = bench.timed(clocked([(0.5, []), (1.0, [5]), (2.0, [6, 7]), (4.0, [8])], clock))
    assert tokens == [5, 6, 7, 8] and tps == pytest.approx(3 / 3.0)


def test_paused_decode_is_timed_from_its_first_round_after_the_pause(clock: list[float]) -> None:
    # The first token comes before the pause; the round after it was computed during the pause
    # (handed back at once, t=10): the clock starts there, and the tokens it carried do not count.
    run = bench.Paused(clocked([(1.0, [1]), (10.0, [2, 3]), (11.0, [4]), (12.0, [5, 6])], clock))
    assert run.tokens == [1]
    tokens, tps, _ = run.finish()
    assert tokens == [1, 2, 3, 4, 5, 6] and tps == pytest.approx(3 / 2.0)


def test_long_context_decodes_are_paired_and_identical(dense_ckpt: Path) -> None:
    engine = local_engine(dense_ckpt, dtype=mx.float32)
    model, tok = mlx_load(str(dense_ckpt))
    result = bench.bench_long_context(engine, model, tok, [24, 40], reps=2, max_tokens=12)
    assert set(result) == {"24", "40"}
    for r in result.values():
        assert r["identical"], r  # every method's tokens equal mlx-lm's, after being paused
        assert all(v > 0 for v in r["tok_s"].values()) and len(r["auto_vs_no_mtp_per_rep"]) == 2
        assert sum(int(n) for n in r["auto_depths"].values()) > 0
    assert not engine.pipeline.stages[-1].sequences  # every paused decode ran to its end and was released
