"""A reasoning model's thinking apart from its answer: chat replies split at the thinking tags.

Qwen3 and Qwen3.5 think between `<think>` and `</think>` before they answer. A chat template may open
the thought itself (the prompt then ends inside it) or leave the opening tag to the model. The tags are
the tokenizer's, as mlx-lm infers them from its vocabulary; a tokenizer without them leaves replies
whole. The thinking goes out as `reasoning_content` (DeepSeek's name, which most clients read) and as
`reasoning` (vLLM's and mlx-lm's), the answer as `content` without the line breaks after the closing
tag; a reply cut off before its thought closes is all thinking. Tags are matched in the text, so one
split across chunks is found: text that may begin a tag is held back until the next chunk says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tool_xml import tag_prefix

PROMPT_TAIL = 64  # the prompt's last tokens, where a template opens (or closes) a thought for the reply


@dataclass
class ReasoningSplit:
    """One reply's text, chunk by chunk, into (thinking, answer)."""

    start: str
    end: str
    shown: bool = True  # the thinking goes out (vLLM's `include_reasoning`); else it is dropped
    thinking: bool = False  # inside the thought
    answered: bool = False  # past the point where an opening tag could still begin the reply
    closed: bool = False  # the thought closed and the answer's first line has not come yet
    held: str = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """This text's thinking and answer; with `final`, everything held back too."""
        text, self.held = self.held + text, ""
        thought, answer = "", ""
        while text:
            if self.thinking:
                at = text.find(self.end)
                if at < 0:
                    keep = 0 if final else tag_prefix(text, self.end)
                    thought, self.held = thought + text[: len(text) - keep], text[len(text) - keep :]
                    break
                thought, text = thought + text[:at], text[at + len(self.end) :]
                self.thinking, self.answered, self.closed = False, True, True
                continue
            if not self.answered:  # the reply may open its thought itself, after blank space
                lead = text.lstrip()
                if lead.startswith(self.start):
                    text, self.thinking, self.answered = lead[len(self.start) :], True, True
                    continue
                if not final and self.start.startswith(lead):
                    self.held = text
                    break
                self.answered = True
            if self.closed:
                text = text.lstrip("\r\n")
                self.closed = not text
            answer += text
            break
        return thought, answer


def reasoning_split(tokenizer: Any, prompt: list[int], shown: bool = True,
                    continued: bool = False) -> ReasoningSplit | None:
    """The split for a reply to `prompt`, if the tokenizer knows thinking tags: inside a thought when
    the prompt ends in an opening tag and blank space (as a template that opens the thought leaves it;
    the tag written in a message is not that), or, where the reply goes on from the prompt's last message
    (`continued`: a prefill), when that message opened a thought it has not closed."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    tail = max(0, len(prompt) - PROMPT_TAIL)
    at = tokenizer.rfind_think_start(prompt, start=tail)
    opened = at >= 0 and at > tokenizer.rfind_think_end(prompt, start=tail) and \
        (continued or not tokenizer.decode(prompt[at + len(tokenizer.think_start_tokens) :]).strip())
    return ReasoningSplit(tokenizer.think_start, tokenizer.think_end, shown, thinking=opened, answered=opened)
