"""mlx-lm's own pipeline, the peer in `mtpipe bench pipeline`. Every rank runs this under mlx.launch:

    mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- python -m mtpipe.coordinator.bench.mlx_ring_peer \\
        --model PATH --prompts prompts.json --max-tokens 128

`sharded_load(path, pipeline_group)` gives each rank a contiguous slice of layers; each token is one
pass through the ranks plus an all_gather of the last hidden state, and every rank samples in
lockstep. Rank 0 prints one line `MTPIPE_RING_RESULT {json}` with per-prompt decode speeds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .engine import time_mlx_lm

RESULT_PREFIX = "MTPIPE_RING_RESULT "


def with_weight_index(model_path: Path) -> Path:
    """sharded_load picks files through model.safetensors.index.json; single-file checkpoints lack it,
    so build a directory of symlinks that has one."""
    if (model_path / "model.safetensors.index.json").exists():
        return model_path
    import mlx.core as mx

    out = Path(tempfile.mkdtemp(prefix="mtpipe-ring-"))
    weight_map = {}
    for f in model_path.iterdir():
        os.symlink(f.resolve(), out / f.name)
        if f.suffix == ".safetensors":
            weight_map.update({k: f.name for k in mx.load(str(f))})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init(strict=True)
    indexed = with_weight_index(Path(args.model))
    try:
        model, tokenizer = sharded_load(str(indexed), pipeline_group=group)
    finally:  # the weights are loaded (or failed to): the symlinks are not needed any more
        if indexed != Path(args.model):
            shutil.rmtree(indexed, ignore_errors=True)
    prompts = json.loads(Path(args.prompts).read_text())
    time_mlx_lm(model, tokenizer, prompts[0], 8)  # warm-up, in lockstep on every rank
    speeds, outputs = [], []
    for prompt in prompts:
        tokens, tps = time_mlx_lm(model, tokenizer, prompt, args.max_tokens)
        speeds.append(tps)
        outputs.append(tokens)
    if group.rank() == 0:
        result = {"ranks": group.size(), "tok_s": speeds, "tokens": outputs,
                  "layers": [model.model.start_idx, model.model.end_idx]}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
