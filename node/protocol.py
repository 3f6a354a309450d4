"""Plain messages between the engine and the stages (in-process or over gRPC)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple


class StepKind(str, Enum):
    PREFILL = "prefill"  # a prompt chunk; every position is kept
    DECODE = "decode"  # [y, d1..dK]: verified, then rolled back to the accepted prefix by the next commit


MAX_MTP_DEPTH = 8  # drafts per round a stage accepts


class StageError(Exception):
    """A request a stage refuses (malformed, unknown sequence, out of order). Its state is unchanged."""


class StageUnavailable(RuntimeError):
    """A stage cannot be reached, died or stopped answering: the steps in flight are lost."""


GREEDY_BELOW = 1e-5  # the least temperature that samples: logits over a tinier one overflow (the API decodes greedily)
MIN_REPETITION_PENALTY = 1e-3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    # Logits processors (node/processors.py) and what to report; applied alike with and without MTP.
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_logprobs: int = -1  # -1: no log-probabilities; 0-20: the emitted token's and this many others'
    grammar: str | None = None  # output held to this llguidance grammar (constraints.py), by a stage with the tokenizer
    prompt_logprobs: int = -1  # -1: none; 0-20: each prompt token's log-probability (scoring.py) and this many others'
    min_tokens: int = 0  # vLLM's: the tokens that end the sequence are refused until this many were generated

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not (self.temperature == 0.0 or GREEDY_BELOW <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number of at least {GREEDY_BELOW:g} "
                             f"(below, logits over it overflow), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k >= 2**31:  # the wire carries it as int32
            raise ValueError(f"top_k must be below 2^31, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # the wire carries it as int64
            raise ValueError(f"seed must be a 64-bit integer, in [-2^63, 2^63), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        # (below its least, a logit over the penalty passes float32's range: inf, then NaN probabilities)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 10], "
                             f"got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not 0 <= token < 2**31 or not -100.0 <= bias <= 100.0:  # ids cross the wire as int32
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        if not -1 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if not 0 <= self.min_tokens < 2**31:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not -1 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar must not be empty")


@dataclass(frozen=True)
class Commit:
    """The outcome of decode step `step`: all a stage ever learns about acceptance."""

    step: int
    accepted: int  # drafts accepted, 0..K
    trim: int  # attention KV entries to drop: K - accepted


@dataclass
class StepRequest:
    seq_id: str
    step: int  # 0, 1, 2, ... per sequence; prefill chunks first, then decode rounds
    kind: StepKind
    tokens: list[int]  # this step's input tokens (the last stage needs them for MTP and acceptance)
    final: bool = False  # prefill: the prompt's last chunk, sample the first token
    commit: Commit | None = None  # outcome of the previous decode step, applied before this one
    params: SamplingParams | None = None  # with step 0: how the last stage samples
    mtp_depth: int = 0  # with step 0: drafts per round (0 = no speculation); with mtp_auto, the most
    mtp_auto: bool = False  # with step 0: the last stage picks each round's depth in 0..mtp_depth
    # Tokens still wanted from this step on, and the tokens that end the sequence: with them a remote
    # last node starts the next round itself (see node/server.py). In-process stages ignore both.
    budget: int = 0
    stop_tokens: tuple[int, ...] = ()
    group: int = 0  # remote prefill: once prefilled, the sequence joins this ring group (node/groups.py)
    resumed_at: int = 0  # with step 0: the prompt's tokens from here on were generated before (a resume)
    prefix: str = ""  # with step 0: the sequence goes on from this kept prompt prefix (node/prefixes.py)
    keep: str = ""  # a prompt's last step through a node: keep the state before it under this key
    keep_end: str = ""  # a prompt's last step meant for a group: keep the sequence's state at its end here


class Scored(NamedTuple):
    """A prompt token read against the positions before it: its log-probability, its rank among all
    tokens (1: the most likely) and the most likely tokens with theirs, most likely first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class StepOutput:
    """What the last stage returns: token ids and counts, never logits or state."""

    seq_id: str
    step: int
    tokens: list[int] = field(default_factory=list)  # accepted drafts then the correction/bonus token
    accepted: int = 0
    drafted: int = 0
    drafts: list[int] = field(default_factory=list)  # the next round's drafts
    commit: Commit | None = None  # to echo to every stage with the next step
    # per emitted token, when asked (params.top_logprobs >= 0): its log-probability and the top others'
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # a prefill step's, when asked (params.prompt_logprobs >= 0): per token of the step, in order (none
    # for the prompt's first token, which nothing before it predicts)
    prompt_logprobs: list[Scored] = field(default_factory=list)
    continued: bool = False  # the last node has already started the next step (remote pipelines)
    keep_refused: bool = False  # a prompt's last step: a node did not keep its prefix (remote pipelines)


@dataclass
class GroupRow:
    """One sequence in a group round: its tokens [y, d1..dK]; its previous round's outcome (None when
    it joins now, or on the round a non-last node never saw the outcome of)."""

    seq_id: str
    tokens: list[int]
    commit: Commit | None = None
    join: bool = False


@dataclass
class GroupEnd:
    """A row that left its group as its sequence ended: its last round's outcome, applied before it
    leaves, and the key its state is then kept under (its client's), `position` tokens long."""

    seq_id: str
    commit: Commit
    key: str
    position: int
    drafts: bool = False  # the last node kept the MTP head's part too
    refused: bool = False  # a node could not keep it (no room): it is dropped everywhere


@dataclass
class GroupRound:
    client_id: str
    group: int
    round: int
    rows: list[GroupRow]
    from_last: bool = False  # sent by the last node (an ending frame that came back around stops there)
    ends: list[GroupEnd] = field(default_factory=list)  # rows that left as they ended, their states kept

    @property
    def key(self) -> tuple[str, int]:
        return self.client_id, self.group
