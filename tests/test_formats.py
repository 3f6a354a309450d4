"""Output held to a grammar: `response_format` (JSON, a JSON schema) and vLLM's regex and choice.

Greedy output under a grammar must be the same tokens at every MTP depth (auto too) and in a batch
beside other rows, as plain decoding under the grammar gives them; seeded sampled output must be the
same at every depth; the output must match the format; the masks of a verify's positions must leave
the grammar's state where it was; bad formats are 400s that touch no stage.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from helpers import LiveServer, batch_chunks, node_servers  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.api.formats import OutputFormat  # noqa: E402
from mtpipe.coordinator.engine.batch import BatchEngine  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine, ring_engine  # noqa: E402
from mtpipe.coordinator.engine.request import GenerationRequest, RequestError, check_request  # noqa: E402
from mtpipe.node.constraints import grammar_of_schema  # noqa: E402
from mtpipe.node.protocol import SamplingParams  # noqa: E402

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(dense_ckpt: Path) -> BatchEngine:
    return batch_engine(dense_ckpt, stages=2, dtype=mx.float32)


@pytest.fixture(scope="module")
def demo() -> BatchEngine:
    """The demo model: its drafts are accepted, so a verify's masks past the first position are read."""
    from mtpipe.models.registry import DEMO_MODEL

    return batch_engine(DEMO_MODEL)


@pytest.fixture(scope="module")
def client(engine: BatchEngine) -> Any:
    with LiveServer(create_app(engine, MODEL)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def fits(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "tags"} and isinstance(value["name"], str)
            and len(value["name"]) <= 12 and isinstance(value["age"], int) and 0 <= value["age"] <= 150
            and all(t in ("red", "blue") for t in value["tags"]) and len(value["tags"]) <= 3)


def run(engine: BatchEngine, prompt: list[int], depth: int, auto: bool = False, **params: Any) -> Any:
    return engine.complete(GenerationRequest(prompt, 64, SamplingParams(grammar=grammar_of_schema(SCHEMA), **params),
                                             mtp_depth=depth, mtp_auto=auto))


def test_greedy_output_under_a_grammar_is_the_same_at_every_depth_and_fits(demo: BatchEngine) -> None:
    prompt = demo.tokenizer.encode("def fibonacci(n):")
    plain = run(demo, prompt, 0)
    assert plain.finish_reason == "stop" and fits(json.loads(plain.text)), plain.text
    for depth, auto in ((1, False), (2, False), (3, False), (3, True)):
        out = run(demo, prompt, depth, auto)
        assert out.tokens == plain.tokens, (depth, auto, out.text, plain.text)
        assert out.stats.accepted > 0 or auto  # (drafts accepted: the masks after them were read)
    free = demo.complete(GenerationRequest(prompt, 16, SamplingParams(), mtp_depth=2))
    assert not free.text.startswith("{")  # (the grammar, not the model, made it JSON)


def test_seeded_output_under_a_grammar_is_the_same_at_every_depth(demo: BatchEngine) -> None:
    prompt = demo.tokenizer.encode("import os")
    outs = [run(demo, prompt, depth, temperature=1.0, seed=7) for depth in (0, 2, 3)]
    assert outs[0].tokens == outs[1].tokens == outs[2].tokens
    assert outs[1].stats.accepted > 0
    assert fits(json.loads(outs[0].text)), outs[0].text


def test_a_held_row_in_a_batch_is_what_it_is_alone_and_leaves_the_others_alone(demo: BatchEngine) -> None:
    prompts = [demo.tokenizer.encode(t) for t in ("class Point:", "def main():", "import sys")]
    held = GenerationRequest(prompts[0], 40, SamplingParams(grammar=grammar_of_schema(SCHEMA)), mtp_depth=2)
    free = [GenerationRequest(p, 24, SamplingParams(), mtp_depth=d) for p, d in zip(prompts[1:], (0, 3))]
    alone = [demo.complete(r).tokens for r in (held, *free)]
    together = [[t for c in chunks for t in c.tokens] for chunks in batch_chunks(demo, [held, *free], 60)]
    assert together == alone


