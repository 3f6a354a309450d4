"""`mtpipe bench serve` on a tiny checkpoint: every level runs and the result has the promised shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import LiveServer

from mtpipe.coordinator.bench.serve import bench_serve, waves
from mtpipe.coordinator.bench.streams import percentile
from mtpipe.coordinator.bench.serve_api import stream_completions
from mtpipe.coordinator.bench.streams import Decode, aggregate_tps, decode_window


def test_aggregate_excludes_tokens_before_every_stream_started() -> None:
    # Stream b's first token comes at t=2: only tokens after it count, over 2..4.
    a = ([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0])
    b = ([2.0, 3.0, 4.0], [1.0, 2.0, 2.0])
    assert aggregate_tps([a, b]) == pytest.approx((2 + 4) / 2)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == 2.0


def test_levels_decode_the_same_prompts_in_waves() -> None:
    # Every level covers every prompt, c streams at a time; the last wave wraps around to stay at c.
    assert waves(4, 1) == [[0], [1], [2], [3]]
    assert waves(4, 2) == [[0, 1], [2, 3]] and waves(4, 4) == [[0, 1, 2, 3]]
    assert waves(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    # A level's figure is its waves' tokens over their seconds, not a mean of their rates.
    total = decode_window([([0.0, 1.0], [1.0, 10.0])]) + decode_window([([0.0, 4.0], [1.0, 10.0])])
    assert total == Decode(20.0, 5.0) and total.tps == pytest.approx(4.0)
    assert Decode().tps == 0.0


def test_the_clients_read_events_however_the_chunks_fall() -> None:
    """The bench's clients read the stream's HTTP chunks and events themselves: an event split over
    chunks, two events in one chunk, the usage; an error status is an error."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    first, second = event({"choices": [{"text": "Hello"}]}), event({"choices": [{"text": " world!"}]})
    parts = [first[:9], first[9:] + second, event({"choices": [{"text": "", "finish_reason": "length"}]}),
             event({"choices": [], "usage": {"completion_tokens": 3}}), "data: [DONE]\n\n"]
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> object:
        if body["prompt"] == [0]:
            return JSONResponse({"error": {"message": "no"}}, status_code=400)

        async def chunks():  # each yield goes as one HTTP chunk
            for part in parts:
                yield part.encode()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    with LiveServer(app) as s:
        rec, = stream_completions(s.url, [[1, 2]], 3, 0)
        assert (rec.text, rec.chars, rec.completion_tokens, rec.finish_reason) == ("Hello world!", [5, 7], 3, "length")
        assert rec.token_counts() == pytest.approx([3 * 5 / 12, 3 * 7 / 12])
        with pytest.raises(RuntimeError, match="HTTP 400"):
            stream_completions(s.url, [[0]], 3, 0)


