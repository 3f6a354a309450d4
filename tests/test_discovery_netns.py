"""Cluster formation over real multicast between network namespaces.

Topology (all inside namespaces this test creates; nothing touches the machine's own interfaces):
a bridge in its own namespace, four hosts on it over veth pairs (10.77.0.1-4/24), and a direct
"thunderbolt0" veth link between hosts 2 and 3 with IPv6 link-local addresses only. Hosts 1-3 run `mtpipe launch` for
cluster "lab" with different memory offers; host 4 runs a node of cluster "other". Zeroconf is bound
to each host's 10.77.0.x address only.

A fifth host has only its loopback, where the same command falls back to a single node. A sixth runs
a rogue (tests/rogue_node.py) that knows the cluster's name but not its secret.

Checked: the three nodes find each other and elect node-a, which places the model in proportion to
memory and picks the Thunderbolt link (a scoped IPv6 link-local address) for the b -> c hop; the other cluster's node is ignored;
greedy generation through the namespaces is token-identical to single-node; the lone host serves
the whole model locally; RPCs without the secret cannot connect (mutual TLS); the rogue's adverts
(lower ids, the coordinator flag, the most memory) take neither the election nor a place, and what it
recorded of the nodes' connections neither holds the secret nor gets anywhere replayed; `mtpipe health`
finds the nodes by zeroconf and reports them; a node that stops is seen to leave, and the other two take its layers.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from helpers import PROMPTS

from mtpipe.coordinator.cluster.placement import (
    GiB,
    NodeResources,
    model_footprint,
    order_nodes,
    plan_layers,
)
from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.registry import DEMO_MODEL

pytestmark = pytest.mark.netns

PREFIX = "mtpz"  # namespaces are named mtpz<pid>-<role>, so leftovers of a dead run can be told apart
SECRET = "lab-secret-7f3a"
PORT = 52700
API_PORT = 8123
MEMORY_GIB = {1: 2.5, 2: 8.5, 3: 2.5}  # what each node offers; placement must follow it
RESERVE_GIB = 0.5
START_TIMEOUT = 90.0
HEAL_AFTER_S = 20.0  # long enough for the checks of a node that left to see the pipeline it left
MAX_TOKENS = 24


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _kill_namespace(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", name, check=False)


def clean_stale_namespaces(prefix: str = PREFIX) -> None:
    """Namespaces left by a run that crashed (its pid is gone)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            _kill_namespace(name)


class Bridged:
    """A test's namespaces: a bridge, and `hosts` on it, each with `lan0` at `subnet`.i/24 (those in
    `unwired`: only their loopback). Named <prefix><pid>-<role>, so a crashed run's are found."""

    def __init__(self, prefix: str, hosts: tuple[int, ...], subnet: str, unwired: tuple[int, ...] = ()):
        self.tag = f"{prefix}{os.getpid()}"
        self.bridge = f"{self.tag}-br"
        self.hosts = {i: f"{self.tag}-h{i}" for i in hosts}
        self.subnet, self.unwired = subnet, unwired
        self.created: list[str] = []

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def create(self) -> None:
        self._add(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for i, ns in self.hosts.items():
            self._add(ns)
            if i in self.unwired:
                continue
            _ip("-n", ns, "link", "add", "lan0", "type", "veth", "peer", "name", f"p{i}", "netns", self.bridge)
            _ip("-n", self.bridge, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.subnet}.{i}/24", "dev", "lan0")
            _ip("-n", ns, "link", "set", "lan0", "up")

    def destroy(self) -> None:
        for name in reversed(self.created):
            _kill_namespace(name)

    def argv(self, host: int, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host], *cmd]


