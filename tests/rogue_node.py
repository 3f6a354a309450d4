"""A rogue on a cluster's network, run by tests/test_discovery_netns.py inside a network namespace.

It knows the cluster's name, not its secret, and advertises two nodes with the cluster's hash, lower
ids than any real node, the coordinator flag and more memory than anyone:
  node-0  accepts every connection and records every byte it is sent (one file per connection in
          OUT_DIR), and answers nothing;
  node-1  a real mtpipe node server keyed by a wrong secret.
Prints {"event": "advertising"} once both adverts are out, then runs until killed. Its second use:
replay recorded bytes to a real node and print what came back (hex, one per recording, as JSON).

usage: python rogue_node.py advertise ADDRESS CLUSTER OUT_DIR
       python rogue_node.py replay HOST PORT RECORDING...
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RECORDER_PORT = 52700
WRONG_SECRET_PORT = 52701
MEMORY = 512 << 30


def record(conn: socket.socket, file: Path) -> None:
    with conn, open(file, "ab") as f:
        try:
            while chunk := conn.recv(65536):
                f.write(chunk)
                f.flush()
        except OSError:
            pass


def recorder(address: str, out: Path) -> None:
    server = socket.create_server((address, RECORDER_PORT))
    n = 0
    while True:
        conn, _ = server.accept()
        n += 1
        threading.Thread(target=record, args=(conn, out / f"conn{n:03d}"), daemon=True).start()


async def advertise(address: str, cluster: str) -> None:
    from mtpipe import __version__
    from mtpipe.node.advertise import Advertiser, NodeAdvert, cluster_hash, open_zeroconf

    azc = open_zeroconf([address])
    for node_id, port in (("node-0", RECORDER_PORT), ("node-1", WRONG_SECRET_PORT)):
        ad = NodeAdvert(node_id, cluster_hash(cluster), port, MEMORY, MEMORY, "rogue", __version__, coordinator=True)
        await Advertiser(azc, ad, [address]).start()
    print(json.dumps({"event": "advertising"}), flush=True)
    await asyncio.Event().wait()


def replay(host: str, port: int, blob: bytes, timeout: float = 2.0) -> bytes:
    """Send `blob` as it is on a new connection to host:port; everything that comes back until it closes."""
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(blob)
        s.settimeout(timeout)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except OSError:
            pass
    return reply


def replay_all(replays: list[tuple[str, int, bytes]]) -> list[bytes]:
    """`replay` of each (host, port, blob), all at once (each waits out its timeout), in order."""
    with ThreadPoolExecutor(max(len(replays), 1)) as pool:
        return list(pool.map(lambda r: replay(*r), replays))


def main() -> None:
    if sys.argv[1] == "replay":  # (the standard library only: no mtpipe import to wait for)
        host, port = sys.argv[2], int(sys.argv[3])
        print(json.dumps([r.hex() for r in replay_all([(host, port, Path(f).read_bytes()) for f in sys.argv[4:]])]))
        return
    from mtpipe.node.server import NodeServer

    address, cluster, out = sys.argv[2], sys.argv[3], Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=recorder, args=(address, out), daemon=True).start()
    NodeServer(address, WRONG_SECRET_PORT, node_id="node-1", secret="not-the-lab-secret").start()
    asyncio.run(advertise(address, cluster))


if __name__ == "__main__":
    main()
