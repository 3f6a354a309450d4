"""The sampling a model's makers recommend, from its `generation_config.json`, as vLLM takes it: a
request that leaves out temperature, top_p, top_k, min_p or repetition_penalty gets the model's value
(else OpenAI's default), and one without max_tokens gets its max_new_tokens (else ours)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, TypeVar

from ...node.protocol import GREEDY_BELOW, SamplingParams

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_INTEGERS = ("top_k", "max_tokens")

Body = TypeVar("Body")


NO_GENERATION_CONFIG = ("none", "vllm")  # ("vllm": vLLM's name for its own defaults, OpenAI's here)


def generation_config_source(value: str) -> str:
    """Where the API's request defaults come from, as vLLM's --generation-config says it: "auto" the
    model's directory, "none" (or vLLM's "vllm") nowhere, OpenAI's defaults, else a directory that
    holds a generation_config.json (checked here: call it where the API runs, before any model loads)."""
    if value == "auto" or value in NO_GENERATION_CONFIG:
        return value
    if not (Path(value).expanduser() / "generation_config.json").is_file():
        raise ValueError(f"{value!r} is neither auto, none (vllm), nor a directory holding a generation_config.json")
    return value


def generation_config_dir(source: str | None, model_path: Path | str) -> Path | None:
    """The directory `source` (`generation_config_source`; None: auto) names for the model at `model_path`."""
    if source is None or source == "auto":
        return Path(model_path)
    return None if source in NO_GENERATION_CONFIG else Path(source).expanduser()


def model_defaults(model_path: Path | str | None) -> dict[str, float | int]:
    """The request defaults in the model directory's generation config ({} without one, or with no
    directory), read as a request's are (top_k -1: off; a temperature too small to sample at: greedy).
    A value that would make every request that leaves it out a 400 is dropped, with a warning, at
    start; the others stay."""
    path = Path(model_path) / "generation_config.json" if model_path is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): the API's own sampling defaults apply", path, e)
        return {}
    if not isinstance(config, dict):
        log.warning("%s holds no JSON object: the API's own sampling defaults apply", path)
        return {}
    out: dict[str, float | int] = {}
    for key in (*SAMPLING_KEYS, "max_new_tokens"):
        value = config.get(key)
        name = "max_tokens" if key == "max_new_tokens" else key
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                name in _INTEGERS and value != int(value)):
            log.warning("%s: %s=%r is not a number the API takes; left out", path, key, value)
            continue
        out[name] = int(value) if name in _INTEGERS else float(value)
    if out.get("top_k") == -1:
        out["top_k"] = 0
    if 0.0 < out.get("temperature", 0.0) < GREEDY_BELOW:
        out["temperature"] = 0.0
    for key in [k for k in out if k in SAMPLING_KEYS]:
        try:
            SamplingParams(**{"temperature": 1.0, key: out[key]}).validate()  # type: ignore[arg-type]
        except ValueError as e:
            log.warning("%s: %s; the API's own default applies", path, e)
            del out[key]
    if out.get("max_tokens", 1) < 1:
        log.warning("%s: max_new_tokens=%s is not a default the API takes; left out", path, out.pop("max_tokens"))
    if out:
        log.info("request defaults from %s: %s", path, ", ".join(f"{k}={v}" for k, v in sorted(out.items())))
    return out


def with_defaults(body: Body, defaults: dict[str, Any]) -> Body:
    """`body` with the model's sampling defaults where it gave none."""
    missing = {k: v for k, v in defaults.items() if k in SAMPLING_KEYS and getattr(body, k, None) is None}
    return body.model_copy(update=missing) if missing else body  # type: ignore[attr-defined]