def test_what_a_grammar_forces_is_drafted_and_accepted(demo: BatchEngine) -> None:
    """Keys and punctuation the schema fixes go out as the drafts (the MTP head's are mostly refused
    there): nearly all accepted, and the tokens are still those of plain decoding."""
    keys = [f"key_{i}" for i in range(8)]
    schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in keys},
              "required": keys, "additionalProperties": False}
    params = SamplingParams(grammar=grammar_of_schema(schema))
    prompt = demo.tokenizer.encode("import os")
    plain = demo.complete(GenerationRequest(prompt, 96, params, mtp_depth=0))
    drafted = demo.complete(GenerationRequest(prompt, 96, params, mtp_depth=3))
    assert drafted.tokens == plain.tokens and list(json.loads(drafted.text)) == keys
    assert drafted.stats.accepted >= 0.8 * drafted.stats.drafted > 0, drafted.stats
    assert drafted.stats.rounds < 0.6 * plain.stats.rounds


def test_a_complete_grammar_allows_only_the_end_even_where_the_end_does_not_stop(demo: BatchEngine) -> None:
    """With ignore_eos a finished format goes on with end-of-sequence tokens alone, at every depth (a
    drafted end token after the format is complete leaves the positions after it masked too)."""
    eos = sorted(demo.eos)
    params = SamplingParams(grammar=OutputFormat(regex="yes|no").grammar(), logit_bias=((eos[0], 4.0),))
    prompt = demo.tokenizer.encode("Say yes:")
    outs = [demo.complete(GenerationRequest(prompt, 16, params, mtp_depth=d, ignore_eos=True)) for d in (0, 3)]
    assert outs[0].tokens == outs[1].tokens
    text = demo.tokenizer.decode([t for t in outs[0].tokens if t not in demo.eos])
    assert text in ("yes", "no") and len(outs[0].tokens) == 16, outs[0].tokens
    assert outs[1].stats.accepted > 0


def test_a_format_whose_text_holds_an_added_tokens_text_holds(demo: BatchEngine) -> None:
    """llguidance never lets an added token match text, so a format whose own text holds one
    (`<|im_start|>` here, Qwen's `</think>` or `<tool_call>`) is written out in plain tokens, at every
    depth: the grammar stays held to the end."""
    params = SamplingParams(grammar=OutputFormat(regex=r"ab<\|im_start\|>cd( x)?").grammar())
    prompt = demo.tokenizer.encode("Say it:")
    outs = [demo.complete(GenerationRequest(prompt, 24, params, mtp_depth=d)) for d in (0, 3)]
    assert outs[0].tokens == outs[1].tokens and outs[0].finish_reason == "stop"
    assert outs[0].text in ("ab<|im_start|>cd", "ab<|im_start|>cd x")
    assert 1 not in outs[0].tokens  # (the text, not the special token)


def test_a_grammar_over_a_tokenizer_with_added_words_walks_to_its_end(demo: BatchEngine) -> None:
    """Added tokens that are not special (Qwen's `<think>`, `</think>`) too: each step's mask allows what
    the grammar then takes, along the whole of a text that holds them."""
    import copy

    from mtpipe.node.constraints import Grammars

    hf = copy.deepcopy(demo.tokenizer._tokenizer)
    hf.add_tokens(["<think>", "</think>"])
    assert len(hf.encode("a</think>b", add_special_tokens=False)) == 3  # (the added word, split out of text)
    grammars = Grammars(hf, len(hf), sorted(demo.eos))
    want = "ab</think>cd<|im_start|>"
    held = grammars.constraint(OutputFormat(regex=re.escape(want).replace("/", "\\/")).grammar())
    out: list[int] = []
    while not held.finished:
        forced = held.forced(8)
        step = forced[:1] or [int(np.flatnonzero(held.masks([], 1)[0])[0])]
        held.take(step)
        assert not held.broken, hf.decode(out)
        out += step
        assert len(out) < 64
    assert hf.decode(out) == want
    added = hf.convert_tokens_to_ids(["<think>", "</think>"])
    free = grammars.constraint(OutputFormat(regex=r"[^\n]{1,40}").grammar())
    assert not free.masks([], 1)[0][[1, 2, *added]].any()  # (added tokens are no text: none comes in one)
    named = grammars.constraint(OutputFormat(lark='start: "ab" <|im_end|>').grammar())  # (Lark names them)
    named.take(hf.encode("ab", add_special_tokens=False))
    assert np.flatnonzero(named.masks([], 1)[0]).tolist() == [2]


