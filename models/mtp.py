"""The Qwen3.5 multi-token-prediction head (position t predicts token t+2).

    e = pre_fc_norm_embedding(embed(x[t+1]));  h = pre_fc_norm_hidden(H[t])
    u = mtp_layer(fc(concat([e, h])), cache);  g = norm(u);  logits = lm_head(g)

It shares the backbone's embedding and lm_head (the shard passes them in). H is the backbone
hidden after the final norm by default; `pre_norm_hidden` feeds the hidden before it instead.

Drafting may attend to a sliding window (`window`: each position reads itself and that many before
it): the backbone's hidden H[t] already carries the whole context, the head's own attention over a
long one is most of a draft step, and drafts only propose (verification keeps the output exact), so
a window can only move how many are accepted. The cache keeps every entry, so rollback trims it as
before, and a position reads the same keys however a call's positions are split.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from .attention import attention_entries, attention_layer, cache_update
from .gdn_snapshots import CompiledLayers
from .ragged import RaggedKV, ragged_layer, sliding_mask

# How many positions before its own each drafting position attends to, unless told otherwise.
DEFAULT_WINDOW = 1024

# Queries x keys past which new cache entries whose outputs nobody reads are better written alone
# (keys and values only) than run through the layer with the one position whose output drafts.
ENTRIES_ONLY_WORK = 4096


def entries_only_pays(positions: int, context: int) -> bool:
    """Whether `positions` new pairs over a cache of `context` entries, of which only the last
    position's output is read, are better split (entries for the rest, the layer for the last):
    the split saves their attention and MLP and costs a few more small ops."""
    return positions > 1 and (positions - 1) * (context + positions) >= ENTRIES_ONLY_WORK


def attended(context: int, window: int | None) -> int:
    """How many earlier entries a call's queries read over a cache of `context` entries."""
    return min(context, window) if window else context


class _Recent:
    """A single-sequence cache seen through a window: a call writes its entries to the whole cache,
    and its attention is handed the keys from `start` on (the first query's window)."""

    def __init__(self, cache: KVCache, start: int):
        self.cache = cache
        self.start = start

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        keys_all, values_all = self.cache.update_and_fetch(keys, values)
        return keys_all[..., self.start :, :], values_all[..., self.start :, :]


class MTPHead(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        H = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        # A full-attention decoder layer (layer index interval-1 is full attention in mlx-lm's rule);
        # dense or sparse MoE MLP exactly like the backbone's layers.
        self.layers = [DecoderLayer(args, layer_idx=args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.compiled = CompiledLayers()  # (a plain object: not one of the module's parameters)

    def __call__(self, hidden: mx.array, token_embeddings: mx.array, cache: KVCache,
                 window: int | None = None) -> mx.array:
        """hidden, token_embeddings: [B, T, H] for positions t and tokens x[t+1]. Returns g [B, T, H].
        With a `window`, each position attends to itself and the `window` positions before it."""
        u = self.fuse(hidden, token_embeddings)
        T, offset = u.shape[1], cache.offset
        view: KVCache | _Recent = cache
        mask = create_attention_mask(u, cache)  # causal over the keys' last T (MLX aligns it to the end)
        if window and offset + T - 1 > window:  # some query's window leaves out the first keys
            start = max(0, offset - window)
            view = _Recent(cache, start)
            if T > 1:
                mask = sliding_mask(offset + mx.arange(T, dtype=mx.int32), start, offset + T, window)
        u = attention_layer(self.layers[0], u, view.offset, cache_update(view, mask), self.compiled)
        return self.norm(u)

    def extend(self, hidden: mx.array, token_embeddings: mx.array, cache: KVCache | RaggedKV,
               real: list[int] | None = None) -> None:
        """Cache entries for positions whose outputs nobody reads (a prompt, the positions decoded
        without drafts): a position's keys and values depend only on its own input, so the attention
        over the context and the MLP are skipped. With a RaggedKV, row i adds `real[i]` entries."""
        layer = self.layers[0]
        x = layer.input_layernorm(self.fuse(hidden, token_embeddings))
        if isinstance(cache, RaggedKV):
            keys, values = attention_entries(layer.self_attn, x, cache.offsets())
            cache.update(keys, values, real if real is not None else [x.shape[1]] * x.shape[0])
        else:
            keys, values = attention_entries(layer.self_attn, x, cache.offset)
            cache.update_and_fetch(keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3))

    def fuse(self, hidden: mx.array, token_embeddings: mx.array) -> mx.array:
        e = self.pre_fc_norm_embedding(token_embeddings)
        h = self.pre_fc_norm_hidden(hidden)
        return self.fc(mx.concatenate([e, h], axis=-1))

    def rows(self, hidden: mx.array, token_embeddings: mx.array, cache: RaggedKV, real: list[int],
             window: int | None = None) -> mx.array:
        """The same over padded rows of a batch, each with its own MTP cache length (ragged.py)."""
        u, _ = ragged_layer(self.layers[0], self.fuse(hidden, token_embeddings), cache, real, self.compiled, window)
        return self.norm(u)
