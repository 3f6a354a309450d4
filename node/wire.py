"""The wire: gRPC channel settings and the conversions between protobuf messages and the plain
protocol of node/protocol.py (steps, outputs, commits, tensors as raw bytes)."""

from __future__ import annotations

from typing import Any

import grpc

from ..proto import mtpipe_pb2 as pb
from .protocol import (Commit, GroupEnd, GroupRound, GroupRow, SamplingParams, Scored, StageError, StepKind, StepOutput,
                       StepRequest)
from .tls import TARGET_NAME_OPTION, channel_credentials, is_secured_node

# The largest message is a prefill chunk's hidden states: 512 tokens x hidden x 4 bytes is 16 MiB at
# hidden 8192. Both ends allow 64 MiB; the coordinator shrinks its prefill chunk if a model needs more.
MAX_MESSAGE_BYTES = 64 << 20
# Liveness is HTTP/2 keepalive, answered by gRPC's core even while a node's loop is busy computing: a
# peer that dies or stops (SIGSTOP, a kernel hang, a pulled cable) is cut off within ~2.5 s, and every
# call on that connection fails at once. A node whose loop hangs while the core still answers is found by
# the coordinator's lease renewals, which its loop answers between steps (coordinator/pipeline/renewals.py).
KEEPALIVE_MS = 1000
PING_TIMEOUT_MS = 1500
RECONNECT_FIRST_MS, RECONNECT_MAX_MS = 500, 2000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),  # a lost frame is an error the caller must see, not a silent replay
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer gone for a while is tried again within a couple of seconds once it is back (gRPC's own backoff
    # grows to two minutes: a restarted node would wait that long to be seen, the cluster down meanwhile).
    # Not grpc.min_reconnect_backoff_ms: gRPC takes it for the time a connection may take to be made too.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_FIRST_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # and the node pings its clients: a coordinator that stopped (a laptop asleep) leaves, with its
    # subscription, rather than hold the node for ever
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),  # a second node on a port in use must fail, not share it
]

_KINDS = {pb.PREFILL: StepKind.PREFILL, pb.DECODE: StepKind.DECODE}
_KINDS_PB = {v: k for k, v in _KINDS.items()}

# -- wire <-> protocol ----------------------------------------------------------------------------


def make_channel(target: str, secret: str | None = None) -> grpc.Channel:
    """A channel to a node: mutual TLS keyed by the cluster secret (tls.py) when there is one."""
    if secret:
        return grpc.secure_channel(target, channel_credentials(secret), options=[*CHANNEL_OPTIONS, TARGET_NAME_OPTION])
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def make_aio_channel(target: str, secret: str | None = None) -> grpc.aio.Channel:
    """The same from a node's event loop (the next stage, a peer it fetches weights from)."""
    if secret:
        return grpc.aio.secure_channel(target, channel_credentials(secret),
                                       options=[*CHANNEL_OPTIONS, TARGET_NAME_OPTION])
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def request_to_frame(req: StepRequest, client_id: str) -> pb.Frame:
    f = pb.Frame(
        client_id=client_id,
        seq_id=req.seq_id,
        step=req.step,
        kind=_KINDS_PB[req.kind],
        tokens=req.tokens,
        final=req.final,
        mtp_depth=req.mtp_depth,
        mtp_auto=req.mtp_auto,
        budget=req.budget,
        stop_tokens=req.stop_tokens,
        group=req.group,
        resumed_at=req.resumed_at,
        prefix=req.prefix,
        keep=req.keep,
        keep_end=req.keep_end,
    )
    if req.commit is not None:
        f.commit.CopyFrom(pb.Commit(step=req.commit.step, accepted=req.commit.accepted, trim=req.commit.trim))
    if req.params is not None:
        f.params.CopyFrom(params_to_pb(req.params))
    return f


