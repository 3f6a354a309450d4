"""A prompt's own tokens scored (vLLM's prompt_logprobs, OpenAI's echo with logprobs): the values are the
model's, read over a whole forward of the prompt by mlx-lm, whatever the chunks, stages or engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers import LiveServer, node_servers  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine, local_engine, ring_engine  # noqa: E402
from mtpipe.coordinator.engine.request import GenerationRequest, RequestError  # noqa: E402
from mtpipe.node.protocol import SamplingParams, Scored, StageError, StepKind, StepOutput, StepRequest  # noqa: E402
from mtpipe.node.stage import check_first_step  # noqa: E402
from mtpipe.node.wire import params_from_pb, params_to_pb, output_to_result, result_to_output  # noqa: E402

MODEL = "tiny"
TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    for a in argv:\n        print(a, file=sys.stderr)\n"


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> BatchEngine:
    eng = batch_engine(dense_ckpt, stages=2, dtype=mx.float32, prefill_chunk=7)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(dense_ckpt: Path) -> Any:
    """log-softmax of the whole prompt's logits, by mlx-lm's own model."""
    from mlx_lm import load

    model, _ = load(str(dense_ckpt))
    model.set_dtype(mx.float32)

    def scores(prompt: list[int]) -> np.ndarray:
        logits = model(mx.array([prompt]))[0].astype(mx.float32)
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return scores


@pytest.fixture(scope="module")
def client(engine: BatchEngine) -> Any:
    with LiveServer(create_app(engine, MODEL)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def prompt_of(engine: Any) -> list[int]:
    return engine.tokenizer.encode(TEXT)


def scored(engine: Any, prompt: list[int], max_tokens: int = 4, top: int = 3, **kw: Any) -> tuple[list[Scored], Any]:
    chunks = list(engine.generate(GenerationRequest(prompt, max_tokens, SamplingParams(prompt_logprobs=top), **kw)))
    assert chunks[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    return chunks[0].prompt_logprobs, chunks


def check(got: list[Scored], want: np.ndarray, prompt: list[int], top: int) -> None:
    """Every token but the first scored by the positions before it, as the whole forward scores it."""
    assert len(got) == len(prompt) - 1
    values = np.array([s.logprob for s in got])
    np.testing.assert_allclose(values, want[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    for s, row, token in zip(got, want, prompt[1:]):
        assert 1 + (row > row[token] + 1e-4).sum() <= s.rank <= 1 + (row > row[token] - 1e-4).sum()
        assert len(s.top) == top  # the most likely, most likely first, each with its own value
        np.testing.assert_allclose([v for _, v in s.top], np.sort(row)[::-1][:top], atol=1e-4)
        np.testing.assert_allclose([row[i] for i, _ in s.top], [v for _, v in s.top], atol=1e-4)


def test_scores_are_the_whole_forwards_over_chunks_and_stages(engine: BatchEngine, reference: Any) -> None:
    prompt = prompt_of(engine)
    assert len(prompt) > 3 * engine.prefill_chunk  # (several chunks, the last token alone)
    want = reference(prompt)
    plain = engine.complete(GenerationRequest(prompt, 4, mtp_depth=0)).tokens
    for depth, auto in ((0, False), (3, True)):
        got, chunks = scored(engine, prompt, mtp_depth=depth, mtp_auto=auto)
        check(got, want, prompt, 3)
        assert [t for c in chunks for t in c.tokens] == plain  # (scoring leaves the output alone)


def test_max_tokens_0_only_scores_and_a_kept_prefix_is_not_taken(engine: BatchEngine, reference: Any) -> None:
    prompt = prompt_of(engine)
    engine.complete(GenerationRequest(prompt, 2))  # (its prompt is kept: a plain request would start from it)
    got, chunks = scored(engine, prompt, max_tokens=0, top=0)
    assert [c.tokens for c in chunks] == [[]] and chunks[-1].finish_reason == "length"
    assert chunks[-1].stats.cached_tokens == 0 and chunks[-1].stats.generation_tokens == 0
    check(got, reference(prompt), prompt, 0)
    with pytest.raises(RequestError, match="0 only to score") as e:
        engine.validate(GenerationRequest(prompt, 0))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError) as e:
        engine.validate(GenerationRequest(prompt, 4, SamplingParams(prompt_logprobs=21)))
    assert e.value.param == "prompt_logprobs"


def test_the_sequence_engine_scores_alike(dense_ckpt: Path, reference: Any) -> None:
    eng = local_engine(dense_ckpt, stages=3, dtype=mx.float32)
    eng.prefill_chunk = 5
    try:
        prompt = prompt_of(eng)
        got, _ = scored(eng, prompt, mtp_depth=2)
        check(got, reference(prompt), prompt, 3)
        got, chunks = scored(eng, prompt[:1], max_tokens=1)  # (a prompt of one token: nothing to score)
        assert got == [] and len(chunks[0].tokens) == 1
    finally:
        eng.close()


@pytest.mark.parametrize("nodes", [1, 2])
def test_over_nodes_the_last_node_scores_the_prompt(dense_ckpt: Path, reference: Any, nodes: int) -> None:
    with node_servers(nodes) as servers:
        eng = ring_engine(dense_ckpt, [s.address for s in servers], dtype="float32")
        eng.prefill_chunk = 6
        try:
            prompt = prompt_of(eng)
            eng.complete(GenerationRequest(prompt, 2))  # (kept on the nodes: not taken by the scored one)
            got, chunks = scored(eng, prompt, mtp_depth=3, mtp_auto=True)
            check(got, reference(prompt), prompt, 3)
            assert chunks[-1].stats.cached_tokens == 0
            got, chunks = scored(eng, prompt, max_tokens=0, top=1)
            check(got, reference(prompt), prompt, 1)
            assert [t for c in chunks for t in c.tokens] == []
        finally:
            eng.close()


def test_a_node_refuses_to_score_from_a_kept_prefix() -> None:
    req = StepRequest("s", 0, StepKind.PREFILL, [1, 2], params=SamplingParams(prompt_logprobs=0), prefix="k")
    with pytest.raises(StageError, match="whole prompt"):
        check_first_step(req, drafts_here=True, has_mtp=False)
    req.prefix = ""
    check_first_step(req, drafts_here=True, has_mtp=False)


def test_scores_cross_the_wire_whole() -> None:
    params = SamplingParams(prompt_logprobs=5)
    assert params_from_pb(params_to_pb(params)) == params
    assert params_from_pb(params_to_pb(SamplingParams())).prompt_logprobs == -1
    out = StepOutput("s", 3, prompt_logprobs=[Scored(-0.5, 1, [(7, -0.5), (2, -1.25)]), Scored(-3.0, 9, [])])
    assert result_to_output(output_to_result(out)).prompt_logprobs == out.prompt_logprobs


# -- the API -------------------------------------------------------------------------------------


def test_echo_with_logprobs_and_max_tokens_0_is_openais_scoring(client: Any, engine: BatchEngine,
                                                                reference: Any) -> None:
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 0 (or 1)."""
    prompt = prompt_of(engine)
    want = reference(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == engine.tokenizer.decode(prompt) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt) and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], want[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and 1 <= len(top) <= 2 and max(top.values()) >= value
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(prompt))]

    # lm-eval's local-completions: a batch of (context + continuation) token ids, max_tokens 1; the continuation's
    # log-likelihood is the sum of token_logprobs[ctxlen:-1], greedy if each is its position's best
    short = prompt[:9]
    batch = client.completions.create(model=MODEL, prompt=[prompt, short], max_tokens=1, echo=True, logprobs=1,
                                      temperature=0)
    for choice, tokens in zip(batch.choices, (prompt, short)):
        got = choice.logprobs.token_logprobs
        assert len(got) == len(tokens) + 1 and choice.text.startswith(engine.tokenizer.decode(tokens))
        loglikelihood = sum(got[5:-1])
        assert abs(loglikelihood - sum(want[i - 1, tokens[i]] for i in range(5, len(tokens)))) < 1e-3
        greedy = all(v == max(top.values()) for v, top in zip(got[5:-1], choice.logprobs.top_logprobs[5:-1]))
        assert greedy == all(want[i - 1].argmax() == tokens[i] for i in range(5, len(tokens)))
    assert batch.choices[0].logprobs.token_logprobs[: len(prompt)] == lp.token_logprobs
    assert batch.usage.completion_tokens == 2


