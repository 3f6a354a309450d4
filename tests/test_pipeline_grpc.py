"""The distributed pipeline: `mtpipe node` processes on loopback, driven by the same engine as single-node mode.

Outputs must be token-identical to single-node mode (float32, greedy and seeded sampling), nodes hold
only their shard, several sequences run at once, a dead or hung node fails the request within 5 s
naming it, and malformed frames are refused without touching state.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from helpers import PROMPTS, TINY_LAYERS

from mtpipe.coordinator.engine.build import local_engine, remote_engine
from mtpipe.coordinator.engine.engine import Engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.coordinator.pipeline.local import even_split
from mtpipe.coordinator.pipeline.nodes import NodeFailure, RemoteStageError, wait_for_nodes
from mtpipe.models.config import load_config
from mtpipe.models.loading import load_shard
from mtpipe.node.protocol import SamplingParams, StepKind, StepRequest
from mtpipe.node.server import NodeServer
from mtpipe.node.spawn import node_command
from mtpipe.node.wire import make_channel, tensor_to_pb
from mtpipe.proto import mtpipe_pb2 as pb
from mtpipe.proto import mtpipe_pb2_grpc as pb_grpc

MAX_TOKENS = 24


# -- node processes -------------------------------------------------------------------------------


@contextmanager
def node_processes(n: int, secret: str | None = None) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    """n `mtpipe node` processes on 127.0.0.1, ready (they answer Ping); always killed afterwards."""
    procs: list[tuple[subprocess.Popen, str]] = []
    logs = [tempfile.TemporaryFile() for _ in range(n)]  # each node's stderr, for one that fails to start
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"MTPIPE_SECRET": secret} if secret else {}))
    try:
        for log in logs:
            # Port 0: each node binds a port of its own and reports it (no free-port race between nodes);
            # node_command: no orphans even if pytest is killed.
            cmd = node_command("--host", "127.0.0.1", "--port", "0", "--json")
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append((proc, ""))
        for i, (proc, _) in enumerate(procs):
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            line = proc.stdout.readline() if ready else ""
            if not line:
                logs[i].seek(0)
                stderr = logs[i].read()[-3000:].decode(errors="replace")
                raise AssertionError(f"node {i} printed no address (exit code {proc.poll()}):\n{stderr}")
            procs[i] = (proc, json.loads(line)["address"])
        wait_for_nodes([a for _, a in procs], timeout=120, secret=secret)
        yield procs
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
        for log in logs:
            log.close()


@pytest.fixture(scope="module")
def all_nodes() -> Iterator[list[tuple[subprocess.Popen, str]]]:
    # Started together (startup is mostly imports): three for pipelines and two to kill.
    with node_processes(5) as procs:
        yield procs


@pytest.fixture(scope="module")
def nodes(all_nodes: list[tuple[subprocess.Popen, str]]) -> list[str]:
    return [a for _, a in all_nodes[:3]]


_SINGLE: dict[Path, Engine] = {}
_REFERENCE: dict[tuple, object] = {}


def reference(ckpt: Path, text: str, depth: int, params: SamplingParams | None = None):
    """Single-node float32 output, computed once per module for every pipeline it is compared with."""
    key = (ckpt, text, depth, params)
    if key not in _REFERENCE:
        if ckpt not in _SINGLE:
            _SINGLE[ckpt] = local_engine(ckpt, dtype=mx.float32)
        _REFERENCE[key] = generate(_SINGLE[ckpt], text, depth, params)
    return _REFERENCE[key]


def accepting_checkpoint(src: Path, dst: Path, alpha: float = 0.05) -> Path:
    """The tiny dense model, edited so the MTP head often agrees with the backbone (partial acceptance).

    MTP: fc = [I, 0] and a layer with zero output, so it predicts lm_head(norm(embed(x[t+1]))); the
    backbone's residual branches are scaled by `alpha`, so it predicts nearly, not exactly, the same.
    """
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.copytree(src, tmp)
    w = dict(mx.load(str(src / "model.safetensors")))
    H = w["mtp.fc.weight"].shape[0]
    w["mtp.fc.weight"] = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
    for k in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        w[k] = mx.zeros_like(w[k])
    w["mtp.pre_fc_norm_embedding.weight"] = mx.zeros((H,))  # raw HF: 1 + 0
    w["mtp.norm.weight"] = w["model.language_model.norm.weight"]
    for k in list(w):
        if not k.startswith("mtp.") and k.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            w[k] = alpha * w[k]
    mx.save_safetensors(str(tmp / "model.safetensors"), w, metadata={"format": "pt"})
    tmp.rename(dst)
    return dst


@pytest.fixture(scope="module")
def accepting_ckpt(dense_ckpt: Path) -> Path:
    return accepting_checkpoint(dense_ckpt, dense_ckpt.with_name(dense_ckpt.name + "-accepting"))


@contextmanager
def remote(ckpt: Path, addresses: list[str], **kw) -> Iterator[Engine]:
    engine = remote_engine(ckpt, addresses, mtp=kw.pop("mtp", True), dtype="float32", **kw)
    try:
        yield engine
    finally:
        engine.pipeline.close()


def generate(engine: Engine, text: str, depth: int, params: SamplingParams | None = None):
    prompt = engine.tokenizer.encode(text)
    return engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, mtp_depth=depth,
                                             params=params or SamplingParams()))


# -- identity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_identical_to_single_node(ckpt: Path, nodes: list[str], n: int) -> None:
    with remote(ckpt, nodes[:n]) as engine:
        for text in PROMPTS[:2]:
            for depth in (0, 1, 2, 3):
                ref = reference(ckpt, text, depth)
                got = generate(engine, text, depth)
                assert got.tokens == ref.tokens, f"{n} nodes, depth {depth} diverged on {text!r}"
                assert got.stats.drafted == ref.stats.drafted


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_identical_with_partial_acceptance(accepting_ckpt: Path, nodes: list[str], n: int) -> None:
    drafted = accepted = 0
    with remote(accepting_ckpt, nodes[:n]) as engine:
        for text in PROMPTS[:3]:
            for depth in (1, 2, 3):
                ref = reference(accepting_ckpt, text, depth)
                got = generate(engine, text, depth)
                assert got.tokens == ref.tokens, f"{n} nodes, depth {depth} diverged on {text!r}"
                assert (got.stats.accepted, got.stats.drafted) == (ref.stats.accepted, ref.stats.drafted)
                drafted += got.stats.drafted
                accepted += got.stats.accepted
    assert 0.2 < accepted / drafted < 0.95  # commits of every size crossed the pipeline


@pytest.mark.parametrize("n", [2, 3])
def test_seeded_sampling_identical_to_single_node(accepting_ckpt: Path, nodes: list[str], n: int) -> None:
    with remote(accepting_ckpt, nodes[:n]) as engine:
        for i, text in enumerate(PROMPTS[4:7]):
            params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=100 + i)
            for depth in (0, 2):
                ref = reference(accepting_ckpt, text, depth, params)
                got = generate(engine, text, depth, params)
                assert got.tokens == ref.tokens, f"{n} nodes, depth {depth} diverged on {text!r}"


def test_chunked_prefill_identical(accepting_ckpt: Path, nodes: list[str]) -> None:
    """A long prompt in many chunks through 3 nodes; the MTP cache fills on the last node."""
    single = local_engine(accepting_ckpt, dtype=mx.float32)
    text = "".join(PROMPTS) * 2
    with remote(accepting_ckpt, nodes[:3]) as engine:
        prompt = engine.tokenizer.encode(text)
        assert len(prompt) > 300
        for chunk in (64, 512):
            single.prefill_chunk = engine.prefill_chunk = chunk
            req = GenerationRequest(prompt, max_tokens=MAX_TOKENS, mtp_depth=2)
            ref, got = single.complete(req), engine.complete(req)
            assert got.tokens == ref.tokens
            assert (got.stats.accepted, got.stats.drafted) == (ref.stats.accepted, ref.stats.drafted)


def test_refused_chunk_among_chunks_in_flight(dense_ckpt: Path, nodes: list[str]) -> None:
    # Several prompt chunks travel at once: one refused in the middle fails the request with the
    # node's reason, the chunks behind it change nothing, and the pipeline serves on.
    with remote(dense_ckpt, nodes[:2]) as engine:
        engine.prefill_chunk = 8
        engine.vocab_size = None  # (the engine would refuse it first: the node's refusal is what is tested)
        prompt = engine.tokenizer.encode("".join(PROMPTS[:4]))[:40]
        prompt[20] = load_config(dense_ckpt).args.vocab_size + 5  # the third chunk
        with pytest.raises(RemoteStageError) as err:
            engine.complete(GenerationRequest(prompt, max_tokens=4))
        assert err.value.code == "INVALID_ARGUMENT" and "vocabulary" in str(err.value)
        deadline = time.monotonic() + 5
        while any(h.active_sequences for h in engine.pipeline.health()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [h.active_sequences for h in engine.pipeline.health()] == [0, 0]
        assert generate(engine, PROMPTS[9], 2).tokens == reference(dense_ckpt, PROMPTS[9], 2).tokens


def test_large_messages_pass(nodes: list[str]) -> None:
    # Above gRPC's default 4 MiB limit in both directions (a prefill chunk of a large model is ~16 MiB).
    payload = os.urandom(12 << 20)
    with make_channel(nodes[0]) as ch:
        assert pb_grpc.NodeStub(ch).Ping(pb.PingRequest(payload=payload), timeout=30).payload == payload


def test_concurrent_sequences_are_isolated(dense_engine: Engine, nodes: list[str], dense_ckpt: Path) -> None:
    texts = PROMPTS[7:11]
    expected = [generate(dense_engine, t, 2).tokens for t in texts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with remote(dense_ckpt, nodes[:3]) as engine:

        def run(i: int) -> None:
            try:
                results[i] = generate(engine, texts[i], 2).tokens
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert [results[i] for i in range(len(texts))] == expected
        # Releases travel in order ahead of later steps: once another sequence has run a step,
        # every node has dropped the finished ones.
        Driver(engine.pipeline, "probe", engine.tokenizer.encode(texts[0]), depth=2)
        assert [h.active_sequences for h in engine.pipeline.health()] == [1, 1, 1]
        engine.pipeline.release("probe")


# -- the ring: the last node starts decode rounds -------------------------------------------------


def test_last_node_starts_every_decode_round(dense_ckpt: Path, nodes: list[str]) -> None:
    with remote(dense_ckpt, nodes[:2]) as engine:
        prompt = engine.tokenizer.encode(PROMPTS[3])
        prefill_steps = len(list(engine._prefill_chunks(prompt)))
        for depth in (0, 2):
            sent, started = engine.pipeline.stats.frames_sent, engine.pipeline.health()[-1].ring_frames
            got = generate(engine, PROMPTS[3], depth)
            assert got.tokens == reference(dense_ckpt, PROMPTS[3], depth).tokens
            last = engine.pipeline.health()[-1]
            # The coordinator sent the prompt only; every decode round came from the last node.
            assert engine.pipeline.stats.frames_sent - sent == prefill_steps
            assert last.ring == nodes[0] and last.ring_frames - started == got.stats.rounds > 0


def test_coordinator_driven_rounds_when_the_ring_is_off(dense_ckpt: Path, nodes: list[str]) -> None:
    with remote(dense_ckpt, nodes[:3], ring=False) as engine:
        started = engine.pipeline.health()[-1].ring_frames
        got = generate(engine, PROMPTS[3], 2)
        assert got.tokens == reference(dense_ckpt, PROMPTS[3], 2).tokens
        assert engine.pipeline.health()[-1].ring_frames == started


def test_stop_string_drops_the_round_the_last_node_started(dense_engine: Engine, dense_ckpt: Path,
                                                           nodes: list[str]) -> None:
    # A stop string is the coordinator's call: the last node has already started the next round,
    # which the release must cancel on every node without an error reaching anyone.
    prompt = dense_engine.tokenizer.encode(PROMPTS[8])
    full = dense_engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS))
    stop = full.text[len(full.text) // 2 :][:2]
    assert stop.strip()
    for depth in (0, 2):
        req = GenerationRequest(prompt, max_tokens=MAX_TOKENS, mtp_depth=depth, stop=[stop])
        ref = dense_engine.complete(req)
        assert ref.finish_reason == "stop" and len(ref.tokens) < len(full.tokens)
        with remote(dense_ckpt, nodes[:3]) as engine:
            got = engine.complete(req)
            assert (got.text, got.tokens, got.finish_reason) == (ref.text, ref.tokens, ref.finish_reason)
            deadline = time.monotonic() + 5
            while any(h.active_sequences for h in engine.pipeline.health()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [h.active_sequences for h in engine.pipeline.health()] == [0, 0, 0]
            assert generate(engine, PROMPTS[8], depth).tokens == reference(dense_ckpt, PROMPTS[8], depth).tokens


# -- memory and health ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_each_node_holds_only_its_shard(dense_ckpt: Path, nodes: list[str], n: int) -> None:
    whole = load_shard(dense_ckpt, mtp=False, dtype=mx.float32).model.parameter_bytes()
    whole_mtp = load_shard(dense_ckpt, mtp=True, dtype=mx.float32).model
    embed = whole_mtp.embed_tokens.weight.nbytes
    with remote(dense_ckpt, nodes[:n], mtp=False) as engine:
        health = engine.pipeline.health()
        sizes = [h.parameter_bytes for h in health]
        assert sum(sizes) == whole
        assert all(0 < s < whole for s in sizes)
        for h in health:  # what MLX holds in the node process: its shard, nothing of the others
            # (nor of the sequences earlier tests ran on these nodes and released)
            assert h.parameter_bytes <= h.mlx_active_memory < 1.1 * h.parameter_bytes, (h.start, h.mlx_active_memory)
        specs = even_split(TINY_LAYERS, n)
        assert [(h.start, h.end, h.is_first, h.is_last) for h in health] == [
            (s.start, s.end, s.is_first, s.is_last) for s in specs
        ]
    with remote(dense_ckpt, nodes[:n], mtp=True) as engine:
        # With MTP the last node also holds the embedding (the MTP head reads it): one extra copy.
        assert sum(h.parameter_bytes for h in engine.pipeline.health()) == whole_mtp.parameter_bytes() + embed


def test_released_sequences_free_node_memory(dense_ckpt: Path, nodes: list[str]) -> None:
    texts = PROMPTS[:4]
    with remote(dense_ckpt, nodes[:3]) as engine:
        before = engine.pipeline.health()  # no sequence exists yet
        assert [h.active_sequences for h in before] == [0, 0, 0]
        drivers = [Driver(engine.pipeline, f"mem-{i}", engine.tokenizer.encode(t), depth=2) for i, t in enumerate(texts)]
        for drv in drivers:
            for _ in range(4):
                drv.round()
        during = engine.pipeline.health()
        assert [h.active_sequences for h in during] == [len(texts)] * 3
        for drv in drivers:
            engine.pipeline.release(drv.seq_id)
        deadline = time.monotonic() + 5
        while any(h.active_sequences for h in engine.pipeline.health()) and time.monotonic() < deadline:
            time.sleep(0.05)
        after = engine.pipeline.health()
    assert [h.active_sequences for h in after] == [0, 0, 0]
    # MLX counts the bytes of live arrays exactly. Measured on the tiny model: a live sequence holds
    # 15-128 KiB per node (KV caches, GatedDeltaNet states and snapshots, the MTP cache), its smallest
    # single state tensor (a GatedDeltaNet conv state) 1.5 KiB; a node whose sequences are released
    # reads what it read before they existed, plus 4 bytes (scalars MLX makes once). The tolerance allows
    # for a few such scalars and allocator rounding, and is below any state tensor a released sequence
    # could leave behind.
    tolerance = 1024
    for b, d, a in zip(before, during, after):
        assert b.parameter_bytes <= b.mlx_active_memory
        per_sequence = (d.mlx_active_memory - b.mlx_active_memory) / len(texts)
        assert per_sequence > 8 * tolerance, (b.start, b.mlx_active_memory, d.mlx_active_memory)  # seen
        assert abs(a.mlx_active_memory - b.mlx_active_memory) <= tolerance, (
            f"node [{b.start}, {b.end}) holds {a.mlx_active_memory - b.mlx_active_memory} bytes more after "
            f"its sequences were released (one sequence held {per_sequence:.0f})"
        )


def test_health_reports_the_node(dense_ckpt: Path, nodes: list[str]) -> None:
    import mtpipe

    with remote(dense_ckpt, nodes[:2]) as engine:
        before = [h.prefill_tokens for h in engine.pipeline.health()]  # (a node loaded before keeps its counts)
        generate(engine, PROMPTS[0], 2)
        first, last = engine.pipeline.health(probe_next=True)
    assert first.version == last.version == mtpipe.__version__
    assert first.loaded and first.model_path == str(dense_ckpt.resolve())
    assert first.is_first and not first.is_last and last.is_last and not last.is_first
    assert first.next == nodes[1] and 0 < first.next_rtt_ms < 1000 and last.next == ""
    assert first.tokens_processed > 0 and first.steps > 0 and first.mean_step_ms > 0
    body = len(engine.tokenizer.encode(PROMPTS[0])) - 1  # (the final chunk, which samples, is not counted)
    assert [first.prefill_tokens, last.prefill_tokens] == [n + body for n in before] and first.prefill_seconds > 0
    assert first.forwarded_decode_frames > 0 and first.forwarded_decode_bytes > 0
    assert first.uptime_s > 0 and first.node_id and first.node_id != last.node_id
    assert first.coordinators == last.coordinators == 1  # (this pipeline's, subscribed)
    if sys.platform.startswith("linux") or sys.platform == "darwin":
        assert first.memory_used > 0 and first.memory_available > 0


# -- malformed frames -----------------------------------------------------------------------------


def _call_step(address: str, frame: pb.Frame) -> grpc.StatusCode | pb.StepReply:
    with make_channel(address) as ch:
        try:
            return pb_grpc.NodeStub(ch).Step(frame, timeout=10)
        except grpc.RpcError as e:
            return e.code()


class Driver:
    """The engine's loop by hand, with a known sequence id, so a test can act between rounds."""

    def __init__(self, pipeline, seq_id: str, prompt: list[int], depth: int):
        self.pipeline, self.seq_id, self.step_no = pipeline, seq_id, 0
        self.out = self._step(StepKind.PREFILL, prompt[:-1], mtp_depth=depth, params=SamplingParams())
        self.out = self._step(StepKind.PREFILL, prompt[-1:], final=True)
        self.tokens = list(self.out.tokens)

    def _step(self, kind: StepKind, tokens: list[int], **kw):
        out = self.pipeline.step(StepRequest(self.seq_id, self.step_no, kind, tokens, **kw))
        self.step_no += 1
        return out

    def round(self) -> None:
        self.out = self._step(StepKind.DECODE, [self.out.tokens[-1]] + self.out.drafts, commit=self.out.commit)
        self.tokens += self.out.tokens


