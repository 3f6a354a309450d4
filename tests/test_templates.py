"""The server's chat template (`--chat-template`) and its variables' defaults (`--chat-template-args`):
every prompt rendered with them, a request's own variables over them, through the API's own process too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import LiveServer  # noqa: E402

from mtpipe.coordinator.api.app import create_app  # noqa: E402
from mtpipe.coordinator.api.templates import ChatTemplate, chat_template_of, template_args  # noqa: E402
from mtpipe.coordinator.engine.build import batch_engine  # noqa: E402

MODEL = "tiny"
TEMPLATE = ("[{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}quiet{% else %}thinking{% endif %}"
            "{% if tone is defined %} {{ tone }}{% endif %}]")


@pytest.fixture(scope="module")
def served(dense_ckpt: Path) -> Iterator[tuple[Any, LiveServer]]:
    engine = batch_engine(dense_ckpt, stages=1, dtype=mx.float32)  # (its own: the template is set on its tokenizer)
    template = ChatTemplate(TEMPLATE, {"enable_thinking": False, "tone": "dry"})
    try:
        with LiveServer(create_app(engine, MODEL, chat_template=template)) as server:
            yield engine, server
    finally:
        engine.close()


def _rendered(served: tuple[Any, LiveServer], **body: Any) -> str:
    engine, server = served
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **body}, timeout=30)
    assert r.status_code == 200, r.text
    return engine.tokenizer.decode(r.json()["tokens"])


def test_every_prompt_is_rendered_with_the_servers_template_and_variables(served: tuple[Any, LiveServer]) -> None:
    assert _rendered(served) == "[user:hi;quiet dry]"
    assert _rendered(served, chat_template_kwargs={"tone": "warm"}) == "[user:hi;quiet warm]"  # (the request's own)
    assert _rendered(served, chat_template_kwargs={"enable_thinking": True}) == "[user:hi;thinking dry]"
    assert _rendered(served, reasoning_effort="high") == "[user:hi;thinking dry]"  # (as vLLM maps an effort)
    engine, server = served
    r = httpx.post(server.url + "/tokenize", json={"messages": [], "chat_template": "{{ 1 }}"}, timeout=30)
    assert r.status_code == 400 and "with the server's chat template" in r.json()["error"]["message"]  # (not
    # "the model's": this server's is --chat-template)
    engine, server = served
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == len(engine.tokenizer.encode("[user:hi;quiet dry]",
                                                                          add_special_tokens=False))


def test_the_options_are_read_as_vllm_and_mlx_lm_take_them(tmp_path: Path) -> None:
    written = tmp_path / "t.jinja"
    written.write_text(TEMPLATE)
    assert chat_template_of(str(written), None) == ChatTemplate(TEMPLATE, {})
    assert chat_template_of(TEMPLATE, '{"tone": "dry"}') == ChatTemplate(TEMPLATE, {"tone": "dry"})
    long = TEMPLATE + "{# " + "a template's own text is longer than a file's name may be " * 8 + "#}"
    assert chat_template_of(long, None) == ChatTemplate(long, {})  # (it was OSError: File name too long)
    assert chat_template_of(None, {"enable_thinking": False}) == ChatTemplate(None, {"enable_thinking": False})
    assert chat_template_of(None, None) is None
    for bad, says in (("[1]", "JSON object"), ("{", "not JSON"), ('{"add_generation_prompt": true}', "argument")):
        with pytest.raises(ValueError, match=says):
            template_args(bad)
    with pytest.raises(ValueError, match="no such file, nor a template"):
        chat_template_of(str(tmp_path / "missing.jinja"), None)
    unreadable = tmp_path / "latin1.jinja"
    unreadable.write_bytes(b"\xff{{ x }}")
    with pytest.raises(ValueError, match="^--chat-template: cannot read"):  # (the decode error alone named nothing)
        chat_template_of(str(unreadable), None)
    with pytest.raises(ValueError, match="^api.chat_template_args must be"):  # (launch names cluster.yaml's keys)
        chat_template_of(None, "[]", ("api.chat_template", "api.chat_template_args"))


def test_the_api_process_of_its_own_renders_with_them(served: tuple[Any, LiveServer], dense_ckpt: Path) -> None:
    """(`mtpipe serve`'s default: the settings cross to the API's process in its spec. This tokenizer has
    no thought, so mlx-lm's own wrapper sets enable_thinking false where nothing else does.)"""
    from mtpipe.coordinator.api.front import FrontProcess, FrontSpec

    engine, _ = served
    front = FrontProcess(engine, FrontSpec(str(dense_ckpt), model_name=MODEL, access_log=False,
                                           chat_template=ChatTemplate(TEMPLATE, {"tone": "wry"})))
    try:
        front.start()
        r = httpx.post(front.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200, r.text
        assert engine.tokenizer.decode(r.json()["tokens"]) == "[user:hi;quiet wry]"
    finally:
        front.stop()


def test_whether_the_servers_template_renders_tools_is_asked_with_its_variables(dense_ckpt: Path) -> None:
    """(The probe rendered without them: a template that needs one failed it, and the tools went into a
    system message of their own instead of where the template puts them.)"""
    import asyncio
    from types import SimpleNamespace

    from mtpipe.coordinator.api.chat import ToolSpec
    from mtpipe.coordinator.api.metrics import ServerMetrics
    from mtpipe.coordinator.api.service import Service
    from mtpipe.coordinator.engine.tokenizer import load_tokenizer

    needs = ("{% if tone is not defined %}{{ raise_exception('no tone') }}{% endif %}"
             "{% if tools %}<{{ tools | length }} tools>{% endif %}" + TEMPLATE)
    tokenizer = load_tokenizer(dense_ckpt, [])
    service = Service(SimpleNamespace(tokenizer=tokenizer), MODEL, default_mtp_depth=None,  # type: ignore[arg-type]
                      max_concurrency=1, cluster_info=None, metrics=ServerMetrics(),
                      chat_template=ChatTemplate(needs, {"tone": "dry"}))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ids = asyncio.run(service.encode_chat([{"role": "user", "content": "hi"}], ToolSpec([tool], "auto")))
    assert tokenizer.decode(ids) == "<1 tools>[user:hi;quiet dry]"  # (quiet: mlx-lm says so, as above)


def test_a_messages_request_that_leaves_thinking_out_keeps_the_servers_default(
        served: tuple[Any, LiveServer]) -> None:
    """Anthropic's default is no extended thinking; a server whose --chat-template-args turn it on keeps
    it on for a request that does not say, and a request's `thinking` still decides for itself."""
    engine, _ = served
    wordy = TEMPLATE.replace("{% else %}thinking", "{% else %}thinking at some length about it")
    with LiveServer(create_app(engine, MODEL, chat_template=ChatTemplate(wordy, {"enable_thinking": True}))) as s:
        def counted(**body: Any) -> int:
            r = httpx.post(s.url + "/v1/messages/count_tokens", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
            assert r.status_code == 200, r.text
            return r.json()["input_tokens"]

        def tokens(text: str) -> int:
            return len(engine.tokenizer.encode(text, add_special_tokens=False))

        assert counted() == tokens("[user:hi;thinking at some length about it]") != tokens("[user:hi;quiet]")
        assert counted(thinking={"type": "disabled"}) == tokens("[user:hi;quiet]")