def test_echo_streams_the_prompt_first_and_without_logprobs_scores_nothing(client: Any, engine: BatchEngine) -> None:
    text = "def fibonacci(n):"
    whole = client.completions.create(model=MODEL, prompt=text, max_tokens=6, echo=True, temperature=0)
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=6, temperature=0)
    assert whole.choices[0].text == text + plain.choices[0].text and whole.choices[0].logprobs is None
    events = list(client.completions.create(model=MODEL, prompt=text, max_tokens=6, echo=True, temperature=0,
                                            logprobs=0, stream=True))
    assert events[0].choices[0].text == text
    assert events[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(e.choices[0].text for e in events) == whole.choices[0].text


def test_vllms_prompt_logprobs_on_completions_and_chat(client: Any, engine: BatchEngine, reference: Any) -> None:
    prompt = prompt_of(engine)
    want = reference(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    shown = r.choices[0].model_extra["prompt_logprobs"]
    assert shown[0] is None and len(shown) == len(prompt)
    for position, (row, token) in enumerate(zip(shown[1:], prompt[1:])):
        first = next(iter(row))
        assert first == str(token) and abs(row[first]["logprob"] - want[position, token]) < 1e-4
        assert row[first]["decoded_token"] == engine.tokenizer.decode([token])
        ranked = sorted((v["rank"], k) for k, v in row.items() if k != first)
        assert [rank for rank, _ in ranked] == list(range(1, len(ranked) + 1)) and 2 <= len(row) <= 3
    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    tokens = engine.encode_chat(messages)
    assert len(chat.model_extra["prompt_logprobs"]) == len(tokens)
    assert [next(iter(row)) for row in chat.model_extra["prompt_logprobs"][1:]] == [str(t) for t in tokens[1:]]
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, n=2,
                                                 stream=True, extra_body={"prompt_logprobs": 0}))
    firsts = [e.model_extra.get("prompt_logprobs") for e in stream if e.model_extra.get("prompt_logprobs")]
    assert len(firsts) == 1  # once (its choices prefill side by side: the same values to within a batch's rounding)
    for got, row in zip(firsts[0][1:], chat.model_extra["prompt_logprobs"][1:]):
        assert got.keys() == row.keys() and all(abs(got[k]["logprob"] - row[k]["logprob"]) < 1e-4 for k in row)