def test_the_masks_of_a_verify_leave_the_grammar_where_it_was(engine: BatchEngine) -> None:
    grammars = engine.stages[-1].worker.head.grammars
    constraint = grammars.constraint(grammar_of_schema(SCHEMA))
    tok = engine.tokenizer
    good = tok.encode('{"name": "a', add_special_tokens=False)
    before = constraint.masks([], 1)
    masks = constraint.masks(good + [good[0]], len(good) + 2)  # the last draft ('{' inside a string) is fine too
    assert (masks[0] == before[0]).all() and masks[0].sum() < masks.shape[1]
    assert (constraint.masks([], 1)[0] == before[0]).all()  # given back
    bad = [good[0], good[0]]  # a second '{' right after the first: refused
    masks = constraint.masks(bad, 3)
    assert not masks[1, good[0]] and masks[2].all()  # refused at its own position; nothing read after it
    constraint.take(good)
    assert not (constraint.masks([], 1)[0] == before[0]).all()  # taken for good


def test_a_grammar_is_compiled_where_the_request_is_checked_and_copied_for_each_sequence(demo: BatchEngine) -> None:
    """Checking a request compiles its grammar (the API's thread), so the MLX thread only copies it: the
    copies move on their own."""
    grammars = demo.stages[-1].worker.head.grammars
    grammar = grammar_of_schema({"type": "object", "properties": {"only_here": {"type": "boolean"}}})
    demo.validate(GenerationRequest([1, 2], 8, SamplingParams(grammar=grammar)))
    assert grammar in grammars._compiled
    a, b = grammars.constraint(grammar), grammars.constraint(grammar)
    a.take(demo.tokenizer.encode("{", add_special_tokens=False))
    assert not (a.masks([], 1) == b.masks([], 1)).all()