@pytest.mark.parametrize("whose", ["another client's", "its own, decoding on its own path"])
def test_a_group_round_cannot_take_a_sequence_it_may_not(whose: str, dense_engine: Engine, dense_ckpt: Path) -> None:
    """A group round whose join row names a sequence of another client, or one that decodes on its
    own path, is refused before anything changes (it moved the sequence into the round's group, whose
    failure then freed it): the sequence goes on as if nothing had happened."""
    from helpers import node_servers

    prompt = dense_engine.tokenizer.encode(PROMPTS[12])
    expected = generate(dense_engine, PROMPTS[12], 2).tokens
    with node_servers(2) as servers, remote(dense_ckpt, [s.address for s in servers]) as engine:
        drv = Driver(engine.pipeline, "seq-a", prompt, depth=2)
        drv.round()
        before = [h.active_sequences for h in engine.pipeline.health()]
        rnd = pb.Frame(client_id="" if whose.startswith("another") else engine.pipeline.client_id, kind=pb.GROUP,
                       group=7, step=1)
        rnd.rows.add(seq_id="seq-a", tokens=[1], join=True)
        with make_channel(servers[0].address) as ch:  # (the stream ends once the node has taken its frames)
            for _ in pb_grpc.NodeStub(ch).Forward(iter([rnd]), timeout=5):
                pass
        assert [h.active_sequences for h in engine.pipeline.health()] == before
        while len(drv.tokens) < len(expected):
            drv.round()
        engine.pipeline.release("seq-a")
    assert drv.tokens[: len(expected)] == expected


