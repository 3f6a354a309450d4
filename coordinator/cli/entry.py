"""The `mtpipe` executable: the command line, in a process that never loads PyTorch."""

from __future__ import annotations

import sys


def main() -> int:
    """Run the command line, with torch marked absent first.

    mtpipe computes with MLX only, but importing mlx-lm (its tokenizer utilities) makes transformers
    import torch whenever it is installed, as the `train` extra does: about 1.5 s and 180 MB in every
    node process for nothing. A `None` entry in `sys.modules` makes transformers find no torch and
    take its torch-free paths; a library user's process is left alone.
    """
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    from .main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
