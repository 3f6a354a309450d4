"""Model configuration: the text config of a Qwen3.5 / Qwen3.6 checkpoint, flat or nested."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (imported when a config is parsed: reading the end tokens needs no model code)
    from mlx_lm.models.qwen3_5 import TextModelArgs

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


@dataclass
class ModelConfig:
    """What mtpipe needs to know about a checkpoint, beyond mlx-lm's TextModelArgs."""

    raw: dict[str, Any]
    text: dict[str, Any]
    args: TextModelArgs
    mtp_layers: int
    quantization: dict[str, Any] | None
    eos_token_ids: list[int]

    @property
    def num_layers(self) -> int:
        return self.args.num_hidden_layers

    @property
    def is_moe(self) -> bool:
        return self.args.num_experts > 0

    def is_linear_layer(self, index: int) -> bool:
        """GatedDeltaNet layer (True) or full attention (False)."""
        return (index + 1) % self.args.full_attention_interval != 0


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    text = dict(raw.get("text_config") or raw)
    # mlx-lm derives layer kinds from full_attention_interval; accept layer_types too.
    layer_types = text.get("layer_types")
    if layer_types and "full_attention_interval" not in text:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        text["full_attention_interval"] = (full[0] + 1) if full else len(layer_types) + 1
    if layer_types:
        interval = text.get("full_attention_interval", 4)
        for i, kind in enumerate(layer_types):
            expected = "linear_attention" if (i + 1) % interval else "full_attention"
            if kind != expected:
                raise ValueError(
                    f"layer_types[{i}] is {kind!r}; mtpipe supports the periodic Qwen3.5 layout "
                    f"(every {interval}th layer full attention)"
                )
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    if not text.get("rope_parameters") and ("rope_theta" in text or "partial_rotary_factor" in text):
        # the older form, flat: mlx-lm's args read rope_parameters only (their default would win)
        text["rope_parameters"] = {"type": "default", "rope_theta": text.get("rope_theta", 100000.0),
                                   "partial_rotary_factor": text.get("partial_rotary_factor", 0.25)}
    return text


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; mtpipe serves {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    from mlx_lm.models.qwen3_5 import TextModelArgs

    text = _text_config(raw)
    text.setdefault("model_type", model_type)
    args = TextModelArgs.from_dict(text)
    quant = raw.get("quantization") or raw.get("quantization_config")
    if quant is not None and "bits" not in quant:
        raise ValueError("only mlx quantization (a 'quantization' entry with bits and group_size) is supported")
    return ModelConfig(
        raw=raw,
        text=text,
        args=args,
        mtp_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
        quantization=quant,
        eos_token_ids=eos_token_ids(raw),
    )


def eos_token_ids(raw: dict[str, Any]) -> list[int]:
    """The end tokens a config names (at its top, else in its text config)."""
    eos = raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id"))
    return [eos] if isinstance(eos, int) else list(eos or [])


def load_config(model_path: Path) -> ModelConfig:
    path = Path(model_path) / "config.json"
    if not Path(model_path).is_dir():
        raise FileNotFoundError(f"{model_path} is no directory (a model is a directory holding config.json)")
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {model_path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return parse_config(data)
