"""HF checkpoint -> mlx checkpoint (optionally quantized), keeping the MTP head.

The output uses mlx-lm's naming (`language_model.model.*`, `language_model.mtp.*`), so mlx-lm loads
its backbone as is; norms are already shifted and conv1d already transposed, so neither mlx-lm nor
mtpipe shifts them again.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import make_shards

from .fingerprint import TOKENIZER_FILES, TOKENIZER_SOURCES
from .loading import load_shard, runs_here_problem

log = logging.getLogger(__name__)

DEFAULT_BITS, DEFAULT_GROUP_SIZE = 4, 64  # as mlx-lm's convert
# Copied beside the weights: the tokenizer's files (as a model's identity counts them, and what a tokenizer
# is read from) and the model's sampling defaults.
COPIED_FILES = tuple(dict.fromkeys((*TOKENIZER_FILES, *TOKENIZER_SOURCES, "generation_config.json")))


def mlx_name(name: str) -> str:
    if name.startswith("mtp."):
        return "language_model." + name
    if name.startswith("lm_head."):
        return "language_model." + name
    return "language_model.model." + name


def convert(
    src: Path,
    dst: Path,
    *,
    quantize: bool = False,
    bits: int = DEFAULT_BITS,
    group_size: int = DEFAULT_GROUP_SIZE,
    quantize_mtp: bool = True,
    dtype: str | None = "bfloat16",
    mtp: bool = True,
) -> Path:
    src, dst = Path(src), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty directory")
    if file := next((p for p in dst.parents if p.exists() and not p.is_dir()), None):  # (before any weight is read)
        raise FileExistsError(f"{dst} cannot be written: {file} is a file, not a directory")
    if quantize and (src / "config.json").is_file() and (done := json.loads(
            (src / "config.json").read_text()).get("quantization")):  # (before reading any weights)
        raise ValueError(f"{src} is already quantized ({done}): convert its original checkpoint")
    shard = load_shard(src, mtp=mtp, dtype=getattr(mx, dtype) if dtype else None, runs_here=False)
    model = shard.model
    config = dict(shard.config.raw)
    if quantize:

        def predicate(path: str, module: nn.Module) -> bool | dict:
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
                return False
            if path.startswith("mtp.") and not quantize_mtp:
                return False
            if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8}  # routers stay precise, as mlx-lm does
            return True

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    if problem := runs_here_problem(model):  # (converted for a Mac, say: it is written all the same)
        log.warning("%s: %s: this machine runs it with --dtype float32 only", dst, problem)
    if not any((src / name).is_file() for name in TOKENIZER_SOURCES):
        log.warning("%s holds no tokenizer (none of %s): %s will need one beside its weights to generate", src,
                    ", ".join(TOKENIZER_SOURCES), dst)
    weights = {mlx_name(k): v for k, v in tree_flatten(model.parameters())}
    if not mtp:
        config.get("text_config", config)["mtp_num_hidden_layers"] = 0
    # Written beside `dst` and renamed once whole: a conversion cut short (Ctrl-C, a full disk) leaves
    # nothing a loader could take for a model, nor a directory a second try would refuse.
    partial = dst.parent / f".{dst.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        partial.mkdir()  # (as `dst` would be made: the umask's permissions)
    except OSError as e:  # (named as given, not as the hidden directory written first)
        raise OSError(e.errno, f"{dst} cannot be written: {e.strerror}") from None
    try:
        _write(partial, weights, config, src)
        if dst.exists():
            dst.rmdir()  # (empty: checked above)
        partial.rename(dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("converted %s -> %s (%s)", src, dst, f"{bits}-bit" if quantize else dtype or "original dtype")
    return dst


def _write(dst: Path, weights: dict[str, mx.array], config: dict, src: Path) -> None:
    shards = make_shards(weights)
    index: dict[str, str] = {}
    for i, tensors in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(dst / fname), tensors, metadata={"format": "mlx"})
        index.update({k: fname for k in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
