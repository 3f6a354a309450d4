"""What a request asks its output to look like, as the grammar the last stage holds it to (node/constraints.py).

OpenAI's `response_format`: `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`; vLLM's `structured_outputs` with one of `json` (a schema),
`regex`, `choice` (one of the strings) or `grammar` (EBNF as xgrammar and llama.cpp write it, `root ::= ...`,
or Lark as llguidance reads it), and its older `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`.
JSON comes laid out as `json.dumps` lays it out. Where the chat template opened a thought the reply
thinks first, unconstrained, up to the closing tag (when the tokenizer has it as one token): only the
answer is held to the format.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .chat import SCHEMA_DATA
from .errors import APIError

if TYPE_CHECKING:
    from .chat import ToolSpec

log = logging.getLogger(__name__)

REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")  # what a regex (Rust's syntax, llguidance's) must escape
EBNF_RULE = re.compile(r"^\s*[A-Za-z0-9_-]+\s*::=", re.MULTILINE)  # (a Lark string may hold "::=")


@dataclass(frozen=True)
class OutputFormat:
    """A JSON schema (`schema`), a regular expression (`regex`) or a Lark grammar (`lark`) the answer must match."""

    schema: dict[str, Any] | None = None
    regex: str | None = None
    lark: str | None = None
    field: str = "response_format"  # the request field that asked for it

    @functools.cached_property
    def plain(self) -> str:
        """The llguidance grammar of the whole reply (made once: a request's checks and its sampling read it)."""
        from llguidance import LLMatcher

        from ...node.constraints import grammar_of_schema

        if self.lark is not None:
            return LLMatcher.grammar_from_lark(self.lark)
        return grammar_of_schema(self.schema) if self.schema is not None else \
            LLMatcher.grammar_from_regex(self.regex or "")

    def problem(self) -> str:
        """What keeps output from being held to it, whatever the tokenizer ("" if nothing)."""
        from ...node.constraints import grammar_error

        try:
            return grammar_error(self.plain)
        except ValueError as e:  # (a schema that is no JSON object)
            return str(e)

    def grammar(self, after_token: int | None = None, never: tuple[str, ...] = ()) -> str:
        """The llguidance grammar. With `after_token` the reply thinks first: any tokens but that one and
        `never` (the end-of-sequence tokens and ids past the tokenizer's words, as "7" or "100-127"), then
        it, up to two line breaks and the answer; an end-of-sequence token may end it in its thought."""
        from llguidance import LLMatcher

        from ...node.constraints import JSON_LAYOUT

        if after_token is None:
            return self.plain
        if self.lark is not None:  # (the answer a grammar of its own, named: its rules stay apart from these)
            answer = "@answer"
        elif self.schema is not None:
            layout = {**JSON_LAYOUT, **self.schema.get("x-guidance", {})}
            answer = f"%json {json.dumps({**self.schema, 'x-guidance': layout})}"
        else:
            answer = "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", self.regex or "") + "/"
        free = ",".join((str(after_token), *never))
        outer = f"start: <[^{free}]>* (<[{after_token}]> /\\n{{0,2}}/ answer)?\nanswer: {answer}\n"
        if self.lark is None:
            return LLMatcher.grammar_from_lark(outer)
        return json.dumps({"grammars": [{"lark_grammar": outer}, {"name": "answer", "lark_grammar": self.lark}]})


def output_format(body: Any) -> OutputFormat | None:
    """The format `body` asks for (None: free text), checked: 400 naming the field otherwise."""
    asked = [(name, getattr(body, name, None)) for name in ("structured_outputs", "guided_json", "guided_regex",
                                                             "guided_choice", "guided_grammar")]
    asked = [(name, value) for name, value in asked if value is not None]
    response_format = body.response_format
    kind = "text" if response_format is None else response_format.get("type")
    if kind is None:
        raise APIError(400, "response_format needs a type: text, json_object or json_schema", param="response_format")
    if kind != "text":
        asked.insert(0, ("response_format", response_format))
    if len(asked) > 1:
        raise APIError(400, f"ask for one output format, got {' and '.join(name for name, _ in asked)}",
                       param=asked[1][0])
    if not asked:
        return None
    name, value = asked[0]
    fmt = dataclasses.replace(_of(name, value), field=name)
    if error := fmt.problem():
        raise APIError(400, f"{name}: the output cannot be held to this format: {error}", param=name)
    return fmt