class Topology(Bridged):
    def __init__(self) -> None:
        super().__init__(PREFIX, (1, 2, 3, 4, 5, 6), "10.77.0", unwired=(5,))  # 5: loopback only; 6: a rogue

    def create(self) -> None:
        super().create()
        # A point-to-point link with only IPv6 link-local addresses, as a Thunderbolt cable gets them.
        h2, h3 = self.hosts[2], self.hosts[3]
        _ip("-n", h2, "link", "add", "thunderbolt0", "type", "veth", "peer", "name", "thunderbolt0", "netns", h3)
        for ns in (h2, h3):
            _ip("-n", ns, "link", "set", "thunderbolt0", "up")

    def link_local(self, host: int, dev: str) -> str:
        info = json.loads(_ip("-n", self.hosts[host], "-j", "addr", "show", dev).stdout)
        return next(a["local"] for a in info[0]["addr_info"] if a["family"] == "inet6")


class Proc:
    """A process in a namespace: JSON lines of stdout become events, stderr is kept for assertions."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.events: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.p.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put(None)

    def _read_stderr(self) -> None:
        for line in self.p.stderr:
            with self.changed:
                self.stderr.append(line)
                self.changed.notify_all()

    def event(self, kind: str, timeout: float = START_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {kind!r} event within {timeout:.0f} s:\n{self.log()}") from None
            if ev is None:
                raise AssertionError(f"exited ({self.p.wait()}) before a {kind!r} event:\n{self.log()}")
            if ev["event"] == kind:
                return ev

    def wait_stderr(self, text: str, timeout: float) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: any(text in line for line in self.stderr), timeout):
                raise AssertionError(f"{text!r} not logged within {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return "".join(self.stderr[-40:])

    def terminate(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        self.terminate()
        try:
            return self.p.wait(15)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


REQUIRE_ENV = "MTPIPE_REQUIRE_NETNS"  # set to 1 (CI does): no namespaces is a failure, not a skip


def namespaces(topo: Any, clean: Callable[[], None]) -> Iterator[Any]:
    """A topology's namespaces for a module's tests (skipped, or failed under REQUIRE_ENV, without them);
    `clean` first removes what an earlier, killed run of that module left."""
    reason = netns_unavailable()
    if reason:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but this test cannot create network namespaces: {reason}", pytrace=False)
        pytest.skip(f"{reason} (set {REQUIRE_ENV}=1 to make this a failure)")
    clean()
    try:
        topo.create()
        yield topo
    finally:
        topo.destroy()


@pytest.fixture(scope="module")
def topology():
    yield from namespaces(Topology(), clean_stale_namespaces)


@pytest.fixture(scope="module")
def model_path(dense_ckpt: Path) -> Path:
    return DEMO_MODEL if (DEMO_MODEL / "config.json").exists() else dense_ckpt


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MTPIPE_SECRET", "MTPIPE_CONFIG", "MTPIPE_STATE_DIR")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def rogue(topology: Topology, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """tests/rogue_node.py on host 6: adverts for cluster "lab" without its secret, advertising before
    the lab's nodes start, so that they see it while they wait for each other."""
    out = tmp_path_factory.mktemp("rogue")
    script = Path(__file__).with_name("rogue_node.py")
    proc = Proc(topology.argv(6, sys.executable, str(script), "advertise", "10.77.0.6", "lab", str(out)), _env())
    try:
        proc.event("advertising")
        yield {"proc": proc, "recorded": out}
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def cluster(topology: Topology, model_path: Path, tmp_path_factory: pytest.TempPathFactory, rogue: dict):
    root = tmp_path_factory.mktemp("cluster")
    config = root / "cluster.yaml"
    config.write_text(
        f"name: lab\nmodel: {model_path}\ndtype: float32\nmtp_depth: 2\nnode:\n  host: '::'\n"
        f"placement:\n  reserve_gib: {RESERVE_GIB}\n  heal_after_s: {HEAL_AFTER_S}\n"
        f"discovery:\n  expect: 3\n  settle: {START_TIMEOUT}\n"
        f"api:\n  host: 127.0.0.1\n  port: {API_PORT}\n"
    )
    procs: dict[int, Proc] = {}
    cli = [sys.executable, "-m", "mtpipe", "-v", "launch", "--json", "--config", str(config)]
    try:
        # The other cluster's node first, advertising before the lab forms, so that the coordinator
        # has seen (and ignored) it by the time it places the model.
        for i, node in ((4, "node-x"), (1, "node-a"), (2, "node-b"), (3, "node-c")):
            state = root / f"state{i}"
            state.mkdir()
            (state / "node_id").write_text(node + "\n")
            extra = ["--cluster", "other", "--expect", "2"] if i == 4 else ["--max-memory", str(MEMORY_GIB[i])]
            argv = topology.argv(i, *cli, "--interface", f"10.77.0.{i}", "--state-dir", str(state), *extra)
            procs[i] = Proc(argv, _env(MTPIPE_SECRET=SECRET))
            if i == 4:
                procs[4].event("node")
        # Alone on its loopback, with the same command: the single-node fallback.
        state = root / "state5"
        state.mkdir()
        argv = topology.argv(5, *cli, "--interface", "127.0.0.1", "--state-dir", str(state), "--settle", "1")
        procs[5] = Proc(argv, _env(MTPIPE_SECRET=SECRET))
        serving = procs[1].event("serving")
        followers = [procs[i].event("follower") for i in (2, 3)]
        yield {"procs": procs, "serving": serving, "followers": followers, "config": config}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.stop()