def test_bad_frames_rejected_without_state_change(dense_engine: Engine, dense_ckpt: Path, nodes: list[str]) -> None:
    prompt = dense_engine.tokenizer.encode(PROMPTS[12])
    expected = generate(dense_engine, PROMPTS[12], 2).tokens
    H = 64
    with remote(dense_ckpt, nodes[:3]) as engine:
        drv = Driver(engine.pipeline, "seq-a", prompt, depth=2)
        drv.round()
        step, c = drv.step_no, drv.out.commit
        good = tensor_to_pb(mx.zeros((1, 3, H)))

        me = engine.pipeline.client_id

        def frame(tokens: list[int], hidden: pb.Tensor | None, step: int = step, seq: str = "seq-a",
                  client: str = me) -> pb.Frame:
            # Everything else right (the pending commit included), so only the named fault is refused.
            f = pb.Frame(client_id=client, seq_id=seq, step=step, kind=pb.DECODE, tokens=tokens,
                         commit=pb.Commit(step=c.step, accepted=c.accepted, trim=c.trim))
            if hidden is not None:
                f.hidden.CopyFrom(hidden)
            return f

        t = [1, 2, 3]
        bad_on_middle = [
            frame(t, tensor_to_pb(mx.zeros((1, 2, H)))),  # wrong shape
            frame(t, pb.Tensor(dtype="int8", shape=[1, 3, H], data=bytes(3 * H))),  # unknown dtype
            frame(t, pb.Tensor(dtype="float32", shape=[1, 3, H], data=bytes(7))),  # byte count
            frame(t, pb.Tensor(dtype="float32", shape=[1, 3, -H], data=b"")),  # impossible shape
            frame(t, good, step=step + 5),  # step out of order
            frame(t, good, step=step - 1),  # a step already done
            frame(t, good, seq="nope"),  # unknown sequence
            frame(t, None),  # a middle node needs hidden states
            frame([10**6, 1, 2], good),  # token outside the vocabulary
            frame(t, tensor_to_pb(mx.zeros((1, 3, H + 1)))),  # hidden states of another width
            frame(t, tensor_to_pb(mx.zeros((3, H)))),  # or rank
        ]
        bad = {
            nodes[0]: [frame(t, good), frame(t, None, step=step + 5), frame([-1], None),
                       pb.Frame(client_id=me, seq_id="seq-a", step=step, kind=pb.DECODE, tokens=t, budget=-1),
                       # a new sequence longer than the model's context, or sampling at no usable temperature
                       pb.Frame(client_id=me, seq_id="new", kind=pb.PREFILL, tokens=[1] * (engine.max_context + 1)),
                       *(pb.Frame(client_id=me, seq_id="new", kind=pb.PREFILL, tokens=t,
                                  params=pb.Sampling(temperature=x, top_p=1))
                         for x in (float("nan"), float("inf"), 1e-30)),
                       frame(t, None, client="")],  # right in every way but whose sequence it is
            nodes[1]: [*bad_on_middle, frame(t, good, client="")],
            nodes[2]: [frame(t, good)],  # drafts this last node never made
        }
        before = [(h.active_sequences, h.tokens_processed, h.steps) for h in engine.pipeline.health()]
        for address, frames in bad.items():
            for f in frames:
                assert _call_step(address, f) == grpc.StatusCode.INVALID_ARGUMENT, (address, f)
        with make_channel(nodes[0]) as ch, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.NodeStub(ch).Step(frame(t, None, client=""), timeout=10)
        assert "belongs to another client" in refused.value.details() and "expected" not in refused.value.details()
        # Through the streams: a refused step comes back as INVALID_ARGUMENT naming the node.
        with pytest.raises(RemoteStageError) as err:
            engine.pipeline.step(StepRequest("seq-a", step + 5, StepKind.DECODE, [1]))
        assert err.value.code == "INVALID_ARGUMENT" and nodes[0] in str(err.value)
        assert [(h.active_sequences, h.tokens_processed, h.steps) for h in engine.pipeline.health()] == before
        while len(drv.tokens) < len(expected):  # the sequence goes on as if nothing had happened
            drv.round()
        engine.pipeline.release("seq-a")
    assert drv.tokens[: len(expected)] == expected


