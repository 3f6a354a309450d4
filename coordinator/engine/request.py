"""What a caller asks the engine for and what it gets back, and the one place those requests are checked."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...node.protocol import MAX_MTP_DEPTH, SamplingParams, Scored, StepOutput

AUTO = "auto"
AUTO_MAX_DEPTH = 3  # the most drafts `auto` puts in a round


def resolve_depth(depth: int | str | None, has_mtp: bool) -> tuple[int, bool]:
    """(drafts per round, auto) for a requested depth; None is `auto` where the model has an MTP head."""
    if depth is None:
        depth = AUTO if has_mtp else 0
    if depth == AUTO:
        return (AUTO_MAX_DEPTH, True) if has_mtp else (0, False)
    if isinstance(depth, str):
        raise RequestError(f"mtp_depth must be a number of drafts or 'auto', got {depth!r}", "mtp_depth")
    return depth, False


class RequestError(ValueError):
    """A request the engine refuses before any stage is touched; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    max_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    mtp_depth: int = 0  # drafts per round; with mtp_auto, the most a round may carry
    stop: list[str] = field(default_factory=list)
    mtp_auto: bool = False  # the last stage picks each round's depth (node/depth.py)
    skip_special_tokens: bool = True  # the text leaves out special tokens (`<|im_start|>`...), as vLLM's does
    # vLLM's: tokens that end it as EOS does (not in the text); EOS that does not end it; the stop string kept
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: lower goes first. Those waiting for room are admitted in order of it, then of arrival; where
    # running rows must leave for room, the ones with the highest go first (the last admitted among them).
    priority: int = 0

    def ends(self, eos: set[int]) -> frozenset[int]:
        """The tokens that end it: the model's EOS tokens (unless it ignores them) and its own."""
        return frozenset(() if self.ignore_eos else eos).union(self.stop_token_ids)

    @property
    def depth_label(self) -> int | str:
        """How usage reports the depth: the fixed depth, or "auto"."""
        return "auto" if self.mtp_auto and self.mtp_depth else self.mtp_depth


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, taken from a kept prefix instead of prefilled
    generation_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    depths: dict[int, int] = field(default_factory=dict)  # rounds by drafts they carried
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    preempted: int = 0  # times it left the batch to wait for memory, and went on later

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tps(self) -> float:  # (tokens prefilled: those taken from a kept prefix were not)
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes out of prefill; decode speed counts the rest.
        n = max(self.generation_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds else 0.0

    def record_round(self, out: StepOutput) -> None:
        self.rounds += 1
        self.depths[out.drafted] = self.depths.get(out.drafted, 0) + 1
        self.drafted += out.drafted
        self.accepted += out.accepted
        while len(self.drafted_per_position) < out.drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(out.drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < out.accepted)

    def ended_within(self, out: StepOutput, emitted: int) -> None:
        """The request ended inside this (recorded) round after `emitted` of its tokens: drafts accepted
        past the end (an EOS, a stop, max_tokens) do not count as accepted."""
        for i in range(emitted, out.accepted):
            self.accepted -= 1
            self.accepted_per_position[i] -= 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.acceptance, 4),
            "acceptance_per_position": [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "depths": {str(k): v for k, v in sorted(self.depths.items())},
            "drafted_per_position": self.drafted_per_position,
            "accepted_per_position": self.accepted_per_position,
            "prefill_tps": round(self.prefill_tps, 2),
            "decode_tps": round(self.decode_tps, 2),
            "preempted": self.preempted,
        }


@dataclass
class GenerationChunk:
    text: str
    tokens: list[int]
    finish_reason: str | None = None  # "stop" or "length" on the last chunk
    stats: GenerationStats | None = None
    # per token of `tokens`, when asked: its log-probability and the most likely tokens with theirs
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # on the first chunk, when asked (params.prompt_logprobs): the prompt's tokens but its first, scored
    prompt_logprobs: list[Scored] | None = None
    stop_reason: str | int | None = None  # on the last: the stop string or stop token id that ended it (`stop_reason`)
    cached_tokens: int | None = None  # on the first: its prompt's tokens taken from a kept prefix (usage before the end)

    @property
    def shown(self) -> list[int]:
        """Its tokens but the one that ended the request, if it holds it (an EOS or a stop token id, which
        vLLM counts and mlx-lm does not hand out): what compares with mlx-lm's output."""
        ended = ends_on_token(self.finish_reason, self.stop_reason)
        return self.tokens[:-1] if ended and self.tokens else self.tokens


