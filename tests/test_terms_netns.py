"""A coordinator that sleeps through an election (a laptop's lid closed, then opened) steps down.

Topology (namespaces this test creates; nothing touches the machine's own interfaces): a bridge in its own
namespace and three hosts on it over veth pairs (10.79.0.1-3/24), each running `mtpipe launch` for cluster
"terms" with zeroconf bound to its 10.79.0.x address. Node-a coordinates (term 1) over the three. Its lid
closes: every process of host 1 is stopped (SIGSTOP) and its link leaves the bridge, as a sleeping Mac's
does (a process stopped on a machine that is up still takes connections: its followers wait for it).
After `placement.heal_after_s`, node-b is elected (term 2) and places the model over node-b and node-c.
The lid opens (the link back, SIGCONT).

Checked: node-a finds a newer term among its members and steps down within seconds (it does not form
again over the nodes node-b holds), frees its own shard and follows node-b; its API port answers 503
naming node-b; node-b's API serves the same greedy text as node-a did; `mtpipe health` finds one
coordinator, the nodes with node-b's placement and nothing loaded again. Then a partition: node-b's link
leaves the bridge while it runs; node-a is elected (term 3) over node-a and node-c, node-b heals over
itself and serves too; once its link is back, node-b steps down the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_discovery_netns import Bridged, Proc, _env, _ip, clean_stale_namespaces, namespaces

from mtpipe.models.registry import DEMO_MODEL

pytestmark = pytest.mark.netns

PREFIX = "mtpt"  # namespaces mtpt<pid>-<role>
SECRET = "terms-secret-5d1e"
PORT = 52700
API_PORT = 8125
HEAL_AFTER_S = 4.0
START_TIMEOUT = 90.0
STEP_DOWN_S = 20.0  # at most from meeting again to the old coordinator stepping down (a check is 2 s)


class Topology(Bridged):
    def __init__(self) -> None:
        super().__init__(PREFIX, (1, 2, 3), "10.79.0")
        self.closed: set[int] = set()

    def destroy(self) -> None:
        for host in list(self.closed):
            self.open_lid(host)
        super().destroy()

    def _signal(self, host: int, sig: int) -> None:
        for pid in _ip("netns", "pids", self.hosts[host], check=False).stdout.split():
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass

    def cut(self, host: int) -> None:
        """The host's link leaves the bridge (a partition): its processes run on."""
        self.closed.add(host)
        _ip("-n", self.bridge, "link", "set", f"p{host}", "nomaster")

    def join(self, host: int) -> None:
        _ip("-n", self.bridge, "link", "set", f"p{host}", "master", "br0")
        self.closed.discard(host)

    def close_lid(self, host: int) -> None:
        """The host sleeps: its processes stop and its link leaves the bridge."""
        self._signal(host, signal.SIGSTOP)
        self.cut(host)

    def open_lid(self, host: int) -> None:
        self.join(host)
        self._signal(host, signal.SIGCONT)


@pytest.fixture(scope="module")
def topology():
    yield from namespaces(Topology(), lambda: clean_stale_namespaces(PREFIX))


ASK = """
import json, sys, urllib.error, urllib.request
body = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
req = urllib.request.Request("http://127.0.0.1:%d/v1/completions", data=json.dumps(body).encode(),
                             headers={"content-type": "application/json"})
try:
    r = urllib.request.urlopen(req, timeout=60)
    print(json.dumps({"status": r.status, "body": json.load(r)}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": json.loads(e.read() or b"null")}))
""" % API_PORT