def test_a_prompt_only_scored_may_fill_the_context_and_drafts_nothing(client: Any, engine: BatchEngine) -> None:
    prompt = prompt_of(engine)
    context = engine.max_context
    engine.max_context = len(prompt)  # (the prompt fills it: no token could be generated, one scored is fine)
    try:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                      temperature=0, extra_body={"mtp_depth": "auto"})
        assert len(r.choices[0].logprobs.token_logprobs) == len(prompt) and r.usage.mtp["drafted"] == 0
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    finally:
        engine.max_context = context


@pytest.mark.parametrize("top", [0, 1, 3])
def test_scores_read_on_the_host_equal_those_read_on_the_device(top: int) -> None:
    """On the CPU backend the scores are normalized with numpy, on a GPU by MLX: the same numbers."""
    from mtpipe.node.scoring import _on_device, _on_host

    logits = mx.random.normal((9, 50), key=mx.random.key(top)) * 4
    tokens = [3, 7, 0, 49, 12, 12, 5, 8, 30]
    host, device = _on_host(np.array(logits), tokens, top), _on_device(logits, tokens, top)
    np.testing.assert_allclose(host[0], device[0], atol=1e-5)
    assert host[1] == device[1] and (host[2] is None) == (device[2] is None) == (top == 0)
    if top:
        assert [sorted(i) for i in host[2]] == [sorted(i) for i in device[2]]
        np.testing.assert_allclose(np.sort(host[3]), np.sort(device[3]), atol=1e-5)
