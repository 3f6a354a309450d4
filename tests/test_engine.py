"""Engine behaviour: stops (EOS, stop strings, max_tokens), stats, and bad input leaving state intact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import TINY_LAYERS

from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.loading import load_shard
from mtpipe.models.shard import ShardSpec
from mtpipe.node.protocol import Commit, SamplingParams, StageError, StepKind, StepRequest
from mtpipe.node.stage import StageWorker

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def reference(dense_engine: Engine) -> tuple[list[int], list[int]]:
    prompt = dense_engine.tokenizer.encode(PROMPT)
    return prompt, dense_engine.complete(GenerationRequest(prompt, max_tokens=40)).tokens


@pytest.mark.parametrize("depth", [0, 3])
def test_max_tokens_exact(dense_engine: Engine, reference, depth: int) -> None:
    prompt, greedy = reference
    for n in (1, 2, 5, 7):
        r = dense_engine.complete(GenerationRequest(prompt, max_tokens=n, mtp_depth=depth))
        assert r.tokens == greedy[:n] and r.finish_reason == "length"
        assert r.stats.generation_tokens == n


@pytest.mark.parametrize("depth", [0, 3])
def test_eos_ends_with_the_token(dense_engine: Engine, reference, depth: int) -> None:
    """The EOS token is the last of the reply's tokens (vLLM's: counted, with its log-probability), its
    text left out."""
    prompt, greedy = reference
    eos = greedy[6]
    first = greedy.index(eos)
    engine = Engine(dense_engine.pipeline, dense_engine.tokenizer, {eos}, 4096, has_mtp=True)
    r = engine.complete(GenerationRequest(prompt, max_tokens=40, mtp_depth=depth))
    assert r.tokens == greedy[: first + 1] and r.finish_reason == "stop"
    assert r.text == dense_engine.tokenizer.decode(greedy[:first]) and r.stats.generation_tokens == first + 1


@pytest.mark.parametrize("depth", [0, 3])
def test_a_requests_stop_tokens_and_ignore_eos(dense_engine: Engine, reference, depth: int) -> None:
    prompt, greedy = reference
    first = greedy.index(greedy[6])
    r = dense_engine.complete(GenerationRequest(prompt, max_tokens=40, mtp_depth=depth, stop_token_ids=[greedy[6]]))
    assert r.tokens == greedy[: first + 1] and r.finish_reason == "stop" and r.stop_reason == greedy[6]
    assert r.text == dense_engine.tokenizer.decode(greedy[:first])
    kept = dense_engine.complete(GenerationRequest(prompt, max_tokens=40, mtp_depth=depth, stop_token_ids=[greedy[6]],
                                                   include_stop_str_in_output=True))
    assert kept.tokens == r.tokens and kept.text == dense_engine.tokenizer.decode(greedy[: first + 1])
    engine = Engine(dense_engine.pipeline, dense_engine.tokenizer, {greedy[6]}, 4096, has_mtp=True)
    r = engine.complete(GenerationRequest(prompt, max_tokens=40, mtp_depth=depth, ignore_eos=True))
    assert r.tokens == greedy and r.finish_reason == "length"


@pytest.mark.parametrize("depth", [0, 2])
def test_stop_string_never_emitted(dense_engine: Engine, reference, depth: int) -> None:
    prompt, greedy = reference
    full = dense_engine.tokenizer.decode(greedy)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    chunks = list(dense_engine.generate(GenerationRequest(prompt, max_tokens=40, mtp_depth=depth, stop=[stop])))
    text = "".join(c.text for c in chunks)
    assert text == expected and stop not in text
    assert chunks[-1].finish_reason == "stop"


def test_stats_are_consistent(dense_engine: Engine, reference) -> None:
    prompt, _ = reference
    r = dense_engine.complete(GenerationRequest(prompt, max_tokens=30, mtp_depth=3))
    s = r.stats
    assert s.prompt_tokens == len(prompt)
    assert s.drafted == 3 * s.rounds and sum(s.drafted_per_position) == s.drafted
    assert sum(s.accepted_per_position) == s.accepted <= s.drafted
    assert s.prefill_tps > 0 and s.decode_tps > 0
    assert len(dense_engine.pipeline.stages[0].sequences) == 0  # released


@pytest.mark.parametrize(
    "req, message",
    [
        (GenerationRequest([], max_tokens=4), "empty"),
        (GenerationRequest([1, 2], max_tokens=0), "max_tokens"),
        (GenerationRequest([1, 2], max_tokens=5000), "maximum context length is"),
        (GenerationRequest([1, 2], params=SamplingParams(temperature=-1)), "temperature"),
        (GenerationRequest([1, 2], params=SamplingParams(temperature=1, top_p=2)), "top_p"),
    ],
)
def test_engine_rejects_bad_requests(dense_engine: Engine, req: GenerationRequest, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        list(dense_engine.generate(req))
    assert len(dense_engine.pipeline.stages[0].sequences) == 0


def snapshot(worker: StageWorker, seq_id: str) -> tuple:
    s = worker.sequences[seq_id]
    return (s.next_step, s.position, s.pending_k, [getattr(c, "offset", None) for c in s.cache],
            [mx.sum(c[1]).item() if c[1] is not None else None for c in s.cache if not hasattr(c, "offset")])


def test_stage_rejects_malformed_requests_without_state_change(dense_ckpt: Path) -> None:
    shard = load_shard(dense_ckpt, ShardSpec(2, 4, TINY_LAYERS), dtype=mx.float32)
    worker = StageWorker(shard)
    H = shard.config.args.hidden_size
    ok = mx.zeros((1, 3, H))
    first = worker.step(StepRequest("a", 0, StepKind.PREFILL, [1, 2, 3], final=True, mtp_depth=2), ok)
    out = worker.step(StepRequest("a", 1, StepKind.DECODE, first.tokens + first.drafts), ok)
    before = snapshot(worker, "a")
    bad = [
        (StepRequest("a", 2, StepKind.DECODE, [1, 2, 3], commit=out.commit), mx.zeros((1, 2, H))),  # wrong shape
        (StepRequest("a", 2, StepKind.DECODE, [1, 2, 3], commit=out.commit), None),  # no hidden
        (StepRequest("zz", 2, StepKind.DECODE, [1], commit=out.commit), mx.zeros((1, 1, H))),  # unknown sequence
        (StepRequest("a", 5, StepKind.DECODE, [1, 2, 3], commit=out.commit), ok),  # out of order
        (StepRequest("a", 2, StepKind.DECODE, [1, 2, 3]), ok),  # missing commit
        (StepRequest("a", 2, StepKind.DECODE, [1, 2, 3], commit=Commit(1, 3, 0)), ok),  # impossible commit
        (StepRequest("a", 2, StepKind.DECODE, [1, 2, 99999], commit=out.commit), ok),  # token out of range
        (StepRequest("a", 2, StepKind.PREFILL, [1, 2, 3], commit=out.commit), ok),  # prefill after decode
        (StepRequest("a", 2, StepKind.DECODE, [1, 2, 3], commit=out.commit), ok),  # not the drafts it made
    ]
    for req, hidden in bad:
        with pytest.raises(StageError):
            worker.step(req, hidden)
        assert snapshot(worker, "a") == before
    # A well-formed next step still works after all the refusals.
    worker.step(StepRequest("a", 2, StepKind.DECODE, out.tokens[-1:] + out.drafts, commit=out.commit), ok)


def test_cli_generate_json(dense_ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    """(In this process: the command as a process is run by the tests of `serve`, `launch` and the one below.)"""
    from mtpipe.coordinator.cli.main import main

    code = main(["generate", "--model", str(dense_ckpt), "--prompt", PROMPT, "--max-tokens", "12", "--mtp-depth", "2",
                 "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out.strip().splitlines()[-1])
    assert len(result["tokens"]) == 12 and result["finish_reason"] == "length" and result["mtp_depth"] == 2
    assert result["stats"]["drafted"] == 2 * result["stats"]["rounds"]


def test_cli_missing_mtp_error(tiny_root: Path, capsys: pytest.CaptureFixture) -> None:
    from mtpipe.coordinator.cli.main import main
    from mtpipe.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(layout="no_mtp", root=tiny_root)
    base = ["generate", "--model", str(path), "--prompt", "x", "--max-tokens", "3"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "--no-mtp" in err and "MTP" in err
    assert main(base + ["--no-mtp"]) == 0


def test_the_command_and_its_node_children_never_load_torch() -> None:
    """mtpipe computes with MLX only: its processes keep transformers from importing torch (installed
    with the `train` extra), which would cost every node process seconds and memory for nothing. A
    node's own modules do not import transformers at all, nor do `health` and `cache`, nor a launch
    until it coordinates, nor asking for help; mlx-lm's package names still resolve."""
    from mtpipe.node.spawn import node_command

    command = ("import runpy, sys\n"
               "try:\n"
               "    runpy.run_module('mtpipe', run_name='__main__', alter_sys=True)\n"
               "except SystemExit as e:\n"
               "    assert not e.code, e.code\n"
               "import mtpipe.node.server, mtpipe.node.stage, mtpipe.models.loading\n"
               "from mtpipe.models.mlx_thread import wire_working_set\n"
               "wire_working_set()\n"  # (what each MLX thread does first)
               "print('transformers' in sys.modules)\n")
    resolve = ("import transformers, mlx_lm.models.qwen3_5\n"
               "from mlx_lm import load, stream_generate\n"
               "import mlx_lm\n"
               "assert callable(load) and callable(stream_generate) and mlx_lm.__version__\n")
    torch = "print(sys.modules.get('torch', 'absent'))\n"  # (None: marked absent, installed or not)
    # (these commands defer mlx-lm's init as a node does: resolving its names once, for the node, is enough)
    cases = ((["-v", "node", "--help"], "False", command + resolve + torch),
             (["launch", "--help"], "False", command + torch),
             (["health", "--help"], "False", command + torch),
             (["cache", "--help"], "False", command + torch),
             (["generate", "--help"], "False", command + resolve + torch))
    procs = [subprocess.Popen([sys.executable, "-c", probe, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for argv, _, probe in cases]  # (all at once)
    for proc, (argv, transformers, _) in zip(procs, cases):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, (argv, stderr)
        assert stdout.strip().splitlines()[-2:] == [transformers, "None"], argv
    assert node_command("--port", "1")[-3:] == ["node", "--port", "1"]
    assert "runpy.run_module('mtpipe'" in node_command()[2]


def test_a_prompt_outside_the_vocabulary_is_refused_before_any_stage(dense_engine: Engine) -> None:
    """As the batch engines do: a RequestError naming the prompt, not a stage's error mid-prefill."""
    import threading

    from mtpipe.coordinator.engine.request import RequestError
    from mtpipe.coordinator.engine.sinks import END, open_stream

    with pytest.raises(RequestError) as refused:
        dense_engine.complete(GenerationRequest([1, dense_engine.vocab_size], 4))
    assert refused.value.param == "prompt"
    assert dense_engine.pipeline.stages[0].sequences == {}
    # A stream whose consumer fails on its first chunk still hears the end.
    ended = threading.Event()

    def failing(item: object) -> None:
        if item is END:
            ended.set()
            return
        raise RuntimeError("the consumer is gone")

    open_stream(dense_engine, GenerationRequest([1, 2, 3], 4), failing)
    assert ended.wait(30)


def test_generate_into_a_pipe_its_reader_closes_ends_quietly(dense_ckpt: Path) -> None:
    """`mtpipe generate ... | head -c 1`: no error line, no traceback; the exit a shell gives a filter
    whose reader left (141)."""
    proc = subprocess.Popen([sys.executable, "-m", "mtpipe", "-v", "generate", "--model", str(dense_ckpt),
                             "--prompt", "x", "--max-tokens", "400", "--no-mtp"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.read(1)
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and "Error" not in err and "Traceback" not in err, err



def test_what_compares_with_mlx_lm_leaves_out_the_token_that_ended_a_reply() -> None:
    from mtpipe.coordinator.engine.request import GenerationChunk

    assert GenerationChunk("", [4, 5, 2], "stop").shown == [4, 5]  # an EOS
    assert GenerationChunk("", [4, 5], "stop", stop_reason=5).shown == [4]  # a stop token id
    assert GenerationChunk("", [4, 5], "stop", stop_reason="x").shown == [4, 5]  # a stop string: all its tokens
    assert GenerationChunk("", [4, 5], "length").shown == GenerationChunk("", [4, 5]).shown == [4, 5]


def test_generate_without_max_tokens_takes_what_the_context_leaves(dense_ckpt: Path, capsys) -> None:
    """`mtpipe generate`'s own default length (256) never makes a long prompt an error the user did not ask
    for: it is cut to what the context leaves; an explicit --max-tokens past it still is one."""
    from mtpipe.coordinator.cli.main import main
    from mtpipe.coordinator.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(dense_ckpt, [])
    text = tok.decode([5 + i % 50 for i in range(4096)])
    text = tok.decode(tok.encode(text)[: 4096 - 40])  # (40 left: the default is cut to fit)
    prompt = len(tok.encode(text))
    assert 4096 - 256 < prompt < 4096 - 8
    assert main(["generate", "--model", str(dense_ckpt), "--prompt", text, "--no-mtp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "length" and out["stats"]["generation_tokens"] == 4096 - prompt
    assert main(["generate", "--model", str(dense_ckpt), "--prompt", text, "--no-mtp", "--max-tokens", "256"]) == 2
    assert "maximum context length is" in capsys.readouterr().err
