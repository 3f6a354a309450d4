"""Generated tokens to streamed text, on mlx-lm's streaming detokenizer, cut at stop strings.

The tokenizer's ``.detokenizer`` turns one token at a time into text without re-decoding a window,
holding back only what the next token may still change (an incomplete UTF-8 character, a lone
space); ``finalize`` flushes what it holds, so at the end the text is what ``tokenizer.decode``
gives for all the tokens, replacement characters included.
"""

from __future__ import annotations

import copy
import functools
import re
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from .request import GenerationRequest


def every_byte(detokenizer: Any) -> Any:
    """`detokenizer`, where it is mlx-lm's BPE one, decoding the byte 0 as itself: that one takes the byte
    for none (0 is falsy) and gives its character in the byte-level alphabet, "Ā", where decode gives
    "\\x00"."""
    from mlx_lm import tokenizer_utils

    table = getattr(tokenizer_utils, "_byte_decoder", None)
    if table is None or not isinstance(detokenizer, tokenizer_utils.BPEStreamingDetokenizer):
        return detokenizer
    to_byte = table()

    def decode_bytes(seq: str) -> str:
        out = bytearray()
        for c in seq:
            b = to_byte.get(c)
            if b is None:
                out.extend(c.encode("utf-8"))
            else:
                out.append(b)
        return out.decode("utf-8", "replace")

    detokenizer._decode_bytes = decode_bytes
    return detokenizer


class TextStream:
    """One request's text: never releases text at or past a stop string.

    While generating, the last len(longest stop) - 1 characters are held back: they may begin a
    stop string that the next tokens complete. With `skip_special`, the special tokens (`special_ids`)
    add no text, as `decode(..., skip_special_tokens=True)` leaves them out, but one whose text is a
    stop string still stops; with `keep_stop`, the text ends with the stop string found instead of
    before it. With `after` (vLLM's min_tokens), a stop string that ends within the first `after` tokens'
    text never stops it (the text of those tokens, what the detokenizer holds back included, is `floor` long).
    """

    def __init__(self, tokenizer: TokenizerWrapper, stop: list[str], skip_special: bool = False,
                 keep_stop: bool = False, after: int = 0):
        self.tokenizer = tokenizer
        self.detokenizer = every_byte(tokenizer.detokenizer)  # a fresh one for each request
        self.skipped = special_ids(tokenizer) if skip_special else frozenset()
        self.keep_stop = keep_stop
        self.stop = [s for s in stop if s]
        # skipped tokens whose text is a stop string: they stop as that string in the text would
        self.stopping = {t: s for s in self.stop if (t := tokenizer.convert_tokens_to_ids(s)) in self.skipped
                         and tokenizer.convert_ids_to_tokens(t) == s}  # (not an unknown string's id)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # detokenized so far, cut at the first stop string
        self.released = 0  # characters handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it
        self._begun = False
        self._flushed = False
        self.after = after
        self.added = 0  # tokens taken in
        self.floor = 0  # a stop string must end past this many characters

    @classmethod
    def of(cls, tokenizer: TokenizerWrapper, req: GenerationRequest) -> TextStream:
        return cls(tokenizer, req.stop, req.skip_special_tokens, req.include_stop_str_in_output, req.params.min_tokens)

    @property
    def armed(self) -> bool:
        """Whether stop strings are looked for yet."""
        return self.added > self.after

    def add(self, token: int) -> None:
        if self.stopped:
            return
        self.added += 1
        if token in self.skipped:
            if token in self.stopping and self.armed:
                self.flush()  # (what the detokenizer holds comes before it, and may stop first)
                if not self.stopped:
                    self.text += self.stopping[token] if self.keep_stop else ""
                    self.stopped, self.matched = True, self.stopping[token]
            return
        self.detokenizer.add_token(token)
        self._extend(self.detokenizer.last_segment)
        if self.stop and self.added == self.after:  # (the last token whose text cannot stop it)
            self.floor = len(self.text) + len(self._held())
        if self.stop and not self.stopped and self._begun and self.armed and self._held_completes_a_stop():
            self.flush()  # this token ends a stop string in what the detokenizer holds back (a lone space)

    def end_with(self, token: int) -> None:
        """The token that ended the request (an EOS or a stop token id): its text follows with `keep_stop`
        (vLLM's include_stop_str_in_output), and may hold a stop string; a special token left out adds
        nothing, and is no stop string here (it ended the request as a token)."""
        if self.keep_stop and token not in self.skipped:
            self.add(token)

    def _held(self) -> str:
        """What the detokenizer holds back, as text: asked of a copy (finalizing one only reassigns its
        fields, so the copy leaves this one as it was)."""
        probe = copy.copy(self.detokenizer)
        probe.finalize()
        return probe.last_segment

    def _held_completes_a_stop(self) -> bool:
        """Whether what the detokenizer holds back, once taken in, completes a stop string."""
        held = self._held()
        if not held:
            return False
        text, start = self.text + held, max(0, len(self.text) - self.hold)
        return any(text.find(s, max(start, self.floor - len(s) + 1)) >= 0 for s in self.stop)

    def flush(self) -> None:
        """No token follows: take in what the detokenizer holds back (a stop string may end in it)."""
        if not self.stopped and not self._flushed:
            self._flushed = True
            self.detokenizer.finalize()
            self._extend(self.detokenizer.last_segment, final=True)

    def release(self, final: bool) -> str:
        """The text not handed out yet; `final` flushes everything (but nothing past a stop)."""
        if final:
            self.flush()
        hold = 0 if final or self.stopped else self.hold
        end = max(self.released, len(self.text) - hold)
        out = self.text[self.released : end]
        self.released = end
        return out

    def _extend(self, piece: str, final: bool = False) -> None:
        if not self._begun and (piece or final):
            piece = self._keep_leading_space(piece)
        if not piece:
            return
        start = max(0, len(self.text) - self.hold)  # a stop may begin in the text held back
        self.text += piece
        found = [(at, -len(s), s) for s in self.stop
                 if self.armed and (at := self.text.find(s, max(start, self.floor - len(s) + 1))) >= 0]
        if found:
            at, _, stop = min(found)  # the first; of those that begin there, the longest
            self.text = self.text[: at + len(stop) if self.keep_stop else at]
            self.stopped, self.matched = True, stop

    def _keep_leading_space(self, piece: str) -> str:
        """mlx-lm's BPE detokenizer drops the text's leading space, as if it began a document; a
        completion continues its prompt, so keep the space `decode` gives. (Its first piece holds
        every token so far, so it is all of `decode` but that space.)"""
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

        self._begun = True
        if isinstance(self.detokenizer, BPEStreamingDetokenizer):
            if self.tokenizer.decode(self.detokenizer.tokens) == " " + piece:
                return " " + piece
        return piece


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet back to bytes: printable bytes stand for themselves, the others
    for 256 + their rank among them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in printable}
    rest = (b for b in range(256) if b not in out.values())
    out.update({chr(256 + i): b for i, b in enumerate(rest)})
    return out


