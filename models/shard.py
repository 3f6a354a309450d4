"""A shard of a Qwen3.5 model: a contiguous layer range, plus embedding and head at the ends.

A whole model is the one shard that is both first and last. Layers, attention, MLP and MoE blocks
are mlx-lm's own modules; this file only decides which of them a shard holds and how a forward
over them keeps per-position GatedDeltaNet snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer

from .attention import attention_layer, cache_update
from .config import ModelConfig
from .gdn_chunked import prefill_layer
from .gdn_snapshots import CompiledLayers, GDNSnapshots, gdn_layer, on_cpu
from .mtp import MTPHead
from .ragged import ragged_layer


@dataclass(frozen=True)
class ShardSpec:
    """Layers [start, end) of a model with `num_layers` layers."""

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(
                f"invalid layer range [{self.start}, {self.end}) for a model of {self.num_layers} layers"
            )

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    @classmethod
    def whole(cls, num_layers: int) -> ShardSpec:
        return cls(0, num_layers, num_layers)


STEPPED_MAX_TOKENS = 16  # longer inputs (prefill chunks): mlx-lm's layer on Metal, the chunked recurrence on the CPU
LayerCache = Any  # KVCache for attention layers, ArraysCache(2) for GatedDeltaNet layers


def queue_layers() -> bool:
    """Whether a forward queues each layer as it is built. On the CPU, MLX computes queued work on the
    stream's own thread and `async_eval` returns only while the last of it runs, so a forward built
    whole and then queued leaves the CPU idle while the host builds it, and the host idle while it
    computes; queued layer by layer, the host builds the next layer while this one computes. That
    holds for a forward queued ahead of its use too: its `async_eval` would wait for most of it
    anyway. (Waiting for each layer instead is slower than either.) Metal keeps one submission per
    forward (not measured here)."""
    return on_cpu()


class Qwen35Shard(nn.Module):
    def __init__(self, config: ModelConfig, spec: ShardSpec, with_mtp: bool):
        super().__init__()
        args = config.args
        self.config = config
        self.spec = spec
        self.has_mtp = with_mtp and spec.is_last
        self.compiled = CompiledLayers()  # (a plain object: not one of the module's parameters)
        # The last shard needs the embedding too: tied lm_head and the MTP head both read it.
        if spec.is_first or (spec.is_last and (args.tie_word_embeddings or self.has_mtp)):
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, layer_idx=i) for i in range(spec.start, spec.end)]
        if spec.is_last:
            self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
            if not args.tie_word_embeddings:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
            if self.has_mtp:
                self.mtp = MTPHead(args)

    # -- pieces of the forward ---------------------------------------------------------------

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def make_cache(self) -> list[LayerCache]:
        return [ArraysCache(size=2) if layer.is_linear else KVCache() for layer in self.layers]

    def run_layers(
        self, h: mx.array, cache: list[LayerCache], capture: bool = False
    ) -> tuple[mx.array, dict[int, GDNSnapshots]]:
        """Run this shard's layers, each queued as it is built where that pays (`queue_layers`). With
        `capture`, GatedDeltaNet layers keep per-position states.

        Short inputs (decode, verify) always take the stepped GatedDeltaNet path: one recurrence step
        per position whatever the input's length, compiled, so decode and verify agree bit for bit;
        on the CPU their attention layers run compiled around the cache too (attention.py). Longer
        inputs (prefill) on the CPU run the recurrence a chunk at a time (gdn_chunked.py).
        """
        attn_cache = next((c for c, l in zip(cache, self.layers) if not l.is_linear), None)
        attn_mask = create_attention_mask(h, attn_cache)
        stepped = capture or h.shape[1] <= STEPPED_MAX_TOKENS
        queue = queue_layers()
        snapshots: dict[int, GDNSnapshots] = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            if layer.is_linear and stepped:
                h, snapshots[i] = gdn_layer(layer, h, c, self.compiled)
            elif not layer.is_linear and self.compiled.applies(h):
                h = attention_layer(layer, h, c.offset, cache_update(c, attn_mask), self.compiled)
            elif layer.is_linear:
                h = prefill_layer(layer, h, c)
            else:
                h = layer(h, mask=attn_mask, cache=c)
            if queue:
                mx.async_eval(h)
        return h, snapshots

    def run_rows(self, h: mx.array, cache: list, real: list[int]) -> tuple[mx.array, dict[int, GDNSnapshots]]:
        """Run this shard's layers over padded rows of a batch (see ragged.py); row i has `real[i]` tokens."""
        queue = queue_layers()
        snapshots: dict[int, GDNSnapshots] = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h, snaps = ragged_layer(layer, h, c, real, self.compiled)
            if snaps is not None:
                snapshots[i] = snaps
            if queue:
                mx.async_eval(h)
        return h, snapshots

    def final_norm(self, h: mx.array) -> mx.array:
        return self.norm(h)

    def lm_logits(self, normed: mx.array) -> mx.array:
        if self.config.args.tie_word_embeddings:
            return self.embed_tokens.as_linear(normed)
        return self.lm_head(normed)

    def parameter_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))