@pytest.mark.parametrize("nodes", [1, 2], ids=["one-node", "ring"])
def test_over_nodes_the_last_node_holds_the_format(demo: BatchEngine, nodes: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The last node loads the tokenizer beside its shard: a held request over one node (a sequence at a
    time) or a ring of two gives the tokens one machine gives, at every depth; the node compiles the
    grammar off its loop thread, which runs every round there."""
    import threading

    from mtpipe.models.registry import DEMO_MODEL
    from mtpipe.node.constraints import Grammars

    compiled_on: list[str] = []
    matcher = Grammars._matcher

    def spy(self: Grammars, grammar: str) -> Any:
        if grammar not in self._compiled:
            compiled_on.append(threading.current_thread().name)
        return matcher(self, grammar)

    monkeypatch.setattr(Grammars, "_matcher", spy)
    params = SamplingParams(grammar=grammar_of_schema({**SCHEMA, "title": f"over {nodes} node(s)"}))
    prompt = demo.tokenizer.encode("def fibonacci(n):")
    want = demo.complete(GenerationRequest(prompt, 64, params, mtp_depth=0)).tokens
    with node_servers(nodes) as servers:
        engine = ring_engine(DEMO_MODEL, [s.address for s in servers])
        try:
            assert engine.constrains
            for depth, auto in ((0, False), (3, False), (3, True)):
                got = engine.complete(GenerationRequest(prompt, 64, params, mtp_depth=depth, mtp_auto=auto))
                assert got.tokens == want, (nodes, depth, auto)
        finally:
            engine.close()
    assert compiled_on and "node-loop" not in compiled_on, compiled_on


def test_engines_whose_last_stage_has_no_tokenizer_refuse_a_grammar() -> None:
    req = GenerationRequest([1, 2], 4, SamplingParams(grammar=grammar_of_schema(SCHEMA)))
    with pytest.raises(RequestError) as e:
        check_request(req, max_context=64, has_mtp=True)
    assert e.value.param == "response_format"
    check_request(req, max_context=64, has_mtp=True, constrains=True)


def test_response_formats_through_the_api(client: Any) -> None:
    messages = [{"role": "user", "content": "Who is it?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert fits(json.loads(r.choices[0].message.content)), r.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                              response_format={"type": "json_object"}, stream=True, logprobs=True,
                                              top_logprobs=5)
    chunks = [c.choices[0] for c in streamed if c.choices]
    text = "".join(c.delta.content or "" for c in chunks)
    assert text.startswith("{")
    if chunks[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    first = next(c.logprobs.content[0] for c in chunks if c.logprobs)
    assert first.token == "{" and all(np.isfinite(t.logprob) for t in first.top_logprobs)  # (only what may come)
    choice = client.completions.create(model=MODEL, prompt="The answer:", max_tokens=8, n=3, temperature=1.0, seed=3,
                                       extra_body={"guided_choice": ["yes", "no", "a.b"]})
    assert all(c.text in ("yes", "no", "a.b") for c in choice.choices), [c.text for c in choice.choices]
    regex = client.completions.create(model=MODEL, prompt="Call", max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text), regex.choices[0].text
    # vLLM's grammars: EBNF as xgrammar takes it, or Lark as llguidance does
    for extra in ({"guided_grammar": 'root ::= ("yes" | "no") " " [0-9]{2}'},
                  {"structured_outputs": {"grammar": 'start: ("yes" | "no") " " /[0-9]{2}/'}}):
        held = client.completions.create(model=MODEL, prompt="The answer:", max_tokens=12, temperature=1.0, seed=5,
                                         n=2, extra_body=extra)
        assert all(re.fullmatch(r"(yes|no) [0-9]{2}", c.text) for c in held.choices), [c.text for c in held.choices]
    lark = client.completions.create(model=MODEL, prompt="x", max_tokens=12, temperature=0,
                                     extra_body={"guided_grammar": 'start: "a ::= b"'})  # (Lark, though it holds ::=)
    assert lark.choices[0].text == "a ::= b"


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= (("}, "guided_grammar"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_grammar": 'start: "ab" <|no_such_token|>'}, "guided_grammar"),  # (refused by the tokenizer's grammars)
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "a[^\\s\\S]"}, "guided_regex"),  # (no text matches it: never an empty reply)
    ({"guided_grammar": 'start: /[^\\s\\S]/ "a"'}, "guided_grammar"),
    ({"response_format": {"json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "response_format"),
])
def test_bad_formats_are_refused(client: Any, engine: BatchEngine, extra: dict[str, Any], param: str) -> None:
    steps = [s.stats.steps for s in engine.pipeline.stages]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert [s.stats.steps for s in engine.pipeline.stages] == steps


def test_a_thought_the_template_opened_stays_free_until_it_closes(demo: BatchEngine) -> None:
    """Where the prompt opened a thought, the reply thinks freely up to the closing tag (one token), then
    answers in the format; the same at every depth."""
    from mtpipe.coordinator.api.formats import after_thought, lark_of

    tok = demo.tokenizer
    prompt = tok.encode("def fibonacci(n):")
    free = demo.complete(GenerationRequest(prompt, 12, SamplingParams(), mtp_depth=0)).tokens
    end = free[3]

    class Tagged:  # the tokenizer, with `end` as its closing tag
        think_end_tokens = (end,)

        def __len__(self) -> int:
            return len(tok)

    grammar = after_thought(OutputFormat(schema=SCHEMA), Tagged(), demo.eos, demo.vocab_size)
    outs = [demo.complete(GenerationRequest(prompt, 80, SamplingParams(grammar=grammar), mtp_depth=d))
            for d in (0, 2)]
    assert outs[0].tokens == outs[1].tokens
    out = outs[0].tokens
    at = out.index(end)
    assert out[:at] == free[: free.index(end)]  # the thought as the model thinks it
    assert outs[0].finish_reason == "stop" and out[-1] in demo.eos  # (the EOS that ends it: one of its tokens)
    assert fits(json.loads(tok.decode(out[at + 1 : -1]).lstrip("\n"))), out
    lark = OutputFormat(lark=lark_of('root ::= "{" answer "}"\nanswer ::= [a-z]+', "guided_grammar"))
    grammar = after_thought(lark, Tagged(), demo.eos, demo.vocab_size)  # (its own rules apart from the thought's)
    out = demo.complete(GenerationRequest(prompt, 40, SamplingParams(grammar=grammar), mtp_depth=2)).tokens
    at = out.index(end)
    assert out[:at] == free[: free.index(end)] and out[-1] in demo.eos
    assert re.fullmatch(r"\n{0,2}\{[a-z]+\}", tok.decode(out[at + 1 : -1])), tok.decode(out)


def test_regexes_with_slashes_hold_after_a_thought_too() -> None:
    from mtpipe.node.constraints import grammar_error

    for regex in (r"[0-9]{2}/[0-9]{2}", r"[0-9]{2}\/[0-9]{2}", r"a\\/b"):
        for after in (None, 5):
            grammar = OutputFormat(regex=regex).grammar(after, ("0", "2")) if after else OutputFormat(regex=regex).grammar()
            assert grammar_error(grammar) == "", (regex, after)


def test_through_the_api_a_reasoning_model_thinks_then_answers_in_the_format(client: Any, engine: BatchEngine) -> None:
    """With thinking tags in the tokenizer (made up, as in test_api_processors: the chat prompt's last tag
    opens the thought, a token of the free reply closes it), the thought is free and goes out as
    `reasoning`, the answer as JSON in `content`."""
    messages = [{"role": "user", "content": "Think, then answer"}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True)
    tok = engine.tokenizer
    end_text = free.choices[0].logprobs.content[3].token
    (end,) = tok.encode(end_text, add_special_tokens=False)
    saved = (tok._think_start, tok._think_end, tok._think_start_tokens, tok._think_end_tokens)
    opening = "<|im_start|>assistant"
    tok._think_start, tok._think_end = opening, end_text
    tok._think_start_tokens, tok._think_end_tokens = tuple(tok.encode(opening, add_special_tokens=False)), (end,)
    try:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "p", "schema": SCHEMA}})
        message = r.choices[0].message
        assert message.model_extra["reasoning"] == "".join(t.token for t in free.choices[0].logprobs.content[:3])
        assert fits(json.loads(message.content)), message.content
    finally:
        tok._think_start, tok._think_end, tok._think_start_tokens, tok._think_end_tokens = saved


def test_generate_holds_its_output_to_a_schema_file_or_a_regex(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mtpipe.coordinator.cli.main import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["generate", "--prompt", "A record:", "--max-tokens", "64", "--json-schema", str(schema), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and fits(json.loads(out["text"])), out["text"]
    assert main(["generate", "--prompt", "Call", "--max-tokens", "12", "--regex", "[0-9]{3}-[0-9]{4}", "--json"]) == 0
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", json.loads(capsys.readouterr().out)["text"])
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= ("yes" | "no") "!"\n')
    assert main(["generate", "--prompt", "Say", "--max-tokens", "8", "--grammar", str(grammar), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes!", "no!")
    assert main(["generate", "--prompt", "Say", "--max-tokens", "8", "--grammar", "start: undefined"]) == 2
    assert "--grammar" in capsys.readouterr().err


def test_generate_with_chat_leaves_a_thought_the_template_opened_free(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """As the API does: with thinking tags in the tokenizer (made up: the chat prompt's last tag opens the
    thought, a token of the free reply closes it), `generate --chat` holds only the answer to the format."""
    from mtpipe.coordinator.cli.main import main
    from mtpipe.coordinator.engine import build

    ask = ["generate", "--chat", "--prompt", "Think first", "--mtp-depth", "0", "--json"]
    assert main([*ask, "--max-tokens", "8"]) == 0
    free = json.loads(capsys.readouterr().out)["tokens"]
    end = free[3]
    load = build.load_tokenizer

    def tagged(*a: Any, **kw: Any) -> Any:
        tok = load(*a, **kw)
        opening = "<|im_start|>assistant"
        tok._think_start, tok._think_end = opening, tok.decode([end])
        tok._think_start_tokens, tok._think_end_tokens = tuple(tok.encode(opening, add_special_tokens=False)), (end,)
        return tok

    monkeypatch.setattr(build, "load_tokenizer", tagged)
    assert main([*ask, "--max-tokens", "80", "--json-schema", json.dumps(SCHEMA)]) == 0
    out = json.loads(capsys.readouterr().out)
    at = out["tokens"].index(end)
    assert out["tokens"][:at] == free[:at] and end not in free[:at]
    from mtpipe.models.registry import DEMO_MODEL
    from mtpipe.coordinator.engine.tokenizer import load_tokenizer

    answer = load_tokenizer(DEMO_MODEL, []).decode(out["tokens"][at + 1 :], skip_special_tokens=True).lstrip("\n")
    assert out["finish_reason"] == "stop" and fits(json.loads(answer)), answer


def test_sampled_held_rows_keep_their_distribution_with_forced_drafts(demo: BatchEngine) -> None:
    """Unseeded sampled rows held to a choice between two values the grammar frames with forced keys and
    punctuation (drafted as forced, proposed with certainty): the share of each value is the same with
    drafts as without, within sampling error."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
              "additionalProperties": False}
    params = SamplingParams(temperature=1.0, grammar=grammar_of_schema(schema))
    prompt = demo.tokenizer.encode("Is it?")
    rows = 96
    shares, accepted = [], 0
    for depth in (0, 2):
        reqs = [GenerationRequest(prompt, 24, params, mtp_depth=depth) for _ in range(rows)]
        texts = ["".join(c.text for c in chunks) for chunks in batch_chunks(demo, reqs, 120)]
        values = [json.loads(t)["answer"] for t in texts]
        shares.append({v: values.count(v) / rows for v in ("yes", "no", "maybe")})
        if depth:
            accepted = sum(chunks[-1].stats.accepted for chunks in batch_chunks(demo, reqs[:8], 120))
    assert accepted > 0
    for v in ("yes", "no", "maybe"):  # (3.5 standard errors of a difference of two shares over 96 rows each)
        assert abs(shares[0][v] - shares[1][v]) <= 3.5 * (2 * 0.25 / rows) ** 0.5, shares


