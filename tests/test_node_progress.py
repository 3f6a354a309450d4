"""`mtpipe node` shows a progress bar on a terminal while it fetches its shard."""

from __future__ import annotations

import io

from rich.console import Console

from mtpipe.node.cli import TransferBar
from mtpipe.node.fetch import Transfer


def test_a_bar_follows_the_transfer() -> None:
    out = io.StringIO()
    transfer = Transfer()
    bar = TransferBar(transfer, Console(file=out, force_terminal=True, width=120))
    bar.tick()
    assert out.getvalue() == "" and bar.bar is None  # nothing to show while nothing is fetched
    transfer.state, transfer.total, transfer.source = "fetching", 64 << 20, "10.0.0.1:52700"
    bar.tick()
    assert bar.bar is not None
    for _ in range(4):
        transfer.advance(16 << 20)
        bar.tick()
    transfer.state = "done"
    bar.tick()
    assert bar.bar is None  # the transfer ended, and so did its bar
    text = out.getvalue()
    assert "shard from 10.0.0.1:52700" in text and "67.1/67.1 MB" in text and "done" in text
