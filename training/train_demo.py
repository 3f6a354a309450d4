"""Train the small Qwen3.5 demo model (GDN + gated attention backbone, one MTP layer) from scratch on CPU.

    python -m training.train_demo --out models/demo --work-dir /work/train_work [--steps N] [--resume]

Corpus: the CPython standard library sources of the running interpreter (fixed sorted file list,
every 20th file held out). The backbone is ``transformers.Qwen3_5ForCausalLM``; the MTP head is
written here to the reference math (shared/reference/mtp.md) and trained jointly:

    loss = CE(backbone logits[t], x[t+1]) + MTP_WEIGHT * CE(mtp logits[t], x[t+2])

The result is saved in raw Hugging Face layout (``model.language_model.*`` + top-level ``mtp.*``,
(1+w) RMSNorm weights, conv1d as [C, 1, K]) so that mlx-lm and transformers load it unchanged.
"""

from __future__ import annotations

import os

# The machine is shared: with OpenMP's default spin-waiting, two torch threads that get descheduled
# stall each other (measured 22-54 s/step against 11 s/step passive under load). Must precede torch;
# only when run as the training command (importing `load_demo` leaves the environment alone).
if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import copy
import json
import logging
import math
import platform
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

from .corpus import EXCLUDED_DIRS, HELD_OUT_EVERY, MANIFEST, read_text, split_files, stdlib_files

logger = logging.getLogger("train_demo")

CODEC_TABLE_MARKER = b"Python Character Mapping Codec"  # header of the encodings/ charmap tables


# ----------------------------------------------------------------------------------------------
# Hyperparameters


@dataclass
class ModelShape:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 8
    intermediate_size: int = 384
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 10_000_000.0
    max_position_embeddings: int = 32768


@dataclass
class TrainConfig:
    seed: int = 1234
    steps: int = 2000
    batch_size: int = 8
    seq_len: int = 512  # tokens per training row (the row holds seq_len + 1 ids)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 1.0
    eval_every: int = 100
    eval_rows: int = 16  # held-out windows for the periodic evaluation
    final_eval_rows: int = 128  # and for the final numbers in the model card
    checkpoint_minutes: float = 4.0
    max_minutes: float = 0.0  # training-loop wall budget; the schedule follows wall time when it binds
    threads: int = 2
    shape: ModelShape = field(default_factory=ModelShape)


# ----------------------------------------------------------------------------------------------
# Corpus


def train_split_files() -> tuple[list[Path], list[Path]]:
    """The corpus split of training/corpus.py, minus the charmap codec tables on the training side.

    The held-out side is exactly corpus.py's (benchmarks draw prompts from it). The codec tables
    (encodings/cp1252.py etc.) are generated data, not code, so they are not worth training on, nor
    measured on (`eval_files`).
    """
    train, held = split_files(stdlib_files())
    return [f for f in train if CODEC_TABLE_MARKER not in f.read_bytes()], held