def frame_to_request(f: pb.Frame) -> StepRequest:
    if f.kind not in _KINDS:
        raise StageError(f"unknown step kind {f.kind}")
    if not f.seq_id:
        raise StageError("a step needs a sequence id")
    if f.budget < 0:
        raise StageError(f"budget must be >= 0, got {f.budget}")
    if f.group < 0:
        raise StageError(f"group must be >= 0, got {f.group}")
    commit = Commit(f.commit.step, f.commit.accepted, f.commit.trim) if f.HasField("commit") else None
    params = params_from_pb(f.params) if f.HasField("params") else None
    return StepRequest(f.seq_id, f.step, _KINDS[f.kind], list(f.tokens), f.final, commit, params, f.mtp_depth,
                       f.mtp_auto, f.budget, tuple(f.stop_tokens), f.group, f.resumed_at, f.prefix, f.keep, f.keep_end)


def params_to_pb(p: SamplingParams) -> pb.Sampling:
    s = pb.Sampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                    logit_bias=[pb.TokenBias(token=t, bias=b) for t, b in p.logit_bias],
                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                    min_tokens=p.min_tokens)
    if p.seed is not None:
        s.seed = p.seed
    if p.repetition_penalty != 1.0:
        s.repetition_penalty = p.repetition_penalty
    if p.top_logprobs >= 0:  # presence says "asked": 0 (the emitted token's alone) differs from unset
        s.top_logprobs = p.top_logprobs
    if p.grammar is not None:
        s.grammar = p.grammar
    if p.prompt_logprobs >= 0:
        s.prompt_logprobs = p.prompt_logprobs
    return s


def params_from_pb(p: pb.Sampling) -> SamplingParams:
    return SamplingParams(
        p.temperature, p.top_p, p.top_k, p.min_p, p.seed if p.HasField("seed") else None,
        logit_bias=tuple((b.token, b.bias) for b in p.logit_bias),
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        top_logprobs=p.top_logprobs if p.HasField("top_logprobs") else -1,
        grammar=p.grammar if p.HasField("grammar") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else -1,
        min_tokens=p.min_tokens,
    )


def output_to_result(out: StepOutput) -> pb.StepResult:
    r = pb.StepResult(
        seq_id=out.seq_id, step=out.step, tokens=out.tokens, accepted=out.accepted, drafted=out.drafted,
        drafts=out.drafts, continued=out.continued, keep_refused=out.keep_refused,
    )
    if out.commit is not None:
        r.commit.CopyFrom(pb.Commit(step=out.commit.step, accepted=out.commit.accepted, trim=out.commit.trim))
    for lp, top in out.logprobs:  # empty unless the client asked for them
        r.logprobs.add(logprob=lp, top_ids=[i for i, _ in top], top_logprobs=[v for _, v in top])
    for lp, rank, top in out.prompt_logprobs:
        r.prompt_logprobs.add(logprob=lp, rank=rank, top_ids=[i for i, _ in top], top_logprobs=[v for _, v in top])
    return r


def result_to_output(r: pb.StepResult) -> StepOutput:
    commit = Commit(r.commit.step, r.commit.accepted, r.commit.trim) if r.HasField("commit") else None
    logprobs = [(e.logprob, list(zip(e.top_ids, e.top_logprobs))) for e in r.logprobs]
    scored = [Scored(e.logprob, e.rank, list(zip(e.top_ids, e.top_logprobs))) for e in r.prompt_logprobs]
    return StepOutput(r.seq_id, r.step, list(r.tokens), r.accepted, r.drafted, list(r.drafts), commit,
                      logprobs=logprobs, prompt_logprobs=scored, continued=r.continued, keep_refused=r.keep_refused)