def test_a_tokenizer_whose_added_word_is_also_a_merged_word_still_holds_formats() -> None:
    """An added token whose text BPE merges also make (Gemma-like tokenizers): llguidance's form of the
    tokenizer builds, and a format forcing that text is held in the merged word."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtpipe.node.constraints import Grammars

    bpe = Tokenizer(models.BPE(vocab={"<eos>": 0, "a": 1, "b": 2, "ab": 3, "c": 4, "<unk>": 5}, merges=[("a", "b")],
                               unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<unk>", special=True)])
    bpe.add_tokens([AddedToken("ab", special=False)])
    held = Grammars(PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>"), 6, [0]).constraint(
        OutputFormat(regex="abc").grammar())
    assert held.forced(8) == [3, 4]
    held.take([3, 4])
    assert held.finished  # (taken: the merged word is text, as llguidance's own form of the tokenizer has it)


def test_a_tokenizer_whose_parts_add_to_a_text_keeps_llguidances_own_tokenization(
        caplog: pytest.LogCaptureFixture) -> None:
    """A SentencePiece-style normalizer ("▁" put before every text, as Llama 2's) would add to each forced
    text on its own: such a tokenizer keeps llguidance's own tokenization (said once), and formats hold."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mtpipe.node.constraints import Grammars

    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.train_from_iterator(["Hello world, hello there", "the world of words"] * 20,
                          trainers.BpeTrainer(vocab_size=120, special_tokens=["<eos>", "<unk>"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<unk>")
    with caplog.at_level("WARNING"):
        held = Grammars(hf, len(hf), [0]).constraint(OutputFormat(regex="Hello world").grammar())
    assert "do not give 'x' back" in caplog.text
    out: list[int] = []
    while not held.finished and len(out) < 32:
        step = held.forced(8)[:1] or [int(np.flatnonzero(held.masks([], 1)[0])[0])]
        held.take(step)
        assert not held.broken
        out += step
    assert held.finished