def held_call(tools: ToolSpec) -> OutputFormat:
    """The format a reply that must call a tool is held to (tool_choice "required" or a named function).
    Parameters that use what llguidance does not implement (`not`, a look-around in a `pattern`) are held
    leniently, those words left out; ones no call could fit, or no JSON Schema, are a 400: the call could
    not be held to them."""
    strict = OutputFormat(schema=tools.call_schema(), field="tool_choice")
    if not (error := strict.problem()):
        return strict
    from ...node.constraints import JSON_LAYOUT

    schema = _known_patterns(strict.schema or {})
    layout = {**JSON_LAYOUT, **schema.get("x-guidance", {}), "lenient": True}  # (its own options replace defaults)
    lenient = OutputFormat(schema={**schema, "x-guidance": layout}, field="tool_choice")
    if lenient.problem():
        raise APIError(400, f"tool_choice: no call to the tools could fit their parameters: {error}",
                       param="tool_choice")
    log.info("tool_choice: a call is held to the tools' parameters leniently (%s)", error)
    return lenient


def _known_patterns(schema: Any) -> Any:
    """`schema` without the `pattern`s llguidance's regular expressions cannot read (look-arounds,
    backreferences): lenient holding leaves out the words it does not implement, not these."""
    if isinstance(schema, list):
        return [_known_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: value if key in SCHEMA_DATA else _known_patterns(value) for key, value in schema.items()
            if not (key == "pattern" and isinstance(value, str) and not _reads(value))}


@functools.cache
def _reads(pattern: str) -> bool:
    from llguidance import LLMatcher

    from ...node.constraints import grammar_of_schema

    try:
        return not LLMatcher.validate_grammar(grammar_of_schema({"type": "string", "pattern": pattern}))
    except ValueError:
        return False


def after_thought(fmt: OutputFormat, tokenizer: Any, eos: set[int], vocab: int) -> str:
    """The grammar of a reply whose thought the chat template opened: free up to the tokenizer's closing
    tag, which must be one token (else a 400: the answer could not be told from the thought)."""
    ends = tuple(getattr(tokenizer, "think_end_tokens", ()))
    if len(ends) != 1:
        raise APIError(400, f"{fmt.field} needs a thinking model's closing tag to be one token; turn thinking off "
                            "(chat_template_kwargs: {\"enable_thinking\": false})", param=fmt.field)
    words = len(tokenizer)
    never = tuple(map(str, sorted(eos))) + ((f"{words}-{vocab - 1}",) if words < vocab else ())
    return fmt.grammar(ends[0], never)


def _of(name: str, value: Any) -> OutputFormat:
    param = name  # (the field errors name: structured_outputs' parts are read as the guided_ fields are)
    if name == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            return OutputFormat(schema={"type": "object"})
        if kind != "json_schema":
            raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                           param=name)
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format json_schema must be an object whose schema is a JSON Schema object",
                           param=name)
        return OutputFormat(schema=spec.get("schema", {}))  # ({}: any JSON value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise APIError(400, "structured_outputs must be an object", param=param)
        given = {k: v for k, v in value.items() if v is not None and k in ("json", "regex", "choice", "grammar",
                                                                             "json_object", "structural_tag")}
        if len(given) != 1:
            raise APIError(400, "structured_outputs takes one of json, regex, choice or grammar", param=param)
        (key, inner), = given.items()
        if key == "json_object" and inner is True:
            return OutputFormat(schema={"type": "object"})
        if key not in ("json", "regex", "choice", "grammar"):
            raise APIError(400, f"structured_outputs {key} is not supported here: use json, regex, choice or grammar",
                           param=param)
        name, value = f"guided_{key}", inner
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, "the JSON schema is not valid JSON", param=param) from None
            except RecursionError:
                raise APIError(400, "the JSON schema nests too deeply", param=param) from None
        if not isinstance(value, dict):
            raise APIError(400, "the JSON schema must be an object", param=param)
        return OutputFormat(schema=value)
    if name == "guided_grammar":
        if not isinstance(value, str) or not value.strip():
            raise APIError(400, "the grammar must be a non-empty string", param=param)
        return OutputFormat(lark=lark_of(value, param))
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise APIError(400, "the regex must be a non-empty string", param=param)
        return OutputFormat(regex=value)
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise APIError(400, "choice must be a list of non-empty strings", param=param)
    return OutputFormat(regex="|".join("".join("\\" + c if c in REGEX_SPECIAL else c for c in s) for s in value))


def lark_of(grammar: str, param: str) -> str:
    """A grammar as Lark: EBNF (GBNF, as xgrammar and llama.cpp take it: `root ::= ...`) converted, Lark as
    it is (EBNF where a line opens with a rule's definition, `name ::=`); a 400 where EBNF does not convert."""
    if not EBNF_RULE.search(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # (the converter raises what its parser meets)
        raise APIError(400, f"the grammar (EBNF) does not convert: {e}", param=param) from None