def next_round(frame: pb.Frame, out: StepOutput) -> pb.Frame | None:
    """The frame of the decode round after `out`, if the client still wants tokens and none of them
    was a stop token: what the client would send next, the commit riding on it as always."""
    left = frame.budget - len(out.tokens)
    if frame.budget <= 0 or not out.tokens or left <= 0 or not set(out.tokens).isdisjoint(frame.stop_tokens):
        return None
    nxt = pb.Frame(client_id=frame.client_id, seq_id=frame.seq_id, step=frame.step + 1, kind=pb.DECODE,
                   tokens=[out.tokens[-1], *out.drafts], budget=left, stop_tokens=frame.stop_tokens, ring=True)
    if out.commit is not None:
        nxt.commit.CopyFrom(pb.Commit(step=out.commit.step, accepted=out.commit.accepted, trim=out.commit.trim))
    return nxt


def frame_to_group(f: pb.Frame) -> GroupRound:
    rows = [GroupRow(r.seq_id, list(r.tokens), None if r.join else Commit(f.step - 1, r.accepted, r.trim), r.join)
            for r in f.rows]
    for r in [*f.rows, *f.ends]:
        if r.accepted < 0 or r.trim < 0:
            raise StageError(f"row {r.seq_id!r}: negative commit")
    ends = [end_from_pb(e, f.step - 1) for e in f.ends]
    return GroupRound(f.client_id, f.group, f.step, rows, from_last=f.ring, ends=ends)


def group_to_frame(rnd: GroupRound) -> pb.Frame:
    # `ring` only on an ending frame (where it says who sent it): every byte of a round counts per hop
    f = pb.Frame(client_id=rnd.client_id, kind=pb.GROUP, group=rnd.group, step=rnd.round,
                 ring=rnd.from_last and not rnd.rows)
    for r in rnd.rows:
        row = f.rows.add(seq_id=r.seq_id, tokens=r.tokens, join=r.join)
        if r.commit is not None:
            row.accepted, row.trim = r.commit.accepted, r.commit.trim
    f.ends.extend(end_to_pb(e) for e in rnd.ends)
    return f


def end_to_pb(e: GroupEnd) -> pb.End:
    return pb.End(seq_id=e.seq_id, accepted=e.commit.accepted, trim=e.commit.trim, key=e.key, position=e.position,
                  drafts=e.drafts, refused=e.refused)


def end_from_pb(e: pb.End, step: int = 0) -> GroupEnd:
    return GroupEnd(e.seq_id, Commit(step, e.accepted, e.trim), e.key, e.position, e.drafts, e.refused)


def group_result(rnd: GroupRound, outs: list[Any], kept: list[GroupEnd] = ()) -> pb.GroupResult:
    """`outs`: the RowOutputs to hand out (batch_head.py); `kept`: the ends the round carried."""
    return pb.GroupResult(group=rnd.group, round=rnd.round, rows=[output_to_result(o.output) for o in outs],
                          kept=[end_to_pb(e) for e in kept])


def tensor_to_pb(a: Any) -> pb.Tensor:
    from .tensors import to_raw

    raw = to_raw(a)
    return pb.Tensor(dtype=raw.dtype, shape=raw.shape, data=raw.data)


def tensor_from_pb(t: pb.Tensor) -> Any:
    from .tensors import TensorError, from_raw

    try:
        return from_raw(t.dtype, list(t.shape), t.data)
    except TensorError as e:
        raise StageError(str(e)) from None


def describe_unreached(target: str, secret: str | None, e: Exception) -> str:
    """`describe_rpc_error`, and when the node was called without a secret and asks for one, that."""
    text = describe_rpc_error(e)
    if not secret and isinstance(e, grpc.RpcError) and is_secured_node(target):  # (no channel without TLS could work)
        text += ("; the node asks for the cluster secret and none was given ($MTPIPE_SECRET, --secret-file, "
                 "cluster.yaml)")
    return text


def describe_rpc_error(e: Exception) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        details = e.details() or ""
        if "handshake failed" in details.lower():  # TLS keyed by another secret (tls.py)
            return f"{e.code().name}: refused: not this cluster's secret ({details})"
        return f"{e.code().name}: {details}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
