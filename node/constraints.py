"""Output held to a grammar (OpenAI's `response_format`: JSON, or JSON that fits a schema), token by token.

llguidance's matcher says, from the tokens emitted so far, which tokens may come next; the others' logits
become -inf before anything picks or samples from them. A verify scores K+1 positions at once, and
position j must be masked as decoding one token at a time would have masked it, with d1..dj accepted:
the matcher takes the drafts one by one, a mask before each, and gives them back; the tokens the round
emits are then taken for good. A draft the grammar refuses is never accepted (its own position's mask
excludes it), so the positions after it are left unmasked: nothing is read from them. Greedy output
thus equals plain decoding under the same grammar at any depth, and sampled output keeps its
distribution. A sequence drafts what the grammar forces (a schema's keys and punctuation) where it forces
something (a sampled one then proposes them with certainty: the acceptance test reads a one-hot draft
distribution); else the MTP head's drafts, which a greedy or seeded sequence cuts at the first the
grammar refuses (an unseeded sampled one may not: whether a draw is kept must not depend on the draw);
once its format is complete it drafts nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from .protocol import SamplingParams, StageError

log = logging.getLogger(__name__)

# JSON as json.dumps lays it out, with no other whitespace: a weak or sampled model is not led into runs
# of blank space the grammar would allow (a schema's own "x-guidance" options may say otherwise).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


COMPILED_KEPT = 32  # grammars kept compiled, the most recently used


class Grammars:
    """What compiles a request's grammar for this model: its tokenizer in llguidance's form (`vocab`: the
    model's logits, which may outnumber the tokenizer's words; the ones past it are never allowed).
    A grammar is compiled when a request is checked (on the API's thread, where the engine checks it)
    and kept: the MLX thread then copies a compiled matcher for each sequence instead of compiling,
    which for a large schema can take longer than many rounds."""

    def __init__(self, hf_tokenizer: Any, vocab: int, eos: list[int]):
        self.tokenizer = llguidance_tokenizer(hf_tokenizer, vocab, sorted(eos))
        self.vocab = vocab
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar -> a matcher at its start, never fed
        self._lock = threading.Lock()

    def check(self, grammar: str) -> None:
        """ValueError naming what is wrong with `grammar` for this tokenizer (compiled, and kept)."""
        self._matcher(grammar)

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self._matcher(grammar).deep_copy(), self.vocab)

    def _matcher(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return matcher


def llguidance_tokenizer(hf_tokenizer: Any, vocab: int, eos: list[int]) -> Any:
    """llguidance's form of a fast Hugging Face tokenizer, the text a grammar forces tokenized as plain text.
    llguidance counts every added token as special (no text matches one; a Lark grammar names one as
    `<|im_end|>`), but tokenizes the text a grammar forces with the tokenizer itself, which splits an
    added token's text out as that token: where a format's own text holds one (`<|im_start|>`, Qwen's
    `</think>`), its mask allowed only that token, its own check then refused it, and the output came
    loose from the format. Here that text goes through the tokenizer's normalizer, pre-tokenizer and
    model alone (`PlainText`); a tokenizer that cannot be read so keeps llguidance's own tokenization.
    ValueError for a tokenizer that is not a fast one."""
    from llguidance import LLTokenizer, TokenizerWrapper, hf

    own = hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos)
    try:
        return LLTokenizer(TokenizerWrapper(PlainText(hf_tokenizer, own, vocab)), n_vocab=vocab, eos_token=eos)
    except Exception as e:  # (what llguidance or the tokenizers library raise for one they cannot take)
        log.warning("a format's text that holds an added token's text may come loose with this tokenizer: %s", e)
        return own


ROUND_TRIP = ("x", " x", "a b", "<|im_start|>x", "{\"k\": 1}")  # texts `PlainText` must give back as they are


class PlainText:
    """A tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes and the special ids as
    llguidance's own form of it has them (`own`: the added tokens named as tags, `<think>`, and the ids
    past the tokenizer's words), and text tokenized without the added tokens' splitting."""

    bos_token_id = None

    def __init__(self, hf_tokenizer: Any, own: Any, vocab: int):
        backend = hf_tokenizer.backend_tokenizer
        self._normalizer, self._pre, self._model = backend.normalizer, backend.pre_tokenizer, backend.model
        self.eos_token_id = own.eos_token
        self.tokens = [own.decode_bytes([i]) for i in range(vocab)]
        self.special_token_ids = [i for i in range(vocab) if own.is_special_token(i)]
        for text in ROUND_TRIP:  # (parts that add to a text, as a SentencePiece normalizer's "▁", do not serve)
            if b"".join(self.tokens[t] for t in self(text)) != text.encode():
                raise ValueError(f"its parts do not give {text!r} back")

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (llguidance then hands over text, not bytes)
            raise TypeError("text only")
        if self._normalizer is not None:
            text = self._normalizer.normalize_str(text)
        pieces = self._pre.pre_tokenize_str(text) if self._pre is not None else [(text, (0, len(text)))]
        return [token.id for piece, _ in pieces for token in self._model.tokenize(piece)]


def grammars_for(tokenizer: Any, vocab: int, eos: set[int] | list[int]) -> Grammars | None:
    """Grammars for a model with `tokenizer` (mlx-lm's wrapper or a Hugging Face one); None, logged, where
    llguidance cannot take it (not a fast tokenizer) or is not installed."""
    hf_tokenizer = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        return Grammars(hf_tokenizer, vocab, list(eos))
    except (ImportError, ValueError) as e:
        log.warning("output cannot be held to a grammar (response_format) with this tokenizer: %s", e)
        return None


def grammars_in(model_path: str, vocab: int, eos: list[int]) -> Grammars | None:
    """A node's grammars, from the tokenizer in the directory its shard came from (a model directory, or
    the last shard's cache entry, which its fetch fills with the tokenizer files too); None where there is
    none. Reads files: off the event loop."""
    from ..models.fingerprint import TOKENIZER_FILES

    path = Path(model_path)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        log.info("no tokenizer in %s: output cannot be held to a grammar on this node", path)
        return None
    from mlx_lm.utils import load_tokenizer

    try:
        tokenizer = load_tokenizer(path, eos_token_ids=eos or None)
        return grammars_for(tokenizer, vocab, tokenizer.eos_token_ids)  # (as one machine's: the tokenizer's too)
    except Exception as e:  # (the shard serves all the same)
        log.warning("the tokenizer in %s does not load (%s): output cannot be held to a grammar on this node", path, e)
        return None


def constraint_for(params: SamplingParams, grammars: Grammars | None, build: bool = True) -> Constraint | None:
    """The request's grammar compiled for a sequence (None: it has none, or not `build`: only checked);
    StageError where it cannot be."""
    if params.grammar is None:
        return None
    if grammars is None:
        raise StageError("this stage holds no tokenizer to hold output to a grammar (response_format)")
    try:
        if not build:
            grammars.check(params.grammar)
            return None
        return grammars.constraint(params.grammar)
    except ValueError as e:
        raise StageError(f"the grammar does not compile: {e}") from None


def grammar_of_schema(schema: dict[str, Any]) -> str:
    """The grammar of JSON that fits `schema` (a JSON Schema; {"type": "object"}: any object), laid out
    as JSON_LAYOUT. ValueError if it is not a JSON object."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)


def grammar_error(grammar: str) -> str:
    """What is wrong with `grammar` whatever the tokenizer ("" if nothing): it does not compile, or no
    text matches it (output held to it would end at once, empty, as if the model had nothing to say)."""
    import numpy as np
    from llguidance import LLMatcher

    if error := LLMatcher.validate_grammar(grammar):
        return error
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():  # (it names what a byte is not, as a model's special token: its tokenizer tells)
        return ""
    allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    if not matcher.is_accepting() and not allowed[:256].any():
        return "no text matches it"
    return ""


@functools.cache
def _byte_tokenizer() -> Any:
    """llguidance's tokenizer of single bytes (and an end token): a grammar's text as any byte-level one reads it."""
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=256)


class _Bytes:
    bos_token_id = None
    eos_token_id = 256
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (as PlainText)
            raise TypeError("text only")
        return list(text.encode())


class Constraint:
    """One sequence's grammar, at the tokens it has emitted."""

    def __init__(self, matcher: Any, vocab: int):
        self.matcher = matcher
        self.vocab = vocab
        self.broken = False  # took a token the grammar refuses (not picked under its mask): no longer held

    def masks(self, drafts: list[int], positions: int) -> np.ndarray:
        """The tokens allowed at each of `positions` positions [positions, vocab] (bool), position j after
        drafts[:j] taken as `take` would take them, so that a verify masks what decoding one token at a
        time would; the grammar is left where it was."""
        out = np.ones((positions, self.vocab), dtype=bool)
        taken = 0
        for j in range(positions):
            if self.broken:
                break
            out[j] = self._allowed()
            if j == positions - 1:
                break
            if self.matcher.is_stopped():  # (complete: what follows moves it no more)
                out[j + 1 :] = out[j]
                break
            if self.matcher.validate_tokens([drafts[j]]) != 1:  # (refused: never accepted, or `take` lets go)
                break
            self.matcher.consume_token(drafts[j])
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return out

    @property
    def finished(self) -> bool:
        """Complete: only an end-of-sequence token may follow, no drafts are worth making."""
        return not self.broken and self.matcher.is_stopped()

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (none where it leaves a choice): drafts that
        are what decoding would pick, as near as the model follows the tokenizer's own splits."""
        return [] if self.broken or limit <= 0 else self.matcher.compute_ff_tokens()[:limit]

    def allowed_prefix(self, drafted: list[int]) -> list[int]:
        """`drafted` up to the first token the grammar refuses."""
        return drafted if self.broken else drafted[: self.matcher.validate_tokens(drafted)]

    def take(self, tokens: list[int]) -> None:
        """Tokens emitted: the grammar moves past them (once complete, it stays so)."""
        for token in tokens:
            if self.broken or self.matcher.is_stopped():
                return
            if self.matcher.validate_tokens([token]) != 1:
                log.warning("a sequence emitted token %d, which its grammar refuses: no longer held to it", token)
                self.broken = True
                return
            self.matcher.consume_token(token)

    def _allowed(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        if allowed.shape[0] < self.vocab:
            allowed = np.concatenate([allowed, np.zeros(self.vocab - allowed.shape[0], dtype=bool)])
        return allowed