_SPECIAL: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: TokenizerWrapper) -> frozenset[int]:
    """The tokens a Hugging Face tokenizer leaves out of `decode(..., skip_special_tokens=True)`: its
    added tokens marked special (`<|im_start|>` among them, which `all_special_ids` may not list), and
    its special tokens; but never the thinking and tool-call tags mlx-lm found, which the API splits
    replies at (Qwen's are not special; other models' may be). Read once per tokenizer."""
    try:
        return _SPECIAL[tokenizer]
    except KeyError:
        pass
    except TypeError:  # (a stand-in that cannot be a weak key: read every time)
        return _read_special_ids(tokenizer)
    found = _SPECIAL[tokenizer] = _read_special_ids(tokenizer)
    return found


def _read_special_ids(tokenizer: Any) -> frozenset[int]:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    marked = {int(i) for i, t in added.items() if getattr(t, "special", False)}
    tags = ("think_start_tokens", "think_end_tokens", "tool_call_start_tokens", "tool_call_end_tokens")
    kept = {t for name in tags for t in (getattr(tokenizer, name, None) or ())}
    return frozenset((marked | set(getattr(hf, "all_special_ids", None) or ())) - kept)


_BYTE_LEVEL = _byte_level_map()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=8)
def _byte_level(tokenizer: TokenizerWrapper) -> bool:
    """Whether mlx-lm detokenizes this tokenizer as byte-level BPE (asked once per tokenizer)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    return isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)


def token_bytes(tokenizer: TokenizerWrapper, token: int) -> bytes:
    """A token's own bytes, as OpenAI's logprobs report them: part of a UTF-8 character stays that part
    (its decoded text would be a replacement character). A byte-level BPE piece maps back through its
    alphabet, a SentencePiece byte piece (<0xAB>) is that byte; other pieces are their text."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        if (m := _BYTE_TOKEN.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        if _byte_level(tokenizer) and piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return tokenizer.decode([token]).encode("utf-8")
