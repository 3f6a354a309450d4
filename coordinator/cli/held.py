"""`mtpipe generate`'s output formats: --json-schema, --regex and --grammar, each a text or a file
holding one, held after the thought a chat prompt opens (api/formats.py builds them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any


def held_to(args: argparse.Namespace) -> Any:
    """The format of --json-schema, --regex or --grammar (api/formats.py; None: free text), its grammar
    checked; ValueError naming a bad one."""
    from ..api.errors import APIError
    from ..api.formats import OutputFormat, lark_of

    if args.json_schema is not None:
        text = args.json_schema
        try:
            if not text.lstrip().startswith("{") and Path(text).expanduser().is_file():
                text = Path(text).expanduser().read_text()
        except OSError:  # (a name too long to be a file's: the schema itself)
            pass
        try:
            schema = json.loads(text)
        except ValueError:
            raise ValueError(f"--json-schema is neither a JSON Schema nor a file holding one: {args.json_schema!r}") \
                from None
        if not isinstance(schema, dict):
            raise ValueError("--json-schema must be a JSON object")
        fmt = OutputFormat(schema=schema, field="--json-schema")
    elif args.regex is not None:
        fmt = OutputFormat(regex=args.regex, field="--regex")
    elif args.grammar is not None:
        text = args.grammar
        try:
            if "\n" not in text and Path(text).expanduser().is_file():
                text = Path(text).expanduser().read_text()
        except OSError:  # (a name too long to be a file's: the grammar itself)
            pass
        if ":" not in text:  # (every grammar has a rule: a path to a file that is not there)
            raise ValueError(f"--grammar is neither a grammar nor a file holding one: {args.grammar!r}")
        try:
            fmt = OutputFormat(lark=lark_of(text, "--grammar"), field="--grammar")
        except APIError as e:
            raise ValueError(f"--grammar: {e.message}") from None
    else:
        return None
    if error := fmt.problem():
        raise ValueError(f"{fmt.field}: the output cannot be held to it: {error}")
    return fmt


def after_thought(fmt: Any, engine: Any, tokens: list[int], params: Any) -> Any:
    """`params` held to `fmt` after the thought the chat prompt opened, if it opened one."""
    from ..api.errors import APIError
    from ..api.formats import after_thought as held_after_thought
    from ..api.reasoning import reasoning_split

    split = reasoning_split(engine.tokenizer, tokens)
    if split is None or not split.thinking:
        return params
    try:
        grammar = held_after_thought(fmt, engine.tokenizer, engine.eos, engine.vocab_size)
    except APIError as e:
        raise ValueError(e.message) from None
    return dataclasses.replace(params, grammar=grammar)
