"""The API's request defaults from the model's generation_config.json, as vLLM takes them: a request
that leaves its sampling or max_tokens out gets the model's; one that gives them keeps its own."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import LiveServer  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.api.model_defaults import (  # noqa: E402
    generation_config_dir,
    generation_config_source,
    model_defaults,
)
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402
from mtpipe.models.registry import DEMO_MODEL  # noqa: E402

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 7, "do_sample": True}


def model_with(tmp_path: Path, config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_recommended_sampling_is_read_and_bad_values_left_out(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    assert model_defaults(model_with(tmp_path, RECOMMENDED)) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_tokens": 7}
    assert model_defaults(DEMO_MODEL) == {}  # (do_sample alone: vLLM reads no default from it either)
    assert model_defaults(None) == {} and model_defaults(tmp_path / "nowhere") == {}
    with caplog.at_level(logging.WARNING):
        # A top_p of 0 would make every request that leaves top_p out a 400: that one is left out.
        assert model_defaults(model_with(tmp_path, {"top_p": 0, "temperature": 0.7, "max_new_tokens": 9})) == {
            "temperature": 0.7, "max_tokens": 9}
        assert model_defaults(model_with(tmp_path, {"temperature": "hot", "top_k": 2.5, "max_new_tokens": 0})) == {}
        assert model_defaults(model_with(tmp_path, [1, 2])) == {}
        (tmp_path / "generation_config.json").write_text("{not json")
        assert model_defaults(tmp_path) == {}
    assert "top_p" in caplog.text and "hot" in caplog.text and "max_new_tokens" in caplog.text
    # Read as a request's: top_k -1 is off, a temperature too small to sample at is greedy.
    assert model_defaults(model_with(tmp_path, {"top_k": -1, "temperature": 1e-6, "top_p": 0.9})) == {
        "top_k": 0, "temperature": 0.0, "top_p": 0.9}


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> BatchEngine:
    return batch_engine(dense_ckpt, dtype=mx.float32)


@pytest.fixture
def server(engine: BatchEngine, dense_ckpt: Path, tmp_path: Path) -> Iterator[LiveServer]:
    model = tmp_path / "model"
    model.mkdir()
    for f in dense_ckpt.iterdir():
        (model / f.name).symlink_to(f)
    model_with(model, RECOMMENDED)
    with LiveServer(create_app(engine, "m", generation_config=model)) as s:
        yield s


def completion(server: LiveServer, **fields: object) -> dict:
    body = {"prompt": "def fibonacci(n):", "seed": 7, **fields}
    r = server.client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_request_without_sampling_gets_the_models(server: LiveServer) -> None:
    implicit = completion(server, max_tokens=24)
    explicit = completion(server, max_tokens=24, temperature=0.6, top_p=0.95, top_k=20)
    openai_default = completion(server, max_tokens=24, temperature=1.0, top_p=1.0, top_k=0)
    assert implicit["choices"][0]["text"] == explicit["choices"][0]["text"]
    assert implicit["choices"][0]["text"] != openai_default["choices"][0]["text"]
    short = completion(server, temperature=0)  # max_tokens left out: the model's max_new_tokens
    assert short["usage"]["completion_tokens"] == 7 and short["choices"][0]["finish_reason"] == "length"
    assert completion(server, temperature=0, max_tokens=12)["usage"]["completion_tokens"] == 12


def test_a_models_long_default_leaves_room_for_drafts(engine: BatchEngine, dense_ckpt: Path, tmp_path: Path) -> None:
    """A model's max_new_tokens as long as the context would leave `auto` no room to draft; as a
    default (the client asked for no length) it leaves drafts their room instead."""
    from mtpipe.coordinator.api.models import CompletionRequest
    from mtpipe.node.protocol import SamplingParams

    model_with(tmp_path, {"max_new_tokens": 10**6})
    service = create_app(engine, "m", generation_config=tmp_path).state.service
    prompt = [5] * 20
    req = service.generation_request(CompletionRequest(prompt="x"), SamplingParams(), prompt, None, "prompt")
    assert req.mtp_auto and req.mtp_depth > 0
    assert req.max_tokens + req.mtp_depth + len(prompt) <= engine.max_context
    asked = service.generation_request(CompletionRequest(prompt="x"), SamplingParams(), prompt,
                                       engine.max_context - len(prompt), "prompt")
    assert asked.mtp_depth == 0 and not asked.mtp_auto  # (the client's length wins: no room is left to draft)


def test_a_servers_max_tokens_default_comes_before_the_models(engine: BatchEngine, tmp_path: Path) -> None:
    """`mtpipe serve --max-tokens N` (`api.max_tokens`): the length of a request that leaves it out, over
    the model's max_new_tokens; without either, ours (bounded by what is left of the context)."""
    from mtpipe.coordinator.api.defaults import DEFAULT_MAX_TOKENS
    from mtpipe.coordinator.api.models import CompletionRequest
    from mtpipe.coordinator.cli.main import build_parser
    from mtpipe.node.protocol import SamplingParams

    model_with(tmp_path, {"max_new_tokens": 7})
    prompt = [5] * 20

    def length(**options: object) -> int:
        service = create_app(engine, "m", **options).state.service
        return service.generation_request(CompletionRequest(prompt="x"), SamplingParams(), prompt, None,
                                          "prompt").max_tokens

    assert length(generation_config=tmp_path) == 7
    assert length(generation_config=tmp_path, default_max_tokens=11) == length(default_max_tokens=11) == 11
    assert length() == min(DEFAULT_MAX_TOKENS, engine.max_context - len(prompt) - 3)  # (3: auto's drafts)
    for command in (["serve"], ["launch"]):
        assert build_parser().parse_args([*command, "--max-tokens", "9"]).default_max_tokens == 9
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--max-tokens", "0"])


def test_where_the_defaults_come_from_is_chosen_as_with_vllm(tmp_path: Path, dense_ckpt: Path) -> None:
    """--generation-config (api.generation_config): auto, the model's; none (vLLM's vllm), OpenAI's; or a
    directory of one's own, which must hold a generation_config.json (checked where the API runs,
    before any model loads: tests/test_cli.py)."""
    own = model_with(tmp_path, {"temperature": 0.3})
    assert generation_config_dir(generation_config_source("auto"), dense_ckpt) == dense_ckpt
    assert generation_config_dir(None, dense_ckpt) == dense_ckpt
    for none in ("none", "vllm"):
        assert generation_config_dir(generation_config_source(none), dense_ckpt) is None
    assert generation_config_dir(generation_config_source(str(own)), dense_ckpt) == own
    assert model_defaults(generation_config_dir("none", own)) == {}
    for bad in ("openai", str(tmp_path / "nowhere"), str(own / "generation_config.json")):
        with pytest.raises(ValueError, match="neither auto, none"):
            generation_config_source(bad)


def test_a_front_process_takes_its_defaults_from_where_it_is_told(dense_ckpt: Path, tmp_path: Path) -> None:
    """`mtpipe serve` hands the chosen directory to its API process; without one, OpenAI's defaults."""
    from mtpipe.coordinator.api.front import front_spec

    own = model_with(tmp_path, RECOMMENDED)
    spec = front_spec(dense_ckpt, "127.0.0.1", 0, None, "m", default_mtp_depth=None, max_concurrency=2,
                      max_body_bytes=None, generation_config=own)
    assert spec.model_path == str(dense_ckpt) and spec.generation_config == str(own)
    assert front_spec(dense_ckpt, "127.0.0.1", 0, None, "m", default_mtp_depth=None, max_concurrency=2,
                      max_body_bytes=None).generation_config is None
