"""`mtpipe node` shows a progress bar on a terminal while it fetches its shard."""

from __future__ import annotations

import io
import threading
import time

from rich.console import Console

from mtpipe.node.cli import show_transfers
from mtpipe.node.fetch import Transfer


def test_a_bar_follows_the_transfer() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    transfer = Transfer()
    stop = threading.Event()
    watcher = threading.Thread(target=show_transfers, args=(transfer, console, stop, 0.01))
    watcher.start()
    try:
        time.sleep(0.05)
        assert out.getvalue() == ""  # nothing to show while nothing is fetched
        transfer.state, transfer.total, transfer.source = "fetching", 64 << 20, "10.0.0.1:52700"
        for _ in range(4):
            transfer.advance(16 << 20)
            time.sleep(0.05)
        transfer.state = "done"
        time.sleep(0.1)
    finally:
        stop.set()
        watcher.join(5)
    text = out.getvalue()
    assert "shard from 10.0.0.1:52700" in text and "67.1/67.1 MB" in text and "done" in text
