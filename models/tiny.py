"""Tiny random Qwen3.5 checkpoints in the raw Hugging Face layout, for tests and local experiments.

Weights come from mlx-lm's own module initialisation, then are written the way HF stores them:
`model.language_model.*` backbone, top-level `mtp.*`, conv1d as [C, 1, K], RMSNorms as w of (1 + w),
MoE backbone experts fused (Qwen3.6 form) and MTP experts per expert (Qwen3.5 form). A byte-level
BPE tokenizer with a chat template is trained on a few stdlib sources.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .bpe import IM_END, train_tokenizer
from .config import parse_config
from .loading import _SHIFTED_EXACT, _SHIFTED_SUFFIXES
from .shard import Qwen35Shard, ShardSpec

log = logging.getLogger(__name__)

TOKENIZER_SOURCES = ("textwrap.py", "json/encoder.py", "json/decoder.py", "string.py", "heapq.py", "bisect.py")
LAYOUTS = ("hf", "hf_text", "separate_mtp", "sharded", "no_mtp")


def tiny_text_config(vocab_size: int, eos_token_id: int, *, moe: bool = False, num_layers: int = 8,
                     hidden_size: int = 64, attention_every: int = 4) -> dict[str, Any]:
    """A small config of the real architecture; `hidden_size` (a multiple of 16) scales every width
    with it (heads stay 4 and 2), for benchmarks where the weights, not the per-op overhead, dominate.
    Every `attention_every`-th layer is full attention (4 in the real models), the others GatedDeltaNet."""
    head = hidden_size // 4
    config: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": head,
        "linear_value_head_dim": head,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": attention_every,
        "layer_types": ["full_attention" if (i + 1) % attention_every == 0 else "linear_attention"
                        for i in range(num_layers)],
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": eos_token_id,
    }
    if moe:
        config.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    return config


def _stdlib_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in TOKENIZER_SOURCES if (root / name).exists()]


def _to_raw_hf(name: str, value: mx.array, rng: mx.array) -> dict[str, mx.array]:
    """One canonical mlx tensor -> its raw HF name(s) and form."""
    if name.endswith("conv1d.weight"):
        value = value.moveaxis(1, 2)  # mlx [C, K, 1] -> HF [C, 1, K]
    elif value.ndim == 1 and (name.endswith(_SHIFTED_SUFFIXES) or name in _SHIFTED_EXACT):
        value = 0.2 * mx.random.normal(value.shape, key=rng)  # HF stores w of (1 + w)
    elif name.endswith("linear_attn.norm.weight"):
        value = value + 0.2 * mx.random.normal(value.shape, key=rng)
    if ".switch_mlp." in name:
        prefix, rest = name.split(".switch_mlp.")
        proj = rest.split(".")[0]
        if prefix.startswith("mtp."):  # Qwen3.5 form: one tensor per expert
            return {f"{prefix}.experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])}
        return {f"{prefix}.experts.{proj}": value}  # fused below
    return {name: value}


def random_raw_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """Random weights for `config` under raw HF names, MTP included."""
    mx.random.seed(seed)
    parsed = parse_config({"model_type": "qwen3_5", "text_config": config})
    model = Qwen35Shard(parsed, ShardSpec.whole(parsed.num_layers), with_mtp=True)
    key = mx.random.key(seed + 1)
    canonical: dict[str, mx.array] = {}
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        canonical.update(_to_raw_hf(name, value, mx.random.split(key, i + 2)[i + 1]))
    # Backbone experts: fuse gate and up like Qwen3.6's experts.gate_up_proj [E, 2I, H].
    for name in [n for n in canonical if n.endswith(".experts.gate_proj")]:
        prefix = name[: -len(".gate_proj")]
        canonical[f"{prefix}.gate_up_proj"] = mx.concatenate(
            [canonical.pop(name), canonical.pop(f"{prefix}.up_proj")], axis=-2
        )
    raw: dict[str, mx.array] = {}
    for name, value in canonical.items():
        if name.startswith("mtp.") or name == "lm_head.weight":
            raw[name] = value
        else:
            raw["model.language_model." + name] = value
    return raw


def _relayout(raw: dict[str, mx.array], layout: str) -> dict[str, dict[str, mx.array]]:
    """Split/rename raw HF weights into {file name: tensors} for one of LAYOUTS."""
    if layout == "hf":
        return {"model.safetensors": raw}
    if layout == "hf_text":
        return {"model.safetensors": {k.replace("model.language_model.", "model."): v for k, v in raw.items()}}
    if layout == "no_mtp":
        return {"model.safetensors": {k: v for k, v in raw.items() if not k.startswith("mtp.")}}
    if layout == "separate_mtp":
        return {
            "model.safetensors": {k: v for k, v in raw.items() if not k.startswith("mtp.")},
            "mtp.safetensors": {k: v for k, v in raw.items() if k.startswith("mtp.")},
        }
    if layout == "sharded":
        names = sorted(raw)
        half = len(names) // 2
        return {
            "model-00001-of-00002.safetensors": {k: raw[k] for k in names[:half]},
            "model-00002-of-00002.safetensors": {k: raw[k] for k in names[half:]},
        }
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def write_checkpoint(
    out_dir: Path, text_config: dict[str, Any], raw: dict[str, mx.array], layout: str = "hf"
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _relayout(raw, layout)
    for fname, tensors in files.items():
        mx.save_safetensors(str(out_dir / fname), tensors, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": {k: f for f, t in files.items() for k in t}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    moe = text_config.get("num_experts", 0) > 0
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": text_config["tie_word_embeddings"],
        "eos_token_id": text_config["eos_token_id"],
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def cache_root() -> Path:
    return Path(os.environ.get("MTPIPE_CACHE", Path.home() / ".cache" / "mtpipe")) / "tiny"


def build_tiny_checkpoint(
    *, moe: bool = False, layout: str = "hf", seed: int = 0, num_layers: int = 8, root: Path | None = None,
    hidden_size: int = 64, attention_every: int = 4,
) -> Path:
    """Build (or reuse from the cache) a tiny random checkpoint; returns its directory."""
    if hidden_size % 16:
        raise ValueError(f"hidden_size must be a multiple of 16, got {hidden_size}")
    if attention_every < 1:
        raise ValueError(f"attention_every must be at least 1, got {attention_every}")
    shape = {"hidden": hidden_size} if hidden_size != 64 else {}  # (the tag of the default stays as it was)
    if attention_every != 4:
        shape["attention_every"] = attention_every
    tag = json.dumps({"moe": moe, "layout": layout, "seed": seed, "layers": num_layers, "v": 2, **shape})
    out = (root or cache_root()) / f"{'moe' if moe else 'dense'}-{layout}-{hashlib.sha1(tag.encode()).hexdigest()[:10]}"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    train_tokenizer(_stdlib_texts(), tmp, vocab_size=512)
    vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads((tmp / "tokenizer.json").read_text())["added_tokens"]}
    vocab_size = max(max(vocab.values()), max(added.values())) + 1
    text_config = tiny_text_config(vocab_size, added[IM_END], moe=moe, num_layers=num_layers, hidden_size=hidden_size,
                                   attention_every=attention_every)
    write_checkpoint(tmp, text_config, random_raw_weights(text_config, seed), layout)
    tmp.rename(out)
    log.info("built tiny checkpoint %s", out)
    return out
