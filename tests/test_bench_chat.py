"""`mtpipe bench chat` on a tiny checkpoint: each turn after the first reuses the last prompt, every side
sees the same conversation, and the report holds what the note quotes."""

from __future__ import annotations

from pathlib import Path

from mtpipe.coordinator.bench.chat import bench_chat


def test_the_chat_bench_reuses_each_last_prompt(dense_ckpt: Path) -> None:
    result = bench_chat(dense_ckpt, turns=3, turn_tokens=24, reply_tokens=4)
    rows = result["rows"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and result["identical"]
    assert rows[0]["cached_tokens"] == {"whole": 0, "cached": 0, "mlx_lm": 0}
    assert all(r["cached_tokens"]["whole"] == 0 for r in rows)
    for before, r in zip(rows, rows[1:]):  # all of the last prompt but its last token
        assert r["cached_tokens"]["cached"] == before["prompt_tokens"] - 1
        assert r["prompt_tokens"] > before["prompt_tokens"] + 24
    assert all(set(r["ttft_ms"]) == {"whole", "cached", "mlx_lm"} and min(r["ttft_ms"].values()) > 0 for r in rows)
    assert set(result["ratios"]) == {"cached_vs_whole_ttft", "cached_vs_mlx_lm_ttft", "mlx_lm_vs_whole_ttft"}


def test_the_chat_bench_over_nodes_reuses_each_last_prompt_there(dense_ckpt: Path) -> None:
    """The same over a ring of node processes: the nodes keep the prefixes; the whole side, on the same
    engine with its kept prefixes set aside, reuses none."""
    result = bench_chat(dense_ckpt, turns=3, turn_tokens=24, reply_tokens=4, mlx_lm=False, nodes=2)
    rows = result["rows"]
    assert result["identical"] and result["nodes"] == 2
    for before, r in zip(rows, rows[1:]):
        assert r["cached_tokens"] == {"whole": 0, "cached": before["prompt_tokens"] - 1}
    assert set(result["ratios"]) == {"cached_vs_whole_ttft"}


def test_mlx_lms_side_goes_on_from_exactly_what_its_cache_holds(dense_ckpt: Path) -> None:
    """mlx-lm feeds each token as it hands it out: the next turn goes on from all of them, and its
    reply is the reply of a fresh cache over the whole prompt."""
    from mlx_lm import load

    from mtpipe.coordinator.bench.chat import MlxLmChat

    model, tokenizer = load(str(dense_ckpt))
    chat = MlxLmChat(model, tokenizer)
    first = tokenizer.encode("def fibonacci(n):")
    chat.turn(first, 6)
    assert {c.offset for c in chat.cache if hasattr(c, "offset")} == {len(chat.held)}
    assert chat.held[: len(first)] == first and len(chat.held) > len(first)
    following = chat.held + tokenizer.encode(" and then")
    _, reused = chat.turn(following, 6)
    fresh = MlxLmChat(model, tokenizer)
    fresh.turn(following, 6)
    assert reused == len(following) - len(tokenizer.encode(" and then")) and chat.held == fresh.held
