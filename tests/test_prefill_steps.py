"""Prompts taken in together: a short prompt beside a long one is not padded to the long one's width."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from helpers import PROMPTS

from mtpipe.coordinator.bench.streams import Recorder
from mtpipe.coordinator.engine import scheduler as plan
from mtpipe.coordinator.engine.build import batch_engine
from mtpipe.coordinator.engine.request import GenerationRequest


@pytest.mark.parametrize("needs, width, narrowed, expected", [
    ([2999, 7, 7], 512, 0, 7),  # the short prompts' chunks, the long one's 7 tokens beside them
    ([2992, 1, 1], 512, 1, 1),  # their last tokens
    ([2991, 1], 512, 2, 512),  # then the long one at full width, whatever still waits
    ([600, 200], 512, 0, 512),  # nothing small beside it: full width
    ([1, 1, 1], 1, 0, 1),
    ([200, 9], 128, 0, 9),  # while rows decode the width is a round's worth of tokens
    ([40, 9], 36, 0, 36),  # a width about as cheap as a narrow one: not narrowed
])
def test_the_width_of_a_prefill_step(needs: list[int], width: int, narrowed: int, expected: int) -> None:
    assert plan.fill_width(needs, width, narrowed) == expected


def test_short_prompts_beside_a_long_one_finish_in_narrow_steps_with_their_own_tokens(dense_ckpt: Path) -> None:
    engine = batch_engine(dense_ckpt, dtype=mx.float32, prefix_cache=0)
    try:
        text = list(engine.tokenizer.encode("".join(PROMPTS))) * 8
        long, shorts = text[:1500], [text[50 + 7 * i : 58 + 7 * i] for i in range(4)]
        alone = [engine.complete(GenerationRequest(p, max_tokens=4)).tokens for p in shorts]
        widths: list[int] = []
        stage = engine.stages[0]
        fill = stage.fill

        def spy(reqs: list[Any], x: Any) -> Any:
            widths.append(max(len(r.tokens) for r in reqs))
            return fill(reqs, x)

        stage.fill = spy
        recs = [Recorder() for _ in range(5)]

        def open_all() -> None:  # (on the MLX thread: all five are in its inbox before its next unit)
            for prompt, rec in zip([long, *shorts], recs):
                engine.open(GenerationRequest(prompt, max_tokens=4), rec)

        engine.thread.call(open_all)
        for rec in recs:
            rec.wait()
        assert widths[:2] == [7, 1]  # the short prompts' chunks, then their last tokens: not 512 wide
        assert max(widths) > 7  # then the long prompt at its own width
        assert [rec.tokens for rec in recs[1:]] == alone
    finally:
        engine.close()