def test_bench_serve_tiny(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.coordinator.bench import serve

    ran: list[str] = []
    for name in ("engine_run", "api_run", "mlx_lm_run"):
        def spy(*args, fn=getattr(serve, name), name=name, **kwargs):
            method = next((a for a in args if a in ("no_mtp", "auto")), "batch")
            ran.append(f"{name} {method}")
            return fn(*args, **kwargs)

        monkeypatch.setattr(serve, name, spy)
    result = bench_serve(dense_ckpt, concurrency=[1, 2], max_tokens=8, gap=False, closed_requests=2)
    # The 2 waves at c=1: every level and method back to back, the second wave the other way round.
    order = ["engine_run no_mtp", "api_run no_mtp", "engine_run auto", "api_run auto", "mlx_lm_run batch"]
    assert any(ran[i:i + 10] == order + order[::-1] for i in range(len(ran))), ran
    json.dumps(result)  # the CLI prints it as one JSON line
    for level in ("engine", "api"):
        for method in ("no_mtp", "auto"):
            cells = result["tok_s"][level][method]
            assert set(cells) == {"1", "2"} and all(v > 0 for v in cells.values()), (level, method, cells)
    assert set(result["mlx_lm_batch"]) == {"1", "2"} and all(v > 0 for v in result["mlx_lm_batch"].values())
    ratios = result["ratios"]
    for key in ("c8_no_mtp_vs_mlx_lm", "c8_auto_vs_mlx_lm", "c8_vs_c1_no_mtp", "api_vs_engine_c8"):
        assert ratios[key] > 0, key
    assert ratios["concurrency"] == 2 and "note" in ratios
    loop = result["closed_loop"]  # (serve_steady.py; at c=2, the c8 ratios' level here)
    assert set(loop["tok_s"]) == {"no_mtp", "auto", "mlx_lm"} and loop["requests_per_client"] == 2
    assert all(set(cells) == {"2"} and cells["2"] > 0 for cells in loop["tok_s"].values())  # (c=1 is the waves')
    for key, a, b in (("closed_c8_no_mtp_vs_mlx_lm", "no_mtp", "mlx_lm"),
                      ("closed_c8_auto_vs_mlx_lm", "auto", "mlx_lm"),
                      ("closed_c8_auto_vs_no_mtp", "auto", "no_mtp")):
        assert ratios[key] == pytest.approx(loop["tok_s"][a]["2"] / loop["tok_s"][b]["2"], rel=1e-2), key
    assert isinstance(result["identical"], bool) and result["identity"]["concurrency"] == 2
    assert set(result["identity"]["closed_loop"]) == {"no_mtp", "auto"}
    assert set(result["identity"]["per_method"]) == {"no_mtp", "auto"}
    assert isinstance(result["identity"]["mlx_lm_batch"], bool)  # mlx-lm's batch tokens against each alone
    assert result["waves"] == {"1": 2, "2": 1}
    assert result["prefill_gap"] is None and "blas" in result
    assert result["api"] == "a process of its own"  # as `mtpipe serve` runs it


def test_bench_serve_sampled_tiny(dense_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--temperature`: every level samples, each prompt with its own seed; the seeded tokens are the same
    in a batch, at every depth, as alone, so identity holds; mlx-lm samples too."""
    import importlib

    from mtpipe.coordinator.bench import serve

    mlx_generate = importlib.import_module("mlx_lm.generate")  # (the package's `generate` is a function)

    opened: list[tuple[float, int | None]] = []
    open_request = serve._request

    def spy(engine, prompt, max_tokens, method, params=None):
        opened.append((params.temperature, params.seed) if params else (0.0, None))
        return open_request(engine, prompt, max_tokens, method, params)

    samplers: list[object] = []
    batch_generate = mlx_generate.batch_generate
    monkeypatch.setattr(serve, "_request", spy)
    monkeypatch.setattr(mlx_generate, "batch_generate", lambda *a, **k: (samplers.append(k.get("sampler")),
                                                                          batch_generate(*a, **k))[1])
    result = bench_serve(dense_ckpt, concurrency=[2], max_tokens=8, gap=False, api=True, temperature=1.0,
                         closed_requests=2, api_process=False)
    assert result["temperature"] == 1.0 and result["identical"] is True
    assert result["api"] == "the engine's process"
    assert result["identity"]["closed_loop"] == {"no_mtp": True, "auto": True}  # seeded, in the closed loop too
    assert set(result["identity"]["per_method"]) == {"no_mtp", "auto"}
    for level in ("engine", "api"):
        for method in ("no_mtp", "auto"):
            assert result["tok_s"][level][method]["2"] > 0, (level, method)
    assert opened and all(t == 1.0 and seed in (serve.SEED_BASE, serve.SEED_BASE + 1) for t, seed in opened)
    assert samplers and all(callable(s) for s in samplers)
    with pytest.raises(ValueError, match="temperature"):
        bench_serve(dense_ckpt, concurrency=[1], temperature=3.0)
    with pytest.raises(ValueError, match="at least 2 requests per client"):
        bench_serve(dense_ckpt, concurrency=[2], closed_requests=1)


def test_bench_serve_without_the_closed_loop(dense_ckpt: Path) -> None:
    result = bench_serve(dense_ckpt, concurrency=[1], max_tokens=4, gap=False, api=False, mlx_lm=False, closed=False)
    assert result["closed_loop"] is None and result["identity"]["closed_loop"] == {}
    assert not any(k.startswith("closed_") for k in result["ratios"])
    assert result["tok_s"]["engine"]["no_mtp"]["1"] > 0