def run_in(topology: Topology, host: int, argv: list[str], env: dict[str, str], timeout: float = 60.0):
    return subprocess.run(topology.argv(host, *argv), capture_output=True, text=True, env=env, timeout=timeout, check=False)


def mtpipe(topology: Topology, host: int, *args: str, secret: str | None = SECRET) -> tuple[int, dict]:
    env = _env(**({"MTPIPE_SECRET": secret} if secret else {}))
    r = run_in(topology, host, [sys.executable, "-m", "mtpipe", *args], env)
    assert r.stdout.startswith("{"), r.stderr
    return r.returncode, json.loads(r.stdout)


def browse_health(topology: Topology, config: Path, secret: str = SECRET) -> tuple[int, dict]:
    """`mtpipe health` on host 1, finding the nodes by zeroconf. The rogue takes the connections that
    proving membership makes and never answers: each proof there waits out --timeout (3 s, not 5)."""
    return mtpipe(topology, 1, "health", "--json", "--config", str(config), "--interface", "10.77.0.1",
                  "--timeout", "3", secret=secret)


def test_election_placement_and_links(cluster: dict, topology: Topology, model_path: Path) -> None:
    serving = cluster["serving"]
    assert [f["coordinator"] for f in cluster["followers"]] == ["node-a", "node-a"]  # lowest id, no --coordinator
    assert serving["discovered"] == ["node-a", "node-b", "node-c"]
    assert serving["ignored"] == ["mtpipe-node-x._mtpipe._tcp.local."]  # cluster "other"
    # The placement the coordinator computed from the advertised memory (TXT) and links.
    offered = {"node-a": MEMORY_GIB[1], "node-b": MEMORY_GIB[2], "node-c": MEMORY_GIB[3]}
    nodes = [NodeResources(n, int((gib - RESERVE_GIB) * GiB)) for n, gib in offered.items()]
    expected = plan_layers(model_footprint(model_path), order_nodes(nodes, first="node-a"))
    assert [(p["node"], p["layers"]) for p in serving["placement"]] == [(s.node_id, [s.start, s.end]) for s in expected]
    assert [p["layers"][1] - p["layers"][0] for p in serving["placement"]] != [3, 3, 2]  # not an even split
    a_b, b_c = serving["links"]
    assert (a_b["target"], a_b["address"], a_b["link"]) == ("node-b", f"10.77.0.2:{PORT}", "other")
    # b and c share a Thunderbolt link the coordinator is not on: that hop uses c's link-local
    # address there, scoped by b's interface.
    tb_hop = f"[{topology.link_local(3, 'thunderbolt0')}%thunderbolt0]:{PORT}"
    assert (b_c["source"], b_c["target"], b_c["address"], b_c["link"]) == ("node-b", "node-c", tb_hop, "thunderbolt")
    assert a_b["rtt_ms"] > 0 and b_c["rtt_ms"] > 0
    # The last node starts decode rounds on its own link back to the first: not the coordinator's
    # 127.0.0.1 address of node-a (that is node-c itself over there) but a's address on the bridge.
    ring = serving["ring"]
    assert (ring["source"], ring["target"], ring["address"]) == ("node-c", "node-a", f"10.77.0.1:{PORT}")
    # And the engine was built on that link: its sequences go round in ring groups (rows of batches).
    assert serving["batching"] == "ring", cluster["procs"][1].log()
    # The API's process was started as the coordinator placed the model, and is the one that serves
    # (its line may come just after the event the test waited for).
    cluster["procs"][1].wait_stderr("the API serves at", timeout=30)
    lines = cluster["procs"][1].stderr
    started = [(i, m.group(1)) for i, ln in enumerate(lines) if (m := re.search(r"API process (\d+) started", ln))]
    serves = [m.group(1) for ln in lines if (m := re.search(r"the API serves at \S+ from process (\d+)", ln))]
    placed = [i for i, ln in enumerate(lines) if "placement:" in ln]
    assert len(started) == 1 and placed and started[0][0] < placed[0], "".join(lines)
    assert serves == [started[0][1]], "".join(lines)


