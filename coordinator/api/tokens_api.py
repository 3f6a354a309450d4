"""vLLM's `/tokenize` and `/detokenize`: a prompt's token ids as this server feeds them (a text, or chat
messages through the chat template with the generation prompt, tools rendered as chat requests render
them), and token ids back to text. Clients count a prompt against the context with them.

(No `from __future__ import annotations` here: FastAPI reads the route annotations at run time.)
"""

from typing import TYPE_CHECKING, Any, Optional

from pydantic import ValidationError

from .chat import chat_messages, check_request_template, template_effort, template_variables, tool_spec
from .errors import APIError, parse_body, validation_error
from .models import ChatCompletionRequest, _Body

if TYPE_CHECKING:
    from .service import Service


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None  # (as a chat request's: checked as one)
    add_special_tokens: bool = True  # a text's: the tokenizer's own special tokens (a BOS, where it has one)
    add_generation_prompt: bool = True  # messages': the assistant's turn opened, as chat requests are fed
    continue_final_message: bool = False  # messages': the last (assistant) message left open, as a chat's
    chat_template: Optional[str] = None  # (refused, as a chat request's)
    return_token_strs: bool = False
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None  # as a chat request's (checked as one): its prompt, counted


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


def add_token_routes(app: Any, service: "Service") -> None:
    from fastapi import Request

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body: TokenizeRequest = await parse_body(request, TokenizeRequest)
        service.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            try:
                chat = ChatCompletionRequest.model_validate({"messages": body.messages, "tools": body.tools,
                                                             "tool_choice": body.tool_choice,
                                                             "parallel_tool_calls": body.parallel_tool_calls,
                                                             "reasoning_effort": body.reasoning_effort,
                                                             "chat_template": body.chat_template})
            except ValidationError as e:
                raise validation_error(e.errors(include_url=False)) from None
            check_request_template(chat.chat_template)
            effort = template_effort(service.engine.tokenizer, chat.reasoning_effort)  # (its template's text only)
            ids = await service.encode_chat(chat_messages(chat), tool_spec(chat),
                                            template_variables(body.chat_template_kwargs, effort),
                                            body.continue_final_message, body.add_generation_prompt)
        else:
            text, special = body.prompt, body.add_special_tokens
            ids = await service.tokenize(len(text), lambda tok: list(tok.encode(text, add_special_tokens=special)))
        strs = await service.tokenize(0, lambda tok: tok.convert_ids_to_tokens(ids)) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": service.engine.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        service.check_model(body.model)
        ids = await service.token_ids(body.tokens, "tokens")
        return {"prompt": await service.tokenize(len(ids), lambda tok: tok.decode(ids))}