def test_refused_loads_and_releases_leave_the_shard_and_its_sequences(
        dense_engine: Engine, dense_ckpt: Path, nodes: list[str]) -> None:
    """A Load the node refuses (layers that do not fit the model, an unknown dtype), even one that
    would take the node over, changes nothing: the shard, its sequences and the coordinator it serves
    stay. Nor may another client release a sequence it did not start."""
    prompt = dense_engine.tokenizer.encode(PROMPTS[12])
    expected = generate(dense_engine, PROMPTS[12], 2).tokens
    with remote(dense_ckpt, nodes[:2]) as engine:
        drv = Driver(engine.pipeline, "seq-a", prompt, depth=2)
        drv.round()
        before = [h.active_sequences for h in engine.pipeline.health()]
        n = load_config(dense_ckpt).num_layers
        with make_channel(nodes[0]) as ch:
            stub = pb_grpc.NodeStub(ch)
            for bad in (dict(start=3, end=1), dict(dtype="int8"), dict(num_layers=n + 5)):
                request = pb.LoadRequest(**{**dict(model_path=str(dense_ckpt), start=0, end=n // 2, num_layers=n,
                                                   mtp=True, dtype="float32", client_id="intruder", take_over=True),
                                            **bad})
                with pytest.raises(grpc.RpcError) as err:
                    stub.Load(request, timeout=60)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            with pytest.raises(grpc.RpcError) as err:
                stub.Release(pb.ReleaseRequest(seq_id="seq-a", client_id="intruder"), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "another client" in err.value.details()
        assert [h.active_sequences for h in engine.pipeline.health()] == before
        while len(drv.tokens) < len(expected):  # the sequence goes on, its coordinator not taken over
            drv.round()
        engine.pipeline.release("seq-a")
    assert drv.tokens[: len(expected)] == expected


def test_one_node_named_two_ways_is_refused_before_any_load(dense_engine: Engine, dense_ckpt: Path,
                                                            nodes: list[str]) -> None:
    """`localhost:P` and `127.0.0.1:P` are one node: a pipeline listing both is refused, naming them,
    before either is loaded, so the shard that node holds for its pipeline stays."""
    expected = generate(dense_engine, PROMPTS[3], 2).tokens
    with remote(dense_ckpt, nodes[:2]) as engine:
        port = nodes[0].rsplit(":", 1)[1]
        with pytest.raises(ValueError, match=f"localhost:{port} and 127.0.0.1:{port} are the same node"):
            remote_engine(dense_ckpt, [f"localhost:{port}", f"127.0.0.1:{port}"], dtype="float32")
        assert generate(engine, PROMPTS[3], 2).tokens == expected


def test_a_refused_second_coordinator_changes_no_link_of_the_first(dense_engine: Engine, dense_ckpt: Path,
                                                                    nodes: list[str]) -> None:
    """Another coordinator asking the same nodes for another pipeline (their order reversed: the middle
    node's shard is the same, its next node not) is refused where a node holds another shard, and the
    nodes it could load are not linked anew: the first coordinator's requests go on as before."""
    from mtpipe.coordinator.pipeline.nodes import NodeInUse

    expected = generate(dense_engine, PROMPTS[4], 2).tokens
    with remote(dense_ckpt, nodes[:3]) as engine:
        with pytest.raises(NodeInUse):
            remote_engine(dense_ckpt, nodes[:3][::-1], dtype="float32")
        assert generate(engine, PROMPTS[4], 2).tokens == expected


def test_secret_required_when_set(dense_ckpt: Path) -> None:
    server = NodeServer("127.0.0.1", 0, secret="s3cret").start()
    try:
        for secret in (None, "wrong"):  # no TLS, or TLS keyed by another secret: no call gets through
            with make_channel(server.address, secret) as ch:
                stub = pb_grpc.NodeStub(ch)
                with pytest.raises(grpc.RpcError) as err:
                    stub.Health(pb.HealthRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Subscribe(pb.SubscribeRequest(client_id="x"), timeout=5))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with make_channel(server.address, "s3cret") as ch:
            reply = pb_grpc.NodeStub(ch).Ping(pb.PingRequest(payload=b"hi"), timeout=5)
            assert reply.payload == b"hi"
        with pytest.raises(NodeFailure):
            remote_engine(dense_ckpt, [server.address], secret=None)
        with remote(dense_ckpt, [server.address], secret="s3cret") as engine:
            assert generate(engine, PROMPTS[0], 2).tokens
    finally:
        server.stop(0)


# -- failures -------------------------------------------------------------------------------------


def _kill_mid_generation(engine: Engine, victim: subprocess.Popen, victim_address: str, text: str) -> None:
    """Kill `victim` while a long generation runs: the request fails within 5 s, naming it."""
    stream = engine.generate(GenerationRequest(engine.tokenizer.encode(text), max_tokens=1000, mtp_depth=2))
    next(stream)
    next(stream)
    victim.kill()
    t0 = time.monotonic()
    with pytest.raises(NodeFailure) as err:
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 5.0
    assert victim_address in str(err.value)


def test_killed_node_fails_the_request_fast(dense_ckpt: Path, nodes: list[str], all_nodes) -> None:
    victim, victim_address = all_nodes[3]
    with remote(dense_ckpt, [nodes[0], victim_address, nodes[1]]) as engine:
        _kill_mid_generation(engine, victim, victim_address, PROMPTS[13])
        with pytest.raises(NodeFailure, match=victim_address):  # and every later step, at once
            generate(engine, PROMPTS[0], 2)
    # The surviving nodes serve on.
    with remote(dense_ckpt, nodes[:2]) as engine:
        assert generate(engine, PROMPTS[0], 2).tokens


def test_killed_first_node_fails_the_request_fast(dense_ckpt: Path, nodes: list[str], all_nodes) -> None:
    # The ring's end: the last node's link back to the first breaks as well as the coordinator's own.
    victim, victim_address = all_nodes[4]
    with remote(dense_ckpt, [victim_address, nodes[2]]) as engine:
        assert engine.pipeline.health()[-1].ring == victim_address
        _kill_mid_generation(engine, victim, victim_address, PROMPTS[16])


def test_hung_node_fails_the_request_fast_and_others_go_on(
    dense_engine: Engine, dense_ckpt: Path, nodes: list[str], all_nodes
) -> None:
    hung, hung_address = all_nodes[1]  # stopped, then resumed: it serves on afterwards
    with remote(dense_ckpt, [nodes[0], hung_address]) as engine:
        expected = generate(dense_engine, PROMPTS[14], 2).tokens
        other = Driver(engine.pipeline, "other", engine.tokenizer.encode(PROMPTS[14]), depth=2)
        victim = engine.generate(GenerationRequest(engine.tokenizer.encode(PROMPTS[15]), max_tokens=1000,
                                                   mtp_depth=2))
        next(victim)
        hung.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(NodeFailure) as err:
            for _ in victim:
                pass
        assert time.monotonic() - t0 < 5.0
        assert hung_address in str(err.value) and "stopped answering" in str(err.value)
        hung.send_signal(signal.SIGCONT)
        while len(other.tokens) < len(expected):  # the other sequence's state on both nodes is intact
            other.round()
        assert other.tokens[: len(expected)] == expected
        engine.pipeline.release("other")
