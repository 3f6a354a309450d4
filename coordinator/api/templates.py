"""The server's own chat template settings, over what each request may set.

`--chat-template` replaces the model's template (vLLM's and mlx-lm's option: a file, or the template
itself), for a checkpoint whose template lacks what a client needs (tools, say). `--chat-template-args`
(mlx-lm's name; vLLM's `--default-chat-template-kwargs`) gives variables every prompt is rendered
with unless its request sets them: `{"enable_thinking": false}` serves a Qwen thinking model without
thought by default, while a request's `chat_template_kwargs` or `reasoning_effort` still turns it on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat import TEMPLATE_ARGUMENTS

PROBE = [{"role": "user", "content": "Hello"}]  # what a template must render to be served
OPTIONS = ("--chat-template", "--chat-template-args")  # what errors call the two (launch: cluster.yaml's keys too)


@dataclass(frozen=True)
class ChatTemplate:
    text: str | None = None  # in place of the model's template (None: the model's)
    variables: dict[str, Any] = field(default_factory=dict)  # the defaults of `chat_template_kwargs`

    def apply(self, tokenizer: Any) -> None:
        """Every prompt `tokenizer` renders, and whatever reads its template (tools, thinking), uses this one."""
        if self.text is not None:
            tokenizer.chat_template = self.text
            if getattr(tokenizer, "_chat_template", None) is not None:  # (mlx-lm's: a model's own renderer)
                tokenizer._chat_template = None
            if hasattr(tokenizer, "has_chat_template"):
                tokenizer.has_chat_template = True

    def check(self, tokenizer: Any, names: tuple[str, str] = OPTIONS) -> None:
        """ValueError where the template, with these variables, does not render a user's message (it is
        applied to `tokenizer` first)."""
        self.apply(tokenizer)
        try:
            tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=False, **self.variables)
        except Exception as e:  # (jinja's errors, or a template's raise_exception)
            what = names[0] if self.text is not None else "the model's chat template"
            given = f" with {names[1]} {json.dumps(self.variables)}" if self.variables else ""
            raise ValueError(f"{what} does not render a message{given}: {e}") from None

    def prompt_variables(self, asked: dict[str, Any] | None) -> dict[str, Any] | None:
        """A prompt's variables: a request's own over these."""
        return {**self.variables, **(asked or {})} or None


def template_text(value: str, name: str = OPTIONS[0]) -> str:
    """--chat-template: a file's text, or the template itself (as vLLM takes either)."""
    path = Path(value).expanduser()
    try:
        written = path.is_file()
    except OSError:  # (a template is mostly longer than a file's name may be: ENAMETOOLONG)
        written = False
    if written:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}: cannot read {path}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{name}: no such file, nor a template: {value!r}")


def template_args(value: str | dict[str, Any] | None, name: str = OPTIONS[1]) -> dict[str, Any]:
    """--chat-template-args: a JSON object of template variables, none of them an argument of the call."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, as {{\"enable_thinking\": false}}")
    if reserved := sorted(TEMPLATE_ARGUMENTS.intersection(value)):
        raise ValueError(f"{name} may not set {reserved[0]!r}: it is an argument of the template "
                         "call, not a variable of the template")
    return dict(value)


def checked_for(template: ChatTemplate | None, model_path: Path | str,
                names: tuple[str, str] = OPTIONS) -> ChatTemplate | None:
    """`template`, checked against the model's tokenizer (ValueError if it does not render a message)."""
    if template is not None:
        from ..engine.tokenizer import load_tokenizer

        template.check(load_tokenizer(model_path, []), names)
    return template


def chat_template_of(text: str | None, args: str | dict[str, Any] | None,
                     names: tuple[str, str] = OPTIONS) -> ChatTemplate | None:
    """The settings of --chat-template and --chat-template-args (None where neither is given), checked
    as far as they can be without the model's tokenizer; errors call them `names`."""
    if text is None and args is None:
        return None
    return ChatTemplate(None if text is None else template_text(text, names[0]), template_args(args, names[1]))
