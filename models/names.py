"""Checkpoint tensor names, without MLX: the shard-local name space and which tensors a shard needs.

`canonical_name` maps every accepted checkpoint layout to the shard's own names (loading.py renames
with it); `shard_tensors` picks, by the same rules as `Qwen35Shard` and `select_shard`, the checkpoint
names a shard of layers [start, end) reads: its layers, the embedding on the first shard (and on the
last when the head is tied or the MTP head reads it), the final norm and lm_head on the last, and the
MTP head there when asked for. A node fetches exactly these from a peer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

IGNORED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")
PREFIXES = (  # longest first; maps a checkpoint prefix to the shard's own name space
    ("model.language_model.", ""),
    ("language_model.model.", ""),
    ("language_model.mtp.", "mtp."),
    ("language_model.lm_head.", "lm_head."),
    ("model.mtp.", "mtp."),
    ("model.", ""),
)
_LAYER = re.compile(r"layers\.(\d+)\.")


def canonical_name(key: str) -> str | None:
    """The shard-local name space: embed_tokens.*, layers.N.*, norm.*, lm_head.*, mtp.*; None = skip."""
    if key.startswith(IGNORED_PREFIXES):
        return None
    for prefix, repl in PREFIXES:
        if key.startswith(prefix):
            return repl + key[len(prefix) :]
    return key


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text part of a config.json (nested `text_config` or flat), as config.py reads it."""
    text = dict(raw.get("text_config") or raw)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def shard_tensors(
    names: Iterable[str], config: dict[str, Any], start: int, end: int, num_layers: int, mtp: bool
) -> list[str]:
    """The checkpoint names (sorted) that a shard of layers [start, end) loads, from a config.json dict."""
    text = text_config(config)
    if int(text.get("num_hidden_layers", num_layers)) != num_layers or not 0 <= start < end <= num_layers:
        raise ValueError(f"invalid shard [{start}, {end}) of {num_layers} layers for this model "
                         f"({text.get('num_hidden_layers')} layers)")
    tied = bool(text.get("tie_word_embeddings", False))
    first, last = start == 0, end == num_layers
    has_mtp = last and mtp and int(text.get("mtp_num_hidden_layers", 0) or 0) > 0
    out = []
    for key in names:
        name = canonical_name(key)
        if name is None:
            continue
        m = _LAYER.match(name)
        if m:
            keep = start <= int(m.group(1)) < end
        elif name.startswith("embed_tokens."):
            keep = first or (last and (tied or has_mtp))
        elif name.startswith("norm."):
            keep = last
        elif name.startswith("lm_head."):
            keep = last and not tied
        elif name.startswith("mtp."):
            keep = has_mtp
        else:
            keep = False
        if keep:
            out.append(key)
    return sorted(out)
