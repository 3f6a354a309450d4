"""The `mtpipe` executable: the command line, in a process that never loads PyTorch, and node
processes that never load transformers."""

from __future__ import annotations

import os
import sys

from ...models.deferred import defer_package_init
from ..stacks import dump_stacks_on_sigusr1


DEFERRING = ("node", "launch", "health", "cache")  # commands that may never need mlx-lm's tokenizer utilities


def main() -> int:
    """Run the command line, with torch marked absent first, and for the commands that may need no
    tokenizer (`DEFERRING`) mlx-lm's package init deferred.

    mtpipe computes with MLX only, but importing mlx-lm (its tokenizer utilities) makes transformers
    import torch whenever it is installed, as the `train` extra does: about 1.5 s and 180 MB in every
    process for nothing. A `None` entry in `sys.modules` makes transformers find no torch and take its
    torch-free paths. A node needs no tokenizer: deferring mlx-lm's init keeps transformers out of it
    altogether. A launch needs one only where it ends up coordinating, so it loads transformers then,
    and a launch that ends up a node never does; `health` and `cache` read nodes and files only
    (other commands load a tokenizer at once anyway), nor does asking for help. A library user's process
    is left alone.
    """
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    dump_stacks_on_sigusr1()
    # gRPC's core prints its own lines to stderr (a peer without the cluster secret: "Handshake failed");
    # what fails reaches the user through mtpipe's errors and logs, so only the core's errors show.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    asks_help = command is None or not {"-h", "--help"}.isdisjoint(sys.argv[1:])  # (argparse answers, then exits)
    if command in DEFERRING or asks_help:
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as mlx-lm's own init sets it
        defer_package_init("mlx_lm")
    try:
        from .main import main as run  # (Ctrl-C while the imports run ends as quietly as later)

        return run()
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