CLIENT = """
import json, sys, urllib.request
out = []
for prompt, depth in json.loads(sys.argv[1]):
    body = {"prompt": prompt, "max_tokens": %d, "temperature": 0, "mtp_depth": depth}
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req, timeout=60))
    out.append({"text": r["choices"][0]["text"], "tokens": r["usage"]["completion_tokens"], "mtp": r["usage"].get("mtp")})
print(json.dumps(out))
""" % (MAX_TOKENS, API_PORT)


@pytest.fixture(scope="module")
def single_node(model_path: Path):
    return local_engine(model_path, dtype=mx.float32)


def check_generation(topology: Topology, host: int, single_node, proc: Proc, prompts: int = 3) -> None:
    """Greedy completions through the API on `host` equal the in-process single-node engine's."""
    cases = [(p, d) for p in PROMPTS[:prompts] for d in (0, 2)]
    r = run_in(topology, host, [sys.executable, "-c", CLIENT, json.dumps(cases)], _env())
    assert r.returncode == 0, r.stderr + proc.log()
    for (prompt, depth), got in zip(cases, json.loads(r.stdout)):
        prompt_tokens = single_node.tokenizer.encode(prompt)
        ref = single_node.complete(GenerationRequest(prompt_tokens, max_tokens=MAX_TOKENS, mtp_depth=depth))
        assert (got["text"], got["tokens"]) == (ref.text, len(ref.tokens)), f"diverged on {prompt!r} at depth {depth}"
        if depth:
            assert got["mtp"]["drafted"] > 0


def test_generation_matches_single_node(cluster: dict, topology: Topology, single_node) -> None:
    check_generation(topology, 1, single_node, cluster["procs"][1])


def test_health_with_a_wrong_secret_finds_no_member(cluster: dict, topology: Topology) -> None:
    rc, report = browse_health(topology, cluster["config"], secret="wrong")
    assert rc == 2 and report["status"] == "unreachable" and report["nodes"] == []
    assert {"node-a", "node-b", "node-c"} <= set(report["left_out"])


def test_rpcs_without_the_secret_are_refused(cluster: dict, topology: Topology) -> None:
    for secret in (None, "wrong"):
        rc, report = mtpipe(topology, 1, "health", "--json", f"10.77.0.2:{PORT}", "10.77.0.3", secret=secret)
        assert rc == 2 and report["status"] == "unreachable"
        problems = [n["problems"] for n in report["nodes"]]
        assert len(problems) == 2 and all(len(p) == 1 and p[0].startswith("UNAVAILABLE") for p in problems)
        if secret:  # mutual TLS keyed by another secret: the handshake fails, and health says why
            assert all("not this cluster's secret" in p[0] for p in problems)