def run_in(topology: Topology, host: int, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(topology.argv(host, *argv), capture_output=True, text=True, env=_env(MTPIPE_SECRET=SECRET),
                          timeout=120, check=False)


def ask(topology: Topology, host: int) -> dict:
    """A greedy completion through the API on `host`: its status and body."""
    r = run_in(topology, host, [sys.executable, "-c", ASK])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def loads(proc: Proc) -> int:
    return sum("loaded shard" in line for line in proc.stderr)


def settled(topology: Topology, coordinator: str, placement: list[dict]) -> None:
    """`mtpipe health` over the three nodes: one coordinator, its placement, the third node idle."""
    r = run_in(topology, 2, [sys.executable, "-m", "mtpipe", "health", "--json",
                             *(f"10.79.0.{i}:{PORT}" for i in (1, 2, 3))])
    report = json.loads(r.stdout)
    by_id = {n["node_id"]: n for n in report["nodes"]}
    assert r.returncode == 0 and report["status"] == "healthy", report
    assert [n for n, row in by_id.items() if row.get("placed")] == [coordinator], report
    assert by_id[coordinator]["placed"] == [p["node"] for p in placement]
    assert [by_id[p["node"]]["layers"] for p in placement] == [p["layers"] for p in placement]
    idle = set(by_id) - {p["node"] for p in placement}
    assert len(idle) == 1 and by_id[idle.pop()]["layers"] is None, report


def stepped_down(topology: Topology, host: int, proc: Proc, since: float, successor: str, term: int) -> None:
    """The coordinator on `host` steps down within STEP_DOWN_S of `since`, follows `successor`, and its API
    port names it."""
    event = proc.event("stepped_down", STEP_DOWN_S)
    assert (event["coordinator"], event["term"]) == (successor, term), proc.log()
    assert proc.event("follower", 5)["coordinator"] == successor
    assert time.monotonic() - since < STEP_DOWN_S
    old = ask(topology, host)
    assert old["status"] == 503 and old["body"]["error"]["code"] == "stepped_down", old
    assert f"coordinator {successor} of a newer term ({term})" in old["body"]["error"]["message"]


@pytest.fixture(scope="module")
def cluster(topology: Topology, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("terms")
    config = root / "cluster.yaml"
    config.write_text(
        f"name: terms\nmodel: {DEMO_MODEL}\ndtype: float32\nmtp_depth: 2\nnode:\n  host: '::'\n"
        f"placement:\n  reserve_gib: 0.5\n  heal_after_s: {HEAL_AFTER_S}\n"
        f"discovery:\n  expect: 3\n  settle: {START_TIMEOUT}\napi:\n  host: 127.0.0.1\n  port: {API_PORT}\n")
    cli = [sys.executable, "-m", "mtpipe", "-v", "launch", "--json", "--config", str(config)]
    procs: dict[int, Proc] = {}
    try:
        for i, node in ((1, "node-a"), (2, "node-b"), (3, "node-c")):
            state = root / f"state{i}"
            state.mkdir()
            (state / "node_id").write_text(node + "\n")
            procs[i] = Proc(topology.argv(i, *cli, "--interface", f"10.79.0.{i}", "--state-dir", str(state),
                                          "--max-memory", "2.5"), _env(MTPIPE_SECRET=SECRET))
        yield {"procs": procs}
    finally:
        for host in list(topology.closed):
            topology.open_lid(host)
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.stop()


def test_a_coordinator_that_slept_through_an_election_steps_down(cluster: dict, topology: Topology) -> None:
    """node-a coordinates; its lid closes; node-b is elected over node-b and node-c; the lid opens."""
    a, b, c = (cluster["procs"][i] for i in (1, 2, 3))
    first = a.event("serving")
    assert [p["node"] for p in first["placement"]] == ["node-a", "node-b", "node-c"]
    before = ask(topology, 1)
    assert before["status"] == 200, a.log()
    cluster["text"] = before["body"]["choices"][0]["text"]

    topology.close_lid(1)
    assert b.event("coordinating", HEAL_AFTER_S + 30)["coordinator"] == "node-b"
    second = b.event("serving")
    assert [p["node"] for p in second["placement"]] == ["node-b", "node-c"]
    assert c.event("follower")["coordinator"] == "node-a"  # (at launch)
    assert c.event("follower")["coordinator"] == "node-b"  # (elected)
    loaded = (loads(b), loads(c))  # (each node: its shard of a's placement, then of b's)

    topology.open_lid(1)
    stepped_down(topology, 1, a, time.monotonic(), "node-b", 2)
    now = ask(topology, 2)  # (the newer coordinator serves as the old one did)
    assert now["status"] == 200 and now["body"]["choices"][0]["text"] == cluster["text"], now
    settled(topology, "node-b", second["placement"])  # (node-a's shard freed, the others' kept)
    assert (loads(b), loads(c)) == loaded, b.log() + c.log()
    assert (first["term"], second["term"]) == (1, 2)


def test_a_coordinator_cut_off_that_healed_over_itself_steps_down(cluster: dict, topology: Topology) -> None:
    """(After the lid.) node-b's link leaves the bridge while it runs: node-a and node-c elect node-a (term 3),
    and node-b, alone, takes node-c's layers and serves by itself (two coordinators serving). Once its link
    is back, node-b finds the newer term and steps down."""
    a, b = cluster["procs"][1], cluster["procs"][2]
    assert "text" in cluster, "test_a_coordinator_that_slept_through_an_election_steps_down runs first"
    topology.cut(2)
    assert a.event("coordinating", HEAL_AFTER_S + 30)["coordinator"] == "node-a"
    third = a.event("serving")
    assert third["term"] == 3 and [p["node"] for p in third["placement"]] == ["node-a", "node-c"]
    b.wait_stderr("the pipeline now runs over", HEAL_AFTER_S + 30)
    assert ask(topology, 2)["status"] == 200  # (cut off, it serves on: split, both serve)

    topology.join(2)
    stepped_down(topology, 2, b, time.monotonic(), "node-a", 3)
    now = ask(topology, 1)
    assert now["status"] == 200 and now["body"]["choices"][0]["text"] == cluster["text"], now
    settled(topology, "node-a", third["placement"])
