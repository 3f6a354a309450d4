"""`mtpipe node`: run a node daemon that serves one shard of a model."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..models.mtp import DEFAULT_WINDOW
from .links import DEFAULT_PORT, bind_problem, format_host_port, warn_bridge_loops
from .secrets import add_secret_args, check_exposure, read_secret

if TYPE_CHECKING:
    from .fetch import Transfer

log = logging.getLogger(__name__)


def number_arg(cast: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse type: the value as `cast` makes it, refused (saying it must be `what`) unless `ok`."""
    def parse(value: str) -> Any:
        try:
            x = cast(value)
        except ValueError:
            x = None
        if x is None or not ok(x):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}")
        return x

    return parse


count_or_all = number_arg(int, "0 (no limit) or more", lambda n: n >= 0)  # a size where 0 means no limit
port_arg = number_arg(int, "a TCP port (0-65535; 0: any free one)", lambda p: 0 <= p < 65536)


def add_draft_options(p: argparse.ArgumentParser) -> None:
    """How the MTP head drafts: options that change which drafts are proposed, never the output."""
    p.add_argument("--draft-vocab", type=count_or_all, default=None, metavar="N",
                   help="drafts score only the N most frequent tokens (0: the whole vocabulary; default: half "
                        "of it, at most 32768)")
    p.add_argument("--mtp-window", type=count_or_all, default=None, metavar="N",
                   help=f"each drafting position attends to the N positions before it only (0: the whole context; "
                        f"default {DEFAULT_WINDOW})")


def add_node_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="run a node daemon that serves one shard of a model over gRPC")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for all interfaces, with a secret or --insecure)")
    p.add_argument("--port", type=port_arg, default=DEFAULT_PORT, help="port to listen on (0 = any free port)")
    p.add_argument("--node-id", help="a name for this node (default: hostname plus a random suffix)")
    add_secret_args(p, "the cluster secret every caller must present")
    p.add_argument("--insecure", action="store_true",
                   help="without a secret, listen on a non-loopback address anyway (a network you trust)")
    p.add_argument("--data-plane", choices=("tcp", "grpc"), default="tcp",
                   help="how other nodes send this node frames: a plain TCP stream on a second, free port "
                        "(default), or gRPC Forward streams on --port only")
    p.add_argument("--model-dir", action="append", default=[],
                   help="a local copy of a model, or a directory of models, this node may load and serve to its "
                        "peers; a copy is used only when its fingerprint is the one asked for (repeatable; also "
                        "$MTPIPE_MODEL_DIRS). Besides these, a node reads only the demo model, the Hugging Face "
                        "hub cache and its shard cache")
    p.add_argument("--shard-cache", help="where fetched shards are kept (default: $MTPIPE_SHARD_CACHE, else "
                                         "~/.cache/mtpipe/shards)")
    p.add_argument("--download", action="store_true",
                   help="when no node can send this node its shard, download from the Hugging Face hub only the "
                        "files that hold it (a model the coordinator took from the hub; checked by fingerprint)")
    add_draft_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON line with the address once ready")
    p.set_defaults(func=cmd_node)


def cmd_node(args: argparse.Namespace) -> int:
    import json
    import signal
    import sys

    from . import stage  # noqa: F401  (import MLX and mlx-lm now, not on the first Load)

    secret = read_secret(args.secret_file)
    check_exposure(args.host, secret, args.insecure)
    if (problem := bind_problem(args.host, args.port)) is not None:  # (a usage error, as `serve` says it)
        raise ValueError(f"--host/--port {format_host_port(args.host, args.port)} cannot be used: {problem}")
    warn_bridge_loops()
    cache = os.path.expanduser(args.shard_cache or "")
    if cache and os.path.exists(cache) and not os.path.isdir(cache):  # (else the first fetch fails, much later)
        raise ValueError(f"--shard-cache {args.shard_cache} is a file, not a directory")
    for d in args.model_dir:  # (a typo would silently turn every Load of that model into a fetch)
        if not os.path.isdir(os.path.expanduser(d)):
            log.warning("--model-dir %s is not a directory: no model is read from it", d)
    from .server import NodeServer  # (not for other commands, nor for `mtpipe node --help`)

    server = NodeServer(args.host, args.port, node_id=args.node_id, secret=secret,
                        data_plane=args.data_plane == "tcp", model_dirs=args.model_dir,
                        shard_cache=args.shard_cache, download=args.download, draft_vocab=args.draft_vocab,
                        mtp_window=args.mtp_window).start()

    def on_term(*_: Any) -> None:
        threading.Thread(target=server.stop, daemon=True).start()
        deadline = threading.Timer(5.0, os._exit, args=(0,))  # a stuck shutdown must not keep the node alive
        deadline.daemon = True
        deadline.start()

    signal.signal(signal.SIGTERM, on_term)
    stop_watching = threading.Event()
    if not args.json and sys.stderr.isatty():
        from rich.console import Console

        threading.Thread(target=show_transfers, args=(server.service.weights.transfer, Console(stderr=True),
                                                      stop_watching), daemon=True).start()
    ready = {"node_id": server.service.node_id, "address": server.address, "data_port": server.service.data_port,
             "pid": os.getpid()}
    if args.json:
        print(json.dumps(ready), flush=True)
    else:
        print(f"mtpipe node {ready['node_id']} listening on {ready['address']}", file=sys.stderr, flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
    finally:
        stop_watching.set()
    return 0


class TransferBar:
    """A progress bar while the node fetches its shard from a peer (the log says the same, less often)."""

    def __init__(self, transfer: Transfer, console: Any):
        self.transfer, self.console = transfer, console
        self.bar: Any = None
        self.task = 0

    def tick(self) -> None:
        """Show the transfer as it is now: start a bar when one begins, end it when it ends."""
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        t = self.transfer
        fetching = t.state == "fetching" and t.total > 0
        if fetching and self.bar is None:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                TimeRemainingColumn(), console=self.console, transient=False)
            self.bar.start()
            self.task = self.bar.add_task(f"shard from {t.source}", total=t.total)
        if self.bar is not None:
            self.bar.update(self.task, completed=t.done, total=t.total)
            if not fetching:
                self.bar.update(self.task, description=f"shard from {t.source}: {t.state or 'ended'}")
                self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def show_transfers(transfer: Transfer, console: Any, stop: threading.Event, every: float = 0.25) -> None:
    """A TransferBar brought up to date every `every` seconds until `stop` is set."""
    bar = TransferBar(transfer, console)
    while not stop.wait(every):
        bar.tick()
    bar.close()