def test_health_by_zeroconf(cluster: dict, topology: Topology) -> None:
    r = run_in(topology, 1, [sys.executable, "-c", CLIENT, json.dumps([[PROMPTS[0], 2]])], _env())
    assert r.returncode == 0, r.stderr
    rc, report = browse_health(topology, cluster["config"])
    # Every member is healthy; the rogue's adverts (tests/rogue_node.py) are left out and make the
    # cluster "degraded": something advertises it that did not prove it belongs.
    assert rc == 1 and report["status"] == "degraded", report
    assert all(n["status"] == "healthy" for n in report["nodes"])
    assert sorted(report["left_out"]) == ["node-0", "node-1"]
    assert all(why.startswith("did not prove it belongs (10.77.0.6") for why in report["left_out"].values())
    by_id = {n["node_id"]: n for n in report["nodes"]}
    assert sorted(by_id) == ["node-a", "node-b", "node-c"]  # node-x is in another cluster
    placement = {p["node"]: p["layers"] for p in cluster["serving"]["placement"]}
    for node_id, n in by_id.items():
        assert n["layers"] == placement[node_id] and n["version"] and n["uptime_s"] > 0
        assert n["tokens_processed"] > 0 and n["mean_step_ms"] > 0 and n["active_sequences"] == 0
        assert n["memory_available"] > 0 and n["last_error"] is None
    assert by_id["node-b"]["next"] == cluster["serving"]["links"][1]["address"] and by_id["node-b"]["next_rtt_ms"] > 0
    assert by_id["node-c"]["next"] is None  # the last stage, which starts decode rounds on its ring link
    assert by_id["node-c"]["ring"] == cluster["serving"]["ring"]["address"]
    # Frames went node to node on the data plane, the Thunderbolt hop's scoped IPv6 address included.
    assert by_id["node-a"]["next_transport"] == by_id["node-b"]["next_transport"] == "tcp"
    assert all(n["data_port"] for n in by_id.values())
    # A reachable node holding no shard (the other cluster's, still waiting for peers) is idle; beside
    # nodes that serve, it is a gap in the pipeline where a coordinator waits for it (none does: the
    # other cluster's has not placed anything; a spare), or where their coordinator placed the model on
    # it, and not where it placed the model without it.
    rc, report = mtpipe(topology, 1, "health", "--json", f"10.77.0.4:{PORT}")
    assert rc == 0 and report["status"] == "idle" and report["nodes"][0]["problems"] == []
    assert report["nodes"][0]["coordinators"] == 0
    rc, report = mtpipe(topology, 1, "health", "--json", f"10.77.0.4:{PORT}", f"10.77.0.2:{PORT}")
    assert rc == 0 and report["status"] == "healthy" and report["nodes"][0]["status"] == "idle"
    rc, report = mtpipe(topology, 1, "health", "--json", f"10.77.0.4:{PORT}", f"10.77.0.1:{PORT}")
    assert rc == 0 and report["status"] == "healthy" and report["nodes"][0]["status"] == "idle"