def encode_files(tokenizer_dir: Path, files: list[Path]) -> torch.Tensor:
    """One flat id stream: each file's tokens followed by <|endoftext|>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    encodings = tok.encode_batch([read_text(f) for f in files], add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def eval_files(held: list[Path]) -> list[Path]:
    """The held-out files the held-out losses are measured on: without the codec tables, whose
    predictable runs would flatter the MTP head (corpus.py leaves them out of prompts too)."""
    return [f for f in held if CODEC_TABLE_MARKER not in f.read_bytes()]


def prepare_data(work_dir: Path, vocab_size: int) -> dict:
    """Train the tokenizer and tokenize both splits once; cached in work_dir for --resume."""
    try:
        from models.bpe import train_tokenizer
    except ImportError:  # installed as the mtpipe package
        from mtpipe.models.bpe import train_tokenizer

    cache = work_dir / "data.pt"
    root = Path(sysconfig.get_paths()["stdlib"])
    if cache.exists():
        data = torch.load(cache)
        if data["vocab_size"] != vocab_size:
            raise SystemExit(f"{cache} was built with vocab {data['vocab_size']}: use a fresh --work-dir")
        if data["stdlib_root"] != str(root) or data.get("python") != platform.python_version():
            # (no "python": built before the held-out losses left the codec tables out)
            raise SystemExit(f"{cache} was built from {data['stdlib_root']} (Python {data.get('python', '?')}), "
                             f"not from this Python's {root}, or by an older train_demo: use a fresh --work-dir")
        return data
    train_files, held_files = train_split_files()
    tok_dir = work_dir / "tokenizer"
    train_tokenizer((read_text(f) for f in train_files), tok_dir, vocab_size=vocab_size)
    data = {
        "vocab_size": vocab_size,
        "python": platform.python_version(),
        "stdlib_root": str(root),
        "train_files": [f.relative_to(root).as_posix() for f in train_files],
        "held_files": [f.relative_to(root).as_posix() for f in held_files],
        "train_bytes": sum(f.stat().st_size for f in train_files),
        "held_bytes": sum(f.stat().st_size for f in held_files),
        "train_ids": encode_files(tok_dir, train_files),
        "held_ids": encode_files(tok_dir, eval_files(held_files)),
    }
    torch.save(data, cache)
    logger.info(
        "corpus: %d train files (%d tokens), %d held-out files (%d tokens)",
        len(train_files),
        len(data["train_ids"]),
        len(held_files),
        len(data["held_ids"]),
    )
    return data


# ----------------------------------------------------------------------------------------------
# Model


def text_config(shape: ModelShape, eos_ids: list[int], pad_id: int) -> Qwen3_5TextConfig:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(shape.num_hidden_layers)]
    return Qwen3_5TextConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
        max_position_embeddings=shape.max_position_embeddings,
        layer_types=layer_types,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": shape.rope_theta,
            "partial_rotary_factor": 0.25,
            # Text-only: all three mRoPE sections see the same position, so this is plain RoPE. The
            # sections split the rotary half-dim (head_dim * 0.25 / 2 = 8) like 11/11/10 split 32.
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        bos_token_id=None,
    )


def mtp_layer_config(config: Qwen3_5TextConfig) -> Qwen3_5TextConfig:
    """Config for the single MTP decoder layer: one full-attention layer, same dims as the backbone."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    cfg._attn_implementation = "sdpa"
    return cfg


