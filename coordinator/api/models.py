"""Request bodies of the OpenAI-compatible API.

Types are strict (no "5" for 5, no 1 for true, no NaN; but 5.0 for 5, which some clients compute and
vLLM takes): a body of the wrong shape is a 400 naming the field, as OpenAI and vLLM answer (not
FastAPI's 422). Ranges are not checked here but by the
engine's own validation, so a bad value is a 400 with the engine's message. Unknown fields are
ignored, as OpenAI clients send many we have no use for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

# A flag that may come as null (OpenAI's schema allows it): false.
Flag = Annotated[bool, BeforeValidator(lambda value: False if value is None else value)]
# A whole number, also as a float without a fraction (5.0)
Int = Annotated[int, BeforeValidator(lambda value: int(value) if isinstance(value, float) and value.is_integer()
                                     else value)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None  # a refusal part's text (an assistant's refused turn, sent back)


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON object as a string, as OpenAI sends it (an object is taken too)


class MessageToolCall(_Body):
    """A call an earlier assistant message made, sent back with the conversation."""

    id: str | None = None  # (OpenAI's clients always send it; one without gets one: chat.chat_messages)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers
    # an assistant message's thinking, sent back (DeepSeek's and vLLM's names): templates may show it again
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None  # an assistant's refused turn sent back as OpenAI's reply gave it (content null)


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDef(_Body):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of type object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            if schema.get("type", "object") != "object":
                raise ValueError(f"parameters must be a JSON Schema of type 'object', got {schema.get('type')!r}")
            if not isinstance(schema.get("properties", {}), dict):
                raise ValueError("parameters.properties must be an object")
        return schema


class ToolDef(_Body):
    """One of `tools`: only function tools."""

    type: Literal["function"]
    function: FunctionDef


class ToolsBody(_Body):  # `tools`, checked on its own (chat.py)
    tools: list[ToolDef]


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: Flag = False
    continuous_usage_stats: Flag = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class _GenerationBody(_Body):
    model: str | None = None  # None: the served model
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    n: Int | None = None
    mtp_depth: Int | Literal["auto"] | None = None  # extension: drafts per round (0 = none); "auto" picks per round
    return_tokens_as_token_ids: Flag = False  # vLLM's: logprobs name each token "token_id:N", not by its text
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (mlx-lm's, over the last 20 tokens)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (formats.py)
    # vLLM's output formats: structured_outputs {json | regex | choice | grammar}, and its older fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's log-probability and this many others' (0-20)
    # vLLM's extensions. skip_special_tokens: leave special tokens out of the text (None: yes, but with tools in
    # use, whose tags may be special); min_tokens holds EOS, stop_token_ids and stop strings back.
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: Flag = False
    include_stop_str_in_output: Flag = False
    min_tokens: Int | None = None
    # vLLM's: only the last this many prompt tokens go in (-1: as many as the context holds)
    truncate_prompt_tokens: Int | None = None
    # vLLM's, not done here: a 400 names them rather than leaving them out unsaid
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    use_beam_search: bool | None = None
    priority: Int = 0  # vLLM's: lower is served first (only with `serve --scheduling-policy priority`)


class ChatCompletionRequest(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    # Checked in chat.py: a bad tool or tool_choice is a 400 naming it, not one for the body's shape.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None  # OpenAI's deprecated function calling: refused in chat.py, never quietly dropped
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    # OpenAI's: "none" turns a thinking model's thought off (enable_thinking), as vLLM maps it; a variable too
    # (xhigh and max as high, where the template names no such value: chat.template_effort)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool | None = None  # vLLM's: false drops a reasoning model's thinking from the reply
    continue_final_message: Flag = False  # vLLM's: the reply goes on from the last (assistant) message
    add_generation_prompt: bool = True  # vLLM's: false leaves the assistant's turn unopened
    chat_template: str | None = None  # vLLM's (refused, as vLLM refuses it unless told to trust requests)
    echo: Flag = False  # vLLM's: the reply shown after the last message's content, where that is the assistant's


class CompletionRequest(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]  # OpenAI's four forms: one prompt, or a list
    echo: bool | None = None
    suffix: str | None = None  # (fill-in-the-middle: refused, not ignored)
    logprobs: Int | None = None
    best_of: Int | None = None  # only n (the best n of more is not done here)


class ResponsesRequest(_GenerationBody):
    """OpenAI's Responses API (`/v1/responses`): the fields read here (responses_api.py)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    tools: Any = None  # function tools, flat ({"type": "function", "name", "parameters"}); checked as chat's
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    top_logprobs: Int | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" asks for logprobs (else top_logprobs does)
    previous_response_id: str | None = None  # goes on from a kept response (response_store.py)
    conversation: Any = None  # (these three keep state this server does not: refused)
    prompt: Any = None
    background: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    include_reasoning: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}: effort as chat's reasoning_effort
    truncation: Literal["auto", "disabled"] | None = None  # auto: the first turns dropped where the input overflows
    user: str | None = None  # (echoed, as these two are: one tier here)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None


class ResponsesCountRequest(ResponsesRequest):
    """`POST /v1/responses/input_tokens`: a Responses body whose prompt is counted (its input may be left out)."""

    input: str | list[dict[str, Any]] = []


class MessagesRequest(_GenerationBody):
    """Anthropic's Messages API (`/v1/messages`): the fields read here (messages_api.py)."""

    messages: list[dict[str, Any]]
    system: Any = None  # text, or a list of text blocks
    stop_sequences: list[str] | None = None
    tools: Any = None  # client tools ({"name", "description", "input_schema"}); checked as chat's
    tool_choice: Any = None  # {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}
    thinking: Any = None  # {"type": "enabled" | "disabled", ...}: Qwen's enable_thinking
    output_config: Any = None  # {"format": {"type": "json_schema", "schema"}}: structured output
    metadata: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