def test_a_node_that_stops_is_seen_leaving(cluster: dict, topology: Topology) -> None:
    """(Before the tests that need no node-c: the others take its layers meanwhile, and the last test
    checks that they did.)"""
    node_c = cluster["procs"][3]
    cluster["stopped"] = time.monotonic()
    node_c.p.send_signal(signal.SIGINT)  # (Ctrl-C stops a follower as SIGTERM does, and as a coordinator: 0)
    rc = node_c.p.wait(15)
    assert rc == 0, f"node-c exited with {rc}:\n{node_c.log()}"
    cluster["procs"][1].wait_stderr("node node-c of the pipeline left", timeout=30)
    rc, report = mtpipe(topology, 1, "health", "--json", f"10.77.0.1:{PORT}", f"10.77.0.2:{PORT}", f"10.77.0.3:{PORT}")
    assert rc == 2 and [n["status"] for n in report["nodes"]] == ["healthy", "degraded", "unreachable"], report
    assert f"next stage {cluster['serving']['links'][1]['address']} unreachable" in report["nodes"][1]["problems"]
    # Found by zeroconf, node-c's advert is gone with it: the coordinator's Health names it as placed.
    rc, report = browse_health(topology, cluster["config"])
    by_id = {n["node_id"]: n for n in report["nodes"]}
    assert rc == 2 and by_id["node-c"]["status"] == "unreachable", report
    assert by_id["node-a"]["placed"] == ["node-a", "node-b", "node-c"]
    # Listed in cluster.yaml as well, node-c is that address's row, named by the coordinator, once.
    static = cluster["config"].with_name("static.yaml")
    static.write_text(cluster["config"].read_text() + f"nodes: ['10.77.0.3:{PORT}']\n")
    rc, report = mtpipe(topology, 1, "health", "--json", "--config", str(static), "--interface", "10.77.0.1",
                        "--timeout", "2")
    rows = [n for n in report["nodes"] if n.get("node_id") == "node-c"]
    assert rc == 2 and [n["address"] for n in rows] == [f"10.77.0.3:{PORT}"], report
    assert time.monotonic() - cluster["stopped"] < HEAL_AFTER_S, "the checks took longer than the heal delay"


def test_single_node_fallback(cluster: dict, topology: Topology, single_node) -> None:
    solo = cluster["procs"][5]
    serving = solo.event("serving")
    assert [p["layers"] for p in serving["placement"]] == [[0, single_node.pipeline.stages[0].spec.end]]
    assert serving["links"] == [] and serving["discovered"] == [serving["placement"][0]["node"]]
    check_generation(topology, 5, single_node, solo)
    rc, report = mtpipe(topology, 5, "health", "--json", "--config", str(cluster["config"]), "--interface", "127.0.0.1")
    assert rc == 0 and [n["address"] for n in report["nodes"]] == [f"127.0.0.1:{PORT}"]
    assert report["nodes"][0]["tokens_processed"] > 0  # the local engine's stage, reported by the node server


def test_a_rogue_wins_nothing(cluster: dict, rogue: dict, topology: Topology) -> None:
    from mtpipe.node.tls import identity

    # Neither its adverts' flag nor their ids took the election, and no layer went to it.
    assert [f["coordinator"] for f in cluster["followers"]] == ["node-a", "node-a"]
    assert {p["node"] for p in cluster["serving"]["placement"]} == {"node-a", "node-b", "node-c"}
    assert cluster["serving"]["left_out"] == {"node-0": "did not prove it belongs", "node-1": "did not prove it belongs"}
    for node_id in ("node-0", "node-1"):  # each left out with one log line naming it and where it is
        lines = [ln for ln in cluster["procs"][1].stderr if f"node {node_id} (advertised from 10.77.0.6) did not prove"
                 in ln]
        assert len(lines) == 1, cluster["procs"][1].log()
    # The nodes did try it, and nothing they sent holds the secret or the key and certificate it makes.
    recorded = sorted(rogue["recorded"].iterdir())
    assert recorded and all(f.stat().st_size for f in recorded)
    everything = b"".join(f.read_bytes() for f in recorded)
    key, cert = identity(SECRET)
    der = ssl.PEM_cert_to_DER_cert(cert.decode())
    for secret_thing in (SECRET.encode(), key, cert, der, key.split(b"\n")[1]):
        assert secret_thing not in everything
    # Replayed to a real node, the recordings authenticate nothing: no reply carries application data.
    script = Path(__file__).with_name("rogue_node.py")
    argv = [sys.executable, str(script), "replay", "10.77.0.2", str(PORT), *map(str, recorded[:4])]
    r = run_in(topology, 6, argv, _env())
    assert r.returncode == 0, r.stderr
    for reply in map(bytes.fromhex, json.loads(r.stdout)):
        assert b"node-b" not in reply and b"node_id" not in reply


