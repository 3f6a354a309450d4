"""`mtpipe cache`: what this machine's shard cache holds, and pruning it."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def add_cache_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="list or prune this machine's shard cache (the shards nodes fetched)")
    p.add_argument("action", choices=("list", "prune"), help="list the entries, or remove some")
    p.add_argument("--shard-cache", help="the cache's root (default: $MTPIPE_SHARD_CACHE, else ~/.cache/mtpipe/shards)")
    p.add_argument("--model", metavar="FINGERPRINT", help="prune: only this model's entries (a fingerprint prefix)")
    p.add_argument("--max-gib", type=float, help="prune: least recently used first, down to this many GiB")
    p.add_argument("--all", action="store_true", help="prune: every entry")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_cache)


def cmd_cache(args: argparse.Namespace) -> int:
    from .cache_admin import entries, prune
    from .shards import cache_root

    root = cache_root(args.shard_cache)
    if not root.is_dir():  # (a typo in --shard-cache would otherwise read as an empty cache)
        print(f"mtpipe cache: note: {root} does not exist{' (or is not a directory)' if root.exists() else ''}: "
              "no node has cached a shard there", file=sys.stderr)
    if args.action == "prune":
        chosen = [x for x in (args.model, args.max_gib, args.all or None) if x is not None]
        if len(chosen) != 1:
            print("mtpipe cache prune: give exactly one of --model, --max-gib, --all", file=sys.stderr)
            return 2
        if args.max_gib is not None and not 0 <= args.max_gib < math.inf:
            print("mtpipe cache prune: --max-gib must be a number of GiB, 0 or more", file=sys.stderr)
            return 2
        max_bytes = int(args.max_gib * 2**30) if args.max_gib is not None else None
        listed, busy = prune(root, max_bytes=max_bytes, fingerprint=args.model)
        verb = "removed"
    else:
        listed, busy, verb = entries(root), [], "holds"
    total = sum(e.bytes for e in listed)
    if args.json:
        out = {"root": str(root), verb: [e.to_dict() for e in listed], "bytes": total}
        if args.action == "prune":
            out["in_use"] = [e.to_dict() for e in busy]
        print(json.dumps(out))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"shard cache {root}: {verb} {_entries(len(listed))}, {total / 2**30:.2f} GiB")
    for col in ("model", "layers", "GiB", "last used", "state"):
        table.add_column(col)
    for e in listed:
        table.add_row(e.fingerprint[:12], _layers(e.layers), f"{e.bytes / 2**30:.2f}",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)),
                      "complete" if e.complete else "partial")
    Console().print(table)
    if busy:
        Console(stderr=True).print(f"kept {_entries(len(busy))} a node is fetching or loading: "
                                   + ", ".join(f"{e.fingerprint[:12]} ({_layers(e.layers)})" for e in busy))
    return 0


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _layers(name: str) -> str:
    """An entry's directory name (<start>-<end>-<mtp 0|1>, end exclusive) as the layers it holds."""
    try:
        start, end, mtp = (int(p) for p in name.split("-"))
    except ValueError:
        return name
    return (f"{start}" if end == start + 1 else f"{start}-{end - 1}") + (" + MTP" if mtp else "")
