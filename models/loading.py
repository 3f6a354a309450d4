"""Load one shard of a Qwen3.5 checkpoint from a Hugging Face-layout directory.

Accepted key layouts: `model.language_model.*` (HF multimodal), `model.*` (HF text-only),
`language_model.model.*` (mlx-lm conversions), top-level `mtp.*`, `language_model.mtp.*`, and a
separate `mtp.safetensors`. Everything is renamed to the shard's own names first, then only the
shard's tensors are kept: `mx.load` is lazy, so other shards' tensors are never read. A node's shard
cache directory (node/shards.py) loads the same way: it holds exactly a shard's tensors.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import ModelConfig, load_config
from .fingerprint import SHARD_MANIFEST, weight_files
from .names import canonical_name
from .shard import Qwen35Shard, ShardSpec

log = logging.getLogger(__name__)

CONVERTED_MTP_PREFIX = "language_model.mtp."  # how mlx conversions that keep the MTP head name it
# RMSNorms stored as w in HF (computed as 1 + w); mlx's RMSNorm computes w. Not linear_attn.norm.
_SHIFTED_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_SHIFTED_EXACT = ("norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight")


class MissingMTPWeightsError(ValueError):
    pass


class CheckpointError(ValueError):
    pass


@dataclass
class LoadedShard:
    config: ModelConfig
    spec: ShardSpec
    model: Qwen35Shard
    path: Path

    @property
    def has_mtp(self) -> bool:
        return self.model.has_mtp


def read_checkpoint(path: Path, originals: dict[str, str] | None = None) -> dict[str, mx.array]:
    """All tensors of a checkpoint directory, lazily, under canonical names (`originals`, if given,
    gets each one's name in the checkpoint)."""
    files = weight_files(path)
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            tensors = mx.load(str(f))
        except RuntimeError as e:  # (MLX's word for a file it cannot read as safetensors)
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        for key, value in tensors.items():
            name = canonical_name(key)
            if name is not None:
                weights[name] = value
                if originals is not None:
                    originals[name] = key
    return weights


def is_raw_hf(weights: dict[str, mx.array]) -> bool:
    """Raw HF checkpoints keep conv1d as [C, 1, K]; converted ones as [C, K, 1] (mlx-lm's test).

    Decided over the whole checkpoint (shapes only, nothing is read), so every shard agrees.
    """
    for k, v in weights.items():
        if k.endswith("conv1d.weight"):
            return v.shape[-1] != 1
    return False


def is_raw_mtp(originals: dict[str, str], raw_hf: bool) -> bool:
    """The MTP head's own layout, from its names in the checkpoint: the mlx conversions that keep it
    (mtpipe's `convert`, mlx-lm forks) write `language_model.mtp.*`, shifted; Hugging Face writes
    `mtp.*`, raw. Decided apart from the backbone, which has the conv1d to tell: a converted backbone
    beside the MTP tensors of the original checkpoint (an `mtp.safetensors` taken from it) is the usual
    way to add MTP to a converted model. No MTP tensors: the backbone's layout."""
    keys = [key for name, key in originals.items() if name.startswith("mtp.")]
    if not keys:
        return raw_hf
    return not keys[0].startswith(CONVERTED_MTP_PREFIX)


def stored_raw_hf(path: Path) -> bool | None:
    """What a shard cache directory (node/shards.py) recorded of its model's layout; None elsewhere."""
    manifest = Path(path) / SHARD_MANIFEST
    if not manifest.exists():
        return None
    value = json.loads(manifest.read_text()).get("raw_hf")
    return None if value is None else bool(value)


def _layer_index(name: str) -> int | None:
    m = re.match(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def select_shard(weights: dict[str, mx.array], spec: ShardSpec, model: Qwen35Shard) -> dict[str, mx.array]:
    """Keep this shard's tensors and rename global layer indices to local ones."""
    wanted_top = {n for n, _ in tree_flatten(model.parameters()) if not n.startswith("layers.")}
    keep_prefixes = tuple({n.split(".")[0] + "." for n in wanted_top})
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        idx = _layer_index(name)
        if idx is not None:
            if spec.start <= idx < spec.end:
                out[f"layers.{idx - spec.start}." + name.split(".", 2)[2]] = value
        elif name.startswith(keep_prefixes):
            out[name] = value
    return out


def _stack_experts(weights: dict[str, mx.array], mlp_prefix: str, num_experts: int) -> None:
    """Per-expert tensors (Qwen3.5) or a fused gate_up (Qwen3.6) -> mlx-lm's switch_mlp."""
    fused = f"{mlp_prefix}.experts.gate_up_proj"
    if fused in weights:
        gate_up = weights.pop(fused)
        mid = gate_up.shape[-2] // 2
        weights[f"{mlp_prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{mlp_prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{mlp_prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{mlp_prefix}.experts.down_proj")
        return
    if f"{mlp_prefix}.experts.0.up_proj.weight" not in weights:
        return
    for proj in ("gate_proj", "up_proj", "down_proj"):
        keys = [f"{mlp_prefix}.experts.{e}.{proj}.weight" for e in range(num_experts)]
        missing = [k for k in keys if k not in weights]
        if missing:
            raise CheckpointError(f"MoE experts incomplete: {missing[0]} and {len(missing) - 1} more are missing")
        weights[f"{mlp_prefix}.switch_mlp.{proj}.weight"] = mx.stack([weights.pop(k) for k in keys])


def sanitize(weights: dict[str, mx.array], config: ModelConfig, raw_hf: bool,
             raw_mtp: bool | None = None, dtype: mx.Dtype | None = None) -> dict[str, mx.array]:
    """mlx's layout: experts stacked, conv1d [C, K, 1], norms w where raw HF stores w - 1 (the backbone's
    when `raw_hf`, the MTP head's when `raw_mtp`, by default the same), 1 + w taken in float32 and
    rounded once, to `dtype` (by default the stored one)."""
    raw_mtp = raw_hf if raw_mtp is None else raw_mtp
    weights = dict(weights)
    if config.is_moe:
        prefixes = {n.rsplit(".mlp.", 1)[0] + ".mlp" for n in weights if ".mlp.experts" in n}
        for prefix in sorted(prefixes):
            _stack_experts(weights, prefix, config.args.num_experts)
    if config.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    for k, v in list(weights.items()):
        if k.endswith("conv1d.weight") and v.shape[-1] != 1:
            weights[k] = v.moveaxis(2, 1)
        elif (raw_mtp if k.startswith("mtp.") else raw_hf) and v.ndim == 1 and (
                k.endswith(_SHIFTED_SUFFIXES) or k in _SHIFTED_EXACT):
            weights[k] = (v.astype(mx.float32) + 1.0).astype(dtype or v.dtype)
    return weights


def _missing_mtp_message(path: Path, config: ModelConfig) -> str:
    return (
        f"{path}: config declares {config.mtp_layers} MTP layer(s) (mtp_num_hidden_layers) but the checkpoint "
        "has no MTP weights (no mtp.* tensors, no mtp.safetensors); it was probably converted without them. "
        "Run without speculative decoding with --no-mtp, or use a checkpoint that keeps the MTP head."
    )


# Modes whose scales are stored as uint8 exponents, each with its one (bits, group size); "affine" keeps
# its scales in the weights' float dtype, with any bits and group size.
_EXPONENT_SCALE_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}


def packed_quant_config(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict:
    """The group size, bits and mode a stored layer was packed with, read off its packed weight and its
    scales (for layers the config's quantization map does not name). `module` is still unquantized."""
    in_dims = module.weight.shape[-1]
    group_size = in_dims // weights[f"{path}.scales"].shape[-1]
    bits = weights[f"{path}.weight"].shape[-1] * 32 // in_dims  # uint32 words of packed values
    if weights[f"{path}.scales"].dtype != mx.uint8:
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    mode = _EXPONENT_SCALE_MODES.get((bits, group_size))
    if mode is None:
        raise ValueError(f"{path}: no quantization mode packs {bits} bits in groups of {group_size} with uint8 scales")
    return {"group_size": group_size, "bits": bits, "mode": mode}


def _quantize(model: nn.Module, config: ModelConfig, weights: dict[str, mx.array]) -> None:
    """(Reading the packing here, not with mlx-lm's utilities: those import its tokenizer code, and so
    transformers, into every node that loads a quantized model.)"""
    quant = config.quantization or {}

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if path in quant and isinstance(quant[path], dict):
            return quant[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return packed_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quant.get("group_size", 64),
        bits=quant.get("bits", 4),
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def _cast(name: str, value: mx.array) -> bool:
    """Whether a tensor takes the asked dtype: floats do, but for A_log, which stays as stored (as
    mlx-lm keeps it): exp(A_log) is every GatedDeltaNet decay rate, and bfloat16 moves them by ~1%."""
    return mx.issubdtype(value.dtype, mx.floating) and not name.endswith("A_log")


def shard_config(path: Path | str, spec: ShardSpec | None) -> ModelConfig:
    """The model's config, which `spec` (if given) must fit: a cheap check before any weight is read."""
    config = load_config(Path(path))
    if spec is not None and spec.num_layers != config.num_layers:
        raise ValueError(f"shard spec is for {spec.num_layers} layers, the model has {config.num_layers}")
    return config


def load_shard(
    path: Path | str,
    spec: ShardSpec | None = None,
    *,
    mtp: bool = True,
    dtype: mx.Dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
    materialize: bool = True,
    runs_here: bool = True,
) -> LoadedShard:
    """Load layers spec.start..spec.end (default: the whole model), the MTP head when asked and present.

    `materialize=False` returns the shard still lazy (nothing read from disk yet), for a caller that
    evaluates it in pieces of its own (a node, between serving other calls on its event loop).
    `runs_here=False`: loaded to be converted, not run, so not refused where this machine could not run it."""
    path = Path(path)
    config = shard_config(path, spec)
    spec = spec or ShardSpec.whole(config.num_layers)
    originals: dict[str, str] = {}
    all_weights = read_checkpoint(path, originals)
    has_mtp_weights = any(k.startswith("mtp.") for k in all_weights)
    with_mtp = mtp and config.mtp_layers > 0
    if with_mtp and spec.is_last and not has_mtp_weights:
        raise MissingMTPWeightsError(_missing_mtp_message(path, config))
    if mtp and config.mtp_layers == 0 and spec.is_last:
        log.info("%s declares no MTP head; decoding without speculation", path)

    model = Qwen35Shard(config, spec, with_mtp=with_mtp)
    raw_hf = stored_raw_hf(path)  # a shard cache holds a few layers: the whole model's answer is kept there
    raw_hf = is_raw_hf(all_weights) if raw_hf is None else raw_hf
    weights = sanitize(select_shard(all_weights, spec, model), config, raw_hf, is_raw_mtp(originals, raw_hf), dtype)
    del all_weights
    if config.quantization:
        _quantize(model, config, weights)
    if dtype is not None:
        weights = {k: v.astype(dtype) if _cast(k, v) else v for k, v in weights.items()}

    expected = {n for n, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - weights.keys())
    if missing:
        raise CheckpointError(
            f"{path}: checkpoint lacks {len(missing)} tensor(s) this shard needs, e.g. {', '.join(missing[:3])}"
        )
    unexpected = sorted(k for k in weights.keys() - expected if not k.startswith("mtp.") or with_mtp)
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) for this model: {', '.join(unexpected[:3])}")
    model.load_weights([(k, weights[k]) for k in expected])
    model.eval()
    if runs_here and (problem := runs_here_problem(model)):
        raise CheckpointError(f"{path}: {problem}: load it with --dtype float32 (or on a Mac's GPU)")
    if not materialize:
        return LoadedShard(config=config, spec=spec, model=model, path=path)
    # Materialize tensor by tensor so a progress bar can follow long loads.
    params = tree_flatten(model.parameters())
    for i, (_, p) in enumerate(params):
        mx.eval(p)
        if progress is not None:
            progress(i + 1, len(params))
    return LoadedShard(config=config, spec=spec, model=model, path=path)


def runs_here_problem(model: nn.Module) -> str | None:
    """Why this machine could not run `model` (None: it can). MLX's CPU backend multiplies unquantized
    MoE experts (gather_mm) in float32 only: a shard whose experts are stored otherwise would load, then
    fail at its first forward."""
    from mlx_lm.models.switch_layers import SwitchLinear

    if mx.default_device().type != mx.cpu:
        return None
    for name, m in model.named_modules():
        if isinstance(m, SwitchLinear) and m.weight.dtype != mx.float32:
            return (f"its MoE experts are {str(m.weight.dtype).removeprefix('mlx.core.')} ({name}), and MLX's CPU "
                    "backend runs unquantized experts in float32 only")
    return None


def arrays_in(obj: Any, seen: set[int] | None = None) -> list:
    """Every mx.array reachable from a module: parameters and also private members (RoPE tables...)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return [obj]
    items: list = []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith(("mlx", "mtpipe")):
        items += list(vars(obj).values())
    return [a for x in items for a in arrays_in(x, seen)]