def test_the_others_take_the_layers_of_the_node_that_left(cluster: dict, topology: Topology, single_node) -> None:
    """node-a and node-b take node-c's layers between them, and serve as before."""
    assert "stopped" in cluster, "test_a_node_that_stops_is_seen_leaving runs first"
    cluster["procs"][1].wait_stderr("the pipeline now runs over", timeout=HEAL_AFTER_S + 60)
    rc, report = mtpipe(topology, 1, "health", "--json", f"10.77.0.1:{PORT}", f"10.77.0.2:{PORT}")
    a, b = report["nodes"]
    assert rc == 0 and [a["status"], b["status"]] == ["healthy", "healthy"], [(a["status"], a["problems"]),
                                                                             (b["status"], b["problems"])]
    assert a["placed"] == ["node-a", "node-b"] and a["layers"][0] == 0 and a["layers"][1] == b["layers"][0]
    assert b["layers"][1] == single_node.pipeline.stages[0].spec.end, report
    # GET /v1/cluster says the same.
    url = f"http://127.0.0.1:{API_PORT}/v1/cluster"
    get = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
    r = run_in(topology, 1, [sys.executable, "-c", get], _env())
    info = json.loads(r.stdout)
    assert [(p["node"], p["layers"]) for p in info["placement"]] == [("node-a", a["layers"]), ("node-b", b["layers"])]
    assert info["spares"] == [] and "node-c" not in info["discovered"]  # (gone: no spare)
    assert [(h["source"], h["target"]) for h in info["links"]] == [("node-a", "node-b")], info["links"]
    assert (info["ring"]["source"], info["ring"]["target"]) == ("node-b", "node-a"), info["ring"]
    check_generation(topology, 1, single_node, cluster["procs"][1], prompts=1)


def test_with_the_coordinator_gone_the_node_left_coordinates(cluster: dict, topology: Topology, single_node) -> None:
    """(Last: it stops the coordinator.) node-b, a follower, says its coordinator left; left with its shard,
    it answers (its ring back to node-a broken); found by zeroconf, `mtpipe health` lists the layers no
    node holds any more, and the cluster as unreachable, not as a node that serves. Once the coordinator
    has been gone for heal_after_s, the node left is elected, places the model over itself and serves."""
    assert "stopped" in cluster, "test_a_node_that_stops_is_seen_leaving runs first"
    node_a = cluster["procs"][1]
    assert node_a.stop() == 0, node_a.log()
    left = cluster["procs"][2].event("coordinator_left", timeout=30)  # (node-b, a follower, says so)
    assert (left["node_id"], left["coordinator"]) == ("node-b", "node-a")
    deadline = time.monotonic() + 30
    while True:
        rc, report = browse_health(topology, cluster["config"])
        if "node-a" not in {n.get("node_id") for n in report["nodes"]} or time.monotonic() > deadline:
            break
        time.sleep(1)
    by_id = {n["node_id"]: n for n in report["nodes"]}
    assert by_id["node-b"]["reachable"] and by_id["node-b"]["layers"][0] > 0, report
    assert rc == 2 and report["status"] == "unreachable", report
    assert by_id["-"]["layers"] == [0, by_id["node-b"]["layers"][0]] and by_id["-"]["status"] == "unreachable"
    node_b = cluster["procs"][2]
    elected = node_b.event("coordinating", timeout=HEAL_AFTER_S + 30)
    assert (elected["node_id"], elected["coordinator"]) == ("node-b", "node-b")
    serving = node_b.event("serving", timeout=START_TIMEOUT)
    assert [(p["node"], p["layers"]) for p in serving["placement"]] == [
        ("node-b", [0, single_node.pipeline.stages[0].spec.end])]
    check_generation(topology, 2, single_node, node_b, prompts=1)