def ends_on_token(finish_reason: str | None, stop_reason: str | int | None) -> bool:
    """Whether a request that finished so ended on a token (EOS, or a stop token id), the last of its
    tokens: stopped, and not by a stop string."""
    return finish_reason == "stop" and not isinstance(stop_reason, str)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    stop_reason: str | int | None = None


def collect(chunks: Iterable[GenerationChunk]) -> GenerationResult:
    """A whole generation from its chunks (the last carries finish_reason and stats)."""
    parts, tokens = [], []
    for chunk in chunks:
        parts.append(chunk.text)
        tokens += chunk.tokens
        if chunk.finish_reason:
            return GenerationResult("".join(parts), tokens, chunk.finish_reason, chunk.stats, chunk.stop_reason)
    raise RuntimeError("generation ended without a finish reason")


def check_request(req: GenerationRequest, *, max_context: int, has_mtp: bool, constrains: bool = False) -> None:
    """Every rule a generation request must meet, with the field each rule is about (`constrains`: the
    engine holds output to a grammar)."""
    if not req.prompt_tokens:
        raise RequestError("the prompt is empty", "prompt")
    if not 0 <= req.mtp_depth <= MAX_MTP_DEPTH:
        raise RequestError(f"mtp_depth must be in [0, {MAX_MTP_DEPTH}], got {req.mtp_depth}", "mtp_depth")
    if req.mtp_depth > 0 and not has_mtp:
        raise RequestError("this model runs without an MTP head (--no-mtp, or none in the checkpoint); use mtp_depth 0",
                           "mtp_depth")
    # (a prompt only scored, max_tokens 0, may fill the context: its one token is never fed)
    room = context_room(len(req.prompt_tokens), req.mtp_depth, max_context) + (req.max_tokens == 0)
    # (what overflows the context opens with vLLM's words: clients such as LiteLLM tell it by them, and
    # shorten the conversation; drafts that do not fit are a matter of mtp_depth, not of its length)
    limit = f"This model's maximum context length is {max_context} tokens. However,"
    if room <= 0 and context_room(len(req.prompt_tokens), 0, max_context) > 0:  # (the drafts do not fit)
        raise RequestError(f"the prompt ({len(req.prompt_tokens)} tokens) leaves no room in the context of "
                           f"{max_context} tokens for {req.mtp_depth} draft token(s); use mtp_depth 0 or auto",
                           "mtp_depth", "context_length_exceeded")
    if room <= 0:
        raise RequestError(f"{limit} the prompt has {len(req.prompt_tokens)} tokens, which leaves no room for a "
                           "reply: shorten it", "prompt", "context_length_exceeded")
    if req.max_tokens < 0 or (req.max_tokens == 0 and req.params.prompt_logprobs < 0):
        raise RequestError(f"max_tokens must be positive (0 only to score the prompt), got {req.max_tokens}",
                           "max_tokens")
    if req.max_tokens > room and req.max_tokens + len(req.prompt_tokens) <= max_context:  # (its drafts' room)
        raise RequestError(f"max_tokens ({req.max_tokens}) and the prompt ({len(req.prompt_tokens)} tokens) leave no "
                           f"room in the context of {max_context} tokens for {req.mtp_depth} draft token(s): at most "
                           f"{room} tokens with them; use mtp_depth 0 or auto", "max_tokens", "context_length_exceeded")
    if req.max_tokens > room:
        raise RequestError(f"{limit} you requested {req.max_tokens + len(req.prompt_tokens)} tokens "
                           f"({len(req.prompt_tokens)} in the prompt, {req.max_tokens} for max_tokens): at most {room} "
                           "tokens can be generated", "max_tokens", "context_length_exceeded")
    try:
        req.params.validate()
    except ValueError as e:
        raise RequestError(str(e), str(e).split()[0]) from None
    if req.params.min_tokens > req.max_tokens:
        raise RequestError(f"min_tokens ({req.params.min_tokens}) must not exceed max_tokens ({req.max_tokens})",
                           "min_tokens")
    if req.params.min_tokens and req.params.grammar is not None:  # (a complete format leaves only its ends)
        raise RequestError("min_tokens cannot be given with an output format", "min_tokens")
    if req.params.grammar is not None and not constrains:
        raise RequestError("output held to a format (response_format, structured_outputs, guided_*) needs the last "
                           "stage to hold the model's tokenizer (a node that loaded its shard from a model directory)",
                           "response_format")