class MTPHead(nn.Module):
    """Qwen3.5 MTP head: position t predicts token t+2 from the backbone hidden H[t] and token x[t+1].

    e = pre_fc_norm_embedding(embed(x[t+1])); h = pre_fc_norm_hidden(H[t])
    u = mtp_layer(fc(concat[e, h]))  at RoPE position t;  logits = lm_head(norm(u))

    H is the backbone hidden after the final model.norm. The embedding and lm_head are the backbone's
    (shared, not owned: they are not in this module's state_dict). Parameter names match the
    checkpoint's ``mtp.*`` keys.
    """

    def __init__(self, config: Qwen3_5TextConfig, embed_tokens: nn.Embedding, lm_head: nn.Module):
        super().__init__()
        hidden = config.hidden_size
        layer_cfg = mtp_layer_config(config)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_cfg, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3_5TextRotaryEmbedding(layer_cfg)  # buffers only, not persistent
        # A tuple keeps the shared modules out of this module's parameters and state_dict.
        self._shared = (embed_tokens, lm_head)

    def init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, Qwen3_5RMSNorm):
                nn.init.zeros_(module.weight)  # (1 + w) form

    def forward(
        self,
        hidden_post_norm: torch.Tensor,
        next_token_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden_post_norm [B, T, H] = H[t]; next_token_ids [B, T] = x[t+1]; position_ids [B, T] = t.

        Returns logits [B, T, V] for x[t+2] (and the post-norm MTP hidden g when return_hidden).
        Attention is causal over the T given positions (no cache).
        """
        embed_tokens, lm_head = self._shared
        batch, length = next_token_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=next_token_ids.device).expand(batch, -1)
        e = self.pre_fc_norm_embedding(embed_tokens(next_token_ids))
        h = self.pre_fc_norm_hidden(hidden_post_norm)
        u = self.fc(torch.cat([e, h], dim=-1))  # embedding first, then hidden
        position_embeddings = self.rotary_emb(u, position_ids)
        mask = torch.full((length, length), torch.finfo(u.dtype).min, dtype=u.dtype, device=u.device)
        mask = torch.triu(mask, diagonal=1)[None, None]  # additive causal mask: works for eager and sdpa
        for layer in self.layers:
            u = layer(u, position_embeddings=position_embeddings, attention_mask=mask, position_ids=position_ids)
        g = self.norm(u)
        logits = lm_head(g)
        return (logits, g) if return_hidden else logits


def build_models(config: Qwen3_5TextConfig) -> tuple[Qwen3_5ForCausalLM, MTPHead]:
    config._attn_implementation = "sdpa"
    backbone = Qwen3_5ForCausalLM(config)
    mtp = MTPHead(config, backbone.model.embed_tokens, backbone.lm_head)
    mtp.init_weights(config.initializer_range)
    return backbone, mtp


def load_demo(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> tuple[Qwen3_5ForCausalLM, MTPHead]:
    """Load a saved demo checkpoint (config.json + model.safetensors) into the torch backbone + MTPHead."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    cfg_dict = json.loads((model_dir / "config.json").read_text())["text_config"]
    config = Qwen3_5TextConfig(**{k: v for k, v in cfg_dict.items() if k not in ("model_type", "architectures")})
    backbone, mtp = build_models(config)
    weights = load_file(str(model_dir / "model.safetensors"))
    prefix = "model.language_model."
    backbone_sd = {"model." + k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if "lm_head.weight" in weights:
        backbone_sd["lm_head.weight"] = weights["lm_head.weight"]
    missing, unexpected = backbone.load_state_dict(backbone_sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"backbone weights mismatch: missing={missing} unexpected={unexpected}")
    mtp.load_state_dict({k[len("mtp.") :]: v for k, v in weights.items() if k.startswith("mtp.")}, strict=True)
    backbone.to(dtype).eval()
    mtp.to(dtype).eval()
    return backbone, mtp


# ----------------------------------------------------------------------------------------------
# Training


def training_progress(step: int, elapsed: float, cfg: TrainConfig) -> float:
    """Fraction of the run done: by steps, or by wall time when --max-minutes binds first.

    Driving the schedule by the larger of the two keeps the cosine annealing to its end even when the
    machine is slower than planned (it is shared), instead of stopping at a high learning rate.
    """
    progress = step / cfg.steps
    if cfg.max_minutes > 0:
        progress = max(progress, elapsed / (cfg.max_minutes * 60))
    return min(1.0, progress)


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warmup over the first steps, then cosine decay (over `progress`) to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params: list[tuple[str, nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    # No weight decay on norms, biases, GDN gate parameters or the (tied) embedding.
    no_decay = [p for n, p in params if p.ndim < 2 or "embed_tokens" in n]
    decay = [p for n, p in params if not (p.ndim < 2 or "embed_tokens" in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def sample_batch(ids: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens; the RNG depends only on (seed, step) so resume is exact."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    # (the last start is never drawn: kept, so that the committed demo's command reproduces it)
    starts = torch.randint(0, len(ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([ids[s : s + cfg.seq_len + 1] for s in starts.tolist()]).long()


def held_out_rows(ids: torch.Tensor, cfg: TrainConfig, rows: int) -> torch.Tensor:
    """Fixed evenly spaced held-out windows."""
    span = cfg.seq_len + 1
    n = min(rows, len(ids) // span)
    stride = (len(ids) - span) // max(1, n - 1) if n > 1 else 0
    return torch.stack([ids[i * stride : i * stride + span] for i in range(n)]).long()


def forward_losses(backbone: Qwen3_5ForCausalLM, mtp: MTPHead, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """rows [B, L]: next-token CE over L-1 positions and MTP CE (t -> t+2) over L-2 positions."""
    inputs = rows
    hidden = backbone.model(input_ids=inputs).last_hidden_state  # post final norm
    logits = backbone.lm_head(hidden)
    main = F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten())
    length = rows.shape[1] - 2
    positions = torch.arange(length).expand(rows.shape[0], -1)
    mtp_logits = mtp(hidden[:, :-2], rows[:, 1:-1], positions)
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), rows[:, 2:].flatten())
    return {"main": main, "mtp": mtp_loss, "logits": logits, "mtp_logits": mtp_logits}


@torch.no_grad()
def evaluate(backbone: Qwen3_5ForCausalLM, mtp: MTPHead, rows: torch.Tensor) -> dict[str, float]:
    """Held-out losses and teacher-forced depth-1 MTP agreement with the backbone's greedy token,
    averaged over rows (a last, shorter chunk weighs what its rows do). The models' modes are kept."""
    modes = backbone.training, mtp.training
    backbone.eval()
    mtp.eval()
    totals = {"main": 0.0, "mtp": 0.0, "main_acc": 0.0, "mtp_acc": 0.0, "agree": 0.0}
    for chunk in rows.split(8):
        out = forward_losses(backbone, mtp, chunk)
        greedy = out["logits"].argmax(-1)  # greedy[t] is the backbone's pick for x[t+1]
        draft = out["mtp_logits"].argmax(-1)  # draft[t] is the MTP pick for x[t+2]
        n = chunk.shape[0]
        totals["main"] += out["main"].item() * n
        totals["mtp"] += out["mtp"].item() * n
        totals["main_acc"] += (greedy[:, :-1] == chunk[:, 1:]).float().mean().item() * n
        totals["mtp_acc"] += (draft == chunk[:, 2:]).float().mean().item() * n
        totals["agree"] += (draft == greedy[:, 1:-1]).float().mean().item() * n
    backbone.train(modes[0])
    mtp.train(modes[1])
    return {k: v / rows.shape[0] for k, v in totals.items()}


def save_checkpoint(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written checkpoint


# ----------------------------------------------------------------------------------------------
# Export


def export_weights(backbone: Qwen3_5ForCausalLM, mtp: MTPHead, tied: bool) -> dict[str, torch.Tensor]:
    """Raw HF names: backbone under model.language_model.*, MTP under top-level mtp.*."""
    weights = {}
    for name, tensor in backbone.state_dict().items():
        if name == "lm_head.weight":
            if not tied:
                weights[name] = tensor
            continue
        assert name.startswith("model."), name
        weights["model.language_model." + name[len("model.") :]] = tensor
    for name, tensor in mtp.state_dict().items():
        weights["mtp." + name] = tensor
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in weights.items()}


# Generic PreTrainedConfig fields that real Qwen3.5 text_configs do not carry.
GENERIC_CONFIG_KEYS = {
    "_name_or_path",
    "architectures",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_attn_implementation_autoset",
}


def export_config(config: Qwen3_5TextConfig) -> dict:
    text = {k: v for k, v in config.to_dict().items() if k not in GENERIC_CONFIG_KEYS}
    text.update(
        model_type="qwen3_5_text",
        full_attention_interval=4,
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        dtype="float32",
    )
    import transformers

    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "dtype": "float32",
        "transformers_version": transformers.__version__,
    }


def write_output(
    out_dir: Path,
    work_dir: Path,
    backbone: Qwen3_5ForCausalLM,
    mtp: MTPHead,
    cfg: TrainConfig,
    data: dict,
    summary: dict,
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = backbone.config
    weights = export_weights(backbone, mtp, config.tie_word_embeddings)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(export_config(config), indent=2) + "\n")
    generation = {"eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work_dir / "tokenizer" / name, out_dir / name)
    held = {"python": data.get("python", platform.python_version()), "held": data["held_files"]}
    (out_dir / MANIFEST).write_text(json.dumps(held, indent=1) + "\n")
    (out_dir / "README.md").write_text(model_card(cfg, data, summary, weights))
    logger.info("wrote %s (%d tensors)", out_dir, len(weights))


def model_card(cfg: TrainConfig, data: dict, summary: dict, weights: dict[str, torch.Tensor]) -> str:
    n_backbone = sum(v.numel() for k, v in weights.items() if not k.startswith("mtp."))
    n_mtp = sum(v.numel() for k, v in weights.items() if k.startswith("mtp."))
    s = cfg.shape
    ev = summary["final_eval"]
    tr = summary["final_train"]
    held = "\n".join(f"    {f}" for f in data["held_files"])
    attention = (
        f"{s.num_attention_heads} q heads, {s.num_key_value_heads} kv heads, head_dim {s.head_dim}, "
        f"output gate, q/k norm, partial RoPE 0.25, theta {s.rope_theta:g}"
    )
    gdn = (
        f"{s.linear_num_key_heads} key heads x {s.linear_key_head_dim}, {s.linear_num_value_heads} value heads "
        f"x {s.linear_value_head_dim}, conv kernel {s.linear_conv_kernel_dim}"
    )
    history = "\n".join(
        f"| {h['step']} | {h['main']:.3f} | {h['mtp']:.3f} | {h['main_acc']:.3f} | {h['agree']:.3f} |"
        for h in summary["eval_history"]
    )
    return f"""# mtpipe demo model: tiny Qwen3.5 with a trained MTP head

A small Qwen3.5-architecture language model (Gated DeltaNet + gated full attention, 3:1 layer layout)
with one native MTP layer, trained from scratch on CPU on the CPython standard library sources.
It exists to exercise the mtpipe MTP runtime end to end; it is not a useful code model.

## How it was made

```
{summary["command"]}
```

- Script: `training/train_demo.py` (tokenizer: `models/bpe.py`), seed {cfg.seed}.
- Machine: {summary["machine"]}, torch {torch.__version__}, {cfg.threads} threads, float32.
- Steps: {summary["steps_done"]} of the {summary["steps_planned"]} asked (with `--max-minutes` the
  learning-rate schedule follows wall time when that binds first, and the run stops at the budget),
  batch {cfg.batch_size} x {cfg.seq_len} tokens ({summary["tokens_seen"]:,} training tokens,
  {summary["epochs"]:.2f} epochs), wall time {summary["wall_minutes"]:.1f} min
  (training loop; {summary["resumes"]} resume(s)).
- Optimizer: AdamW (betas 0.9/0.95, weight decay {cfg.weight_decay} on matrices only), peak lr {cfg.lr},
  {cfg.warmup_steps} warmup steps, cosine decay to {cfg.min_lr_ratio} x peak, grad clip {cfg.grad_clip}.
- Loss: `CE(next token) + {cfg.mtp_weight} * CE(MTP, token t+2)`, trained jointly (the MTP loss also
  trains the shared trunk, embedding and lm_head).

## Corpus and split

CPython {platform.python_version()} standard library, `{data["stdlib_root"]}`: every `*.py` file, excluding
directories named {", ".join(sorted(EXCLUDED_DIRS))}, the `config-*` directory and `_sysconfigdata*`
(`training/corpus.py`). Files are sorted by relative POSIX path; file `i` is held out iff
`i % {HELD_OUT_EVERY} == {HELD_OUT_EVERY - 1}`. The charmap codec tables (files containing
"Python Character Mapping Codec", all under `encodings/`: generated data, not code) are left out of the
training side, and out of the held-out losses below; the held-out side is exactly
`training.corpus.split_files`, and `{MANIFEST}` names its files (prompts said to be held out are drawn
from them, under any Python).
Each file is tokenized and followed by `<|endoftext|>`; training windows are sampled at random offsets
of the concatenated train stream.

- Train: {len(data["train_files"])} files, {data["train_bytes"]:,} bytes, {len(data["train_ids"]):,} tokens.
- Held out: {len(data["held_files"])} files, {data["held_bytes"]:,} bytes; {len(data["held_ids"]):,} tokens
  measured (the codec tables left out).

The tokenizer (byte-level BPE, Qwen2 pre-tokenizer regex, vocab {s.vocab_size}, specials
`<|endoftext|>`=0, `<|im_start|>`=1, `<|im_end|>`=2, ChatML chat template) was trained on the train split only.

Held-out manifest (relative to the stdlib root):

```
{held}
```

## Architecture

| | |
|---|---|
| layers | {s.num_hidden_layers} (layer i is full attention iff (i+1) % 4 == 0, else Gated DeltaNet) |
| hidden / MLP | {s.hidden_size} / {s.intermediate_size} (SwiGLU) |
| attention | {attention} |
| Gated DeltaNet | {gdn} |
| vocab | {s.vocab_size}, tied embeddings (no `lm_head.weight` key) |
| MTP | 1 layer (full attention decoder layer), post-norm hidden, shared embedding and lm_head |
| parameters | backbone {n_backbone:,}, MTP {n_mtp:,}, total {n_backbone + n_mtp:,} |
| storage | float32 safetensors, raw HF names and (1+w) norm weights |

## Results (end of training)

| | next-token | MTP (t+2) |
|---|---|---|
| train loss (mean of last {summary["train_window"]} steps) | {tr["main"]:.4f} | {tr["mtp"]:.4f} |
| held-out loss ({summary["eval_windows"]} windows of {cfg.seq_len + 1} tokens) | {ev["main"]:.4f} | {ev["mtp"]:.4f} |
| held-out top-1 accuracy vs. data | {ev["main_acc"]:.4f} | {ev["mtp_acc"]:.4f} |

Held-out teacher-forced depth-1 agreement (MTP greedy draft == backbone greedy token at the next
position): **{ev["agree"]:.4f}**. This is a proxy; the engine's measured acceptance is below.

Held-out evaluation during training:

| step | loss | MTP loss | top-1 acc | MTP agreement |
|---|---|---|---|---|
{history}

## Acceptance (measured by the engine)

_To be filled in by the engine measurement (greedy MTP acceptance at depth 1 on held-out stdlib code)._
"""


# ----------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output model directory (e.g. models/demo)")
    p.add_argument("--work-dir", type=Path, required=True, help="checkpoints, tokenized corpus, tokenizer")
    p.add_argument("--steps", type=_positive, default=defaults.steps)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="wall-clock budget of the training loop: the cosine schedule follows max(step/steps, "
        "elapsed/budget), so a slow (shared) machine still anneals fully and stops in time",
    )
    p.add_argument("--resume", action="store_true", help="continue from work-dir/checkpoint.pt")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--batch-size", type=_positive, default=defaults.batch_size)
    p.add_argument("--seq-len", type=_positive, default=defaults.seq_len, help="tokens per window (2 or more)")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--mtp-weight", type=float, default=defaults.mtp_weight)
    p.add_argument("--eval-every", type=_positive, default=defaults.eval_every)
    p.add_argument("--checkpoint-minutes", type=float, default=defaults.checkpoint_minutes)
    p.add_argument("--vocab-size", type=_positive, default=ModelShape.vocab_size)
    args = p.parse_args(argv)
    if args.seq_len < 2:
        p.error("--seq-len must be 2 or more (the MTP head predicts two tokens ahead)")
    if not (args.max_minutes >= 0 and args.checkpoint_minutes >= 0):
        p.error("--max-minutes (0: no budget) and --checkpoint-minutes must be 0 or more")
    return args


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    cfg = TrainConfig(
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        mtp_weight=args.mtp_weight,
        eval_every=args.eval_every,
        max_minutes=args.max_minutes,
        checkpoint_minutes=args.checkpoint_minutes,
        warmup_steps=min(TrainConfig.warmup_steps, max(1, args.steps // 10)),
        shape=ModelShape(vocab_size=args.vocab_size),
    )
    torch.set_num_threads(cfg.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.work_dir / "checkpoint.pt"

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    data = prepare_data(args.work_dir, cfg.shape.vocab_size)
    for split in ("train_ids", "held_ids"):
        if len(data[split]) < cfg.seq_len + 2:
            raise SystemExit(f"--seq-len {cfg.seq_len}: the {split.split('_')[0]} stream has only "
                             f"{len(data[split])} tokens")

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.work_dir / "tokenizer" / "tokenizer.json"))
    eos_ids = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    pad_id = tok.token_to_id("<|endoftext|>")
    cfg.shape.vocab_size = tok.get_vocab_size()
    config = text_config(cfg.shape, eos_ids, pad_id)
    backbone, mtp = build_models(config)
    params = list(backbone.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]
    optimizer = make_optimizer(params, cfg)

    step, elapsed, resumes = 0, 0.0, 0
    eval_history: list[dict] = []
    recent: list[tuple[float, float]] = []  # (main, mtp) train losses of the last 50 steps
    if args.resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        saved = dict(state["train_config"])
        # Operational settings may change across a resume; everything that shapes training may not.
        for key in ("checkpoint_minutes", "max_minutes"):
            saved[key] = getattr(cfg, key)
        if saved != asdict(cfg):
            raise SystemExit(f"--resume with a different configuration: {saved} vs {asdict(cfg)}")
        backbone.load_state_dict(state["backbone"])
        mtp.load_state_dict(state["mtp"])
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed, eval_history = state["step"], state["elapsed"], state["eval_history"]
        recent = state["recent"]
        resumes = state["resumes"] + 1
        logger.info("resumed at step %d (%.1f min trained)", step, elapsed / 60)
    elif ckpt_path.exists():
        raise SystemExit(f"{ckpt_path} exists: pass --resume or use a fresh --work-dir")
    elif args.resume:
        logger.warning("--resume: no %s yet, training from the start", ckpt_path)

    n_params = sum(p.numel() for _, p in params)
    logger.info("params: %d (mtp %d); config %s", n_params, sum(p.numel() for p in mtp.parameters()), asdict(cfg))
    held_rows = held_out_rows(data["held_ids"], cfg, cfg.eval_rows)
    train_ids = data["train_ids"]
    last_ckpt = time.time()
    t_start = time.time() - elapsed
    planned_steps = args.steps

    def snapshot() -> dict:
        return {
            "backbone": backbone.state_dict(),
            "mtp": mtp.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "elapsed": time.time() - t_start,
            "eval_history": eval_history,
            "resumes": resumes,
            "train_config": asdict(cfg),
            "recent": recent,
        }

    backbone.train()
    mtp.train()
    while (progress := training_progress(step, time.time() - t_start, cfg)) < 1.0:
        t0 = time.time()
        lr = lr_at(step, progress, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        out = forward_losses(backbone, mtp, sample_batch(train_ids, step, cfg))
        loss = out["main"] + cfg.mtp_weight * out["mtp"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.grad_clip)
        optimizer.step()
        step += 1
        recent = (recent + [(out["main"].item(), out["mtp"].item())])[-50:]
        if step % 10 == 0 or step == 1:
            logger.info(
                "step %d/%d loss %.4f mtp %.4f lr %.2e gnorm %.2f %.2fs/step elapsed %.1f min progress %.3f",
                step,
                cfg.steps,
                out["main"].item(),
                out["mtp"].item(),
                lr,
                grad_norm.item(),
                time.time() - t0,
                (time.time() - t_start) / 60,
                progress,
            )
        if step % cfg.eval_every == 0:
            ev = evaluate(backbone, mtp, held_rows)
            eval_history.append({"step": step, **ev})
            logger.info(
                "eval step %d held-out loss %.4f mtp %.4f acc %.3f mtp_acc %.3f agreement %.3f",
                step,
                ev["main"],
                ev["mtp"],
                ev["main_acc"],
                ev["mtp_acc"],
                ev["agree"],
            )
        if time.time() - last_ckpt > cfg.checkpoint_minutes * 60:
            save_checkpoint(ckpt_path, snapshot())
            last_ckpt = time.time()
            logger.info("checkpoint saved at step %d", step)

    save_checkpoint(ckpt_path, snapshot())
    logger.info("training loop finished at step %d (%.1f min); checkpoint saved", step, (time.time() - t_start) / 60)

    final_rows = held_out_rows(data["held_ids"], cfg, cfg.final_eval_rows)
    final_eval = evaluate(backbone, mtp, final_rows)
    logger.info("final held-out eval (%d windows): %s", final_rows.shape[0], final_eval)
    wall = time.time() - t_start
    tokens_seen = step * cfg.batch_size * cfg.seq_len
    summary = {
        "command": "python -m training.train_demo "
        + " ".join(a for a in (sys.argv[1:] if argv is None else argv) if a != "--resume"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "steps_done": step,
        "steps_planned": planned_steps,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / len(train_ids),
        "wall_minutes": wall / 60,
        "resumes": resumes,
        "train_window": len(recent),
        "final_train": {
            "main": sum(r[0] for r in recent) / max(1, len(recent)),
            "mtp": sum(r[1] for r in recent) / max(1, len(recent)),
        },
        "final_eval": final_eval,
        "eval_history": eval_history,
        "eval_windows": final_rows.shape[0],
    }
    (args.work_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_output(args.out, args.work_dir, backbone, mtp, cfg, data, summary)
    logger.info("done: %d steps in %.1f min", step, wall / 60)


if __name__ == "__main__":
    main()
