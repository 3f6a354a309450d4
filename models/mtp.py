"""The Qwen3.5 multi-token-prediction head (position t predicts token t+2).

    e = pre_fc_norm_embedding(embed(x[t+1]));  h = pre_fc_norm_hidden(H[t])
    u = mtp_layer(fc(concat([e, h])), cache);  g = norm(u);  logits = lm_head(g)

It shares the backbone's embedding and lm_head (the shard passes them in). H is the backbone
hidden after the final norm by default; `pre_norm_hidden` feeds the hidden before it instead.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from .ragged import RaggedKV, ragged_layer


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

    def __call__(self, hidden: mx.array, token_embeddings: mx.array, cache: KVCache) -> mx.array:
        """hidden, token_embeddings: [B, T, H] for positions t and tokens x[t+1]. Returns g [B, T, H]."""
        u = self.fuse(hidden, token_embeddings)
        mask = create_attention_mask(u, cache)
        u = self.layers[0](u, mask=mask, cache=cache)
        return self.norm(u)

    def fuse(self, hidden: mx.array, token_embeddings: mx.array) -> mx.array:
        e = self.pre_fc_norm_embedding(token_embeddings)
        h = self.pre_fc_norm_hidden(hidden)
        return self.fc(mx.concatenate([e, h], axis=-1))

    def rows(self, hidden: mx.array, token_embeddings: mx.array, cache: RaggedKV, real: list[int]) -> mx.array:
        """The same over padded rows of a batch, each with its own MTP cache length (ragged.py)."""
        u, _ = ragged_layer(self.layers[0], self.fuse(hidden, token_embeddings), cache, real)
        return self.norm(u)