def check_vocabulary(req: GenerationRequest, vocab_size: int) -> None:
    """Token ids (prompt, logit_bias) the model embeds: a batch refuses them before any round."""
    bad = next((t for t in req.prompt_tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    bad = next((t for t in req.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"stop_token_ids names token id {bad}, outside the vocabulary [0, {vocab_size})",
                           "stop_token_ids")
    bad = next((t for t, _ in req.params.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"logit_bias names token id {bad}, outside the vocabulary [0, {vocab_size})", "logit_bias")


def context_room(prompt_tokens: int, mtp_depth: int, max_context: int) -> int:
    """Tokens that can still be generated: a round may hold mtp_depth drafts past the last token."""
    return max_context - prompt_tokens - mtp_depth


def fit_to_context(prompt_tokens: int, depth: int, auto: bool, max_tokens: int | None, default_max_tokens: int,
                   max_context: int) -> tuple[int, bool, int]:
    """(depth, auto, max_tokens) of a request as it is run: a default max_tokens within what the context
    leaves beside the drafts (a default never turns `auto` off); no drafts for a single token (it comes
    from the prompt's last step: no round carries drafts); and `auto` drafting only where the context
    leaves room for them, so that it refuses nothing plain decoding serves."""
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, context_room(prompt_tokens, depth, max_context)))
    if max_tokens <= 1:
        return 0, False, max_tokens
    if auto:
        depth = max(0, min(depth, context_room(prompt_tokens, 0, max_context) - max_tokens))
        auto = depth > 0
    return depth, auto, max_tokens


def ended_in_stages(new: list[int], eos: set[int], generated: int, max_tokens: int) -> bool:
    """After `take_tokens` ended a request: whether its row ended in the stages too, where its reply
    does (its budget, or one of the tokens that end it, `GenerationRequest.ends`, the last handed
    out, whatever stop string its text may hold). Not after a stop string in a token before: the
    state then holds tokens past it, which no next turn has, and the row is released rather than ended."""
    return generated >= max_tokens or (bool(new) and new[-1] in eos)


def stop_reason(finish: str, new: list[int], text: Any, req: GenerationRequest) -> str | int | None:
    """vLLM's stop_reason of a request `take_tokens` ended (`finish`): the stop string, or the
    `stop_token_ids` token, that ended it (None for EOS or max_tokens). Read once its text is released."""
    if finish != "stop":
        return None
    if text.stopped:
        return text.matched
    return new[-1] if new and new[-1] in req.stop_token_ids else None


def take_tokens(tokens: list[int], eos: set[int], text: Any, generated: int, max_tokens: int) -> tuple[list[int], str | None]:
    """A round's tokens as the request sees them: up to a token that ends it (`eos`: EOS or a stop
    token id), a stop string (`text`, a TextStream, gets each one) or max_tokens; with the finish
    reason when one of those ended it. As in vLLM, the token that ends it is one of its tokens
    (counted, with its log-probability), its text only kept when asked (TextStream.end_with)."""
    new: list[int] = []
    if generated >= max_tokens:  # (none wanted: the prompt was only scored)
        return new, "length"
    for tok in tokens:
        if tok in eos:
            new.append(tok)
            text.end_with(tok)
            return new, "stop"
        new.append(tok)
        text.add(tok)
        if text.stopped:
            return new, "stop"
        if generated + len(new) >= max_tokens:
            text.flush()  # the last token may complete a stop string the detokenizer still holds
            return new, "stop" if text.stopped else "length"
    return new, None
