"""Weights reach every node (issue 14) between network namespaces: the model only on the coordinator.

Topology (namespaces this test creates; nothing touches the machine's own interfaces): a bridge in
its own namespace and three hosts on it over veth pairs (10.78.0.1-3/24), each running
`mtpipe launch` for cluster "wlab" with zeroconf bound to its 10.78.0.x address. The model is a copy
in a temporary directory; hosts 2 and 3 run in a mount namespace where that directory is an empty
tmpfs, so they have no model (not even at the coordinator's path) and each has its own shard cache
($MTPIPE_SHARD_CACHE).

Checked: the cluster forms, nodes b and c fetch exactly their shards' bytes from node a (health:
source, transfer done/total, fetched and served counters), and greedy generation is token-identical
to single node. Launched again on the same caches, no node fetches anything (0 bytes fetched and
served) and generation is still identical.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import PROMPTS
from test_discovery_netns import (
    CLIENT,
    Bridged,
    Proc,
    _env,
    clean_stale_namespaces,
    namespaces,
)

from mtpipe.coordinator.engine.build import local_engine
from mtpipe.coordinator.engine.request import GenerationRequest
from mtpipe.models.fingerprint import checkpoint_index, model_fingerprint, shard_names
from mtpipe.models.registry import DEMO_MODEL

pytestmark = pytest.mark.netns

PREFIX = "mtpw"  # namespaces mtpw<pid>-<role>
SECRET = "weights-secret-91c2"
PORT = 52700
MEMORY_GIB = 2.5
START_TIMEOUT = 120.0
MAX_TOKENS = 24
HIDE = 'mount -t tmpfs tmpfs "$0" && exec "$@"'  # run "$@" with the directory $0 empty


class Topology(Bridged):
    def __init__(self) -> None:
        super().__init__(PREFIX, (1, 2, 3), "10.78.0")
        self.hidden: dict[int, Path] = {}  # host -> a directory it sees empty

    def argv(self, host: int, *cmd: str) -> list[str]:
        hide = ["sh", "-c", HIDE, str(self.hidden[host])] if host in self.hidden else []
        return ["ip", "netns", "exec", self.hosts[host], *hide, *cmd]


@pytest.fixture(scope="module")
def topology():
    yield from namespaces(Topology(), lambda: clean_stale_namespaces(PREFIX))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, dense_ckpt: Path) -> Path:
    root = tmp_path_factory.mktemp("weights-netns")
    source = DEMO_MODEL if (DEMO_MODEL / "config.json").exists() else dense_ckpt
    shutil.copytree(source, root / "model")
    (root / "cluster.yaml").write_text(
        f"name: wlab\nmodel: {root / 'model'}\ndtype: float32\nmtp_depth: 2\nnode:\n  host: '::'\n"
        f"placement:\n  reserve_gib: 0.5\ndiscovery:\n  expect: 3\n  settle: {START_TIMEOUT}\n"
        f"api:\n  host: 127.0.0.1\n  port: 8123\n"
    )
    return root


@pytest.fixture(scope="module")
def single_node(root: Path):
    return local_engine(root / "model", dtype=mx.float32)


def launch(topology: Topology, root: Path, config: str = "cluster.yaml") -> dict:
    """`mtpipe launch` on the three hosts (b and c without the model); the coordinator's serving event,
    `mtpipe health` of the three nodes, and the API's completions, all taken before the nodes stop.
    With discovery disabled in `config`, the nodes it lists elect their coordinator by asking each other."""
    for i in (2, 3):
        topology.hidden[i] = root / "model"
    cli = [sys.executable, "-m", "mtpipe", "-v", "launch", "--json", "--config", str(root / config)]
    procs: dict[int, Proc] = {}
    try:
        for i, node in ((1, "node-a"), (2, "node-b"), (3, "node-c")):
            state = root / f"state{i}"
            state.mkdir(exist_ok=True)
            (state / "node_id").write_text(node + "\n")
            argv = topology.argv(i, *cli, "--interface", f"10.78.0.{i}", "--state-dir", str(state),
                                 "--max-memory", str(MEMORY_GIB))
            procs[i] = Proc(argv, _env(MTPIPE_SECRET=SECRET, MTPIPE_SHARD_CACHE=str(root / f"cache{i}")))
        serving = procs[1].event("serving", START_TIMEOUT * 2)
        for i in (2, 3):
            procs[i].event("follower")
        health = run_in(topology, 1, [sys.executable, "-m", "mtpipe", "health", "--json",
                                      *(f"10.78.0.{i}:{PORT}" for i in (1, 2, 3))])
        cases = [(p, d) for p in PROMPTS[:2] for d in (0, 2)]
        completions = run_in(topology, 1, [sys.executable, "-c", CLIENT, json.dumps(cases)])
        assert completions.returncode == 0, completions.stderr + procs[1].log()
        return {"serving": serving, "health": json.loads(health.stdout), "cases": cases,
                "completions": json.loads(completions.stdout)}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.stop()


def run_in(topology: Topology, host: int, argv: list[str]):
    import subprocess

    return subprocess.run(topology.argv(host, *argv), capture_output=True, text=True,
                          env=_env(MTPIPE_SECRET=SECRET), timeout=120, check=False)


@pytest.fixture(scope="module")
def first(topology: Topology, root: Path) -> dict:
    return launch(topology, root)


def shard_bytes(model: Path, layers: list[int], num_layers: int) -> int:
    index = checkpoint_index(model)
    return sum(index[n].size for n in shard_names(model, layers[0], layers[1], num_layers, True))


def check_generation(result: dict, single_node) -> None:
    for (prompt, depth), got in zip(result["cases"], result["completions"], strict=True):
        ref = single_node.complete(GenerationRequest(single_node.tokenizer.encode(prompt), max_tokens=MAX_TOKENS,
                                                     mtp_depth=depth))
        assert (got["text"], got["tokens"]) == (ref.text, len(ref.tokens)), f"diverged on {prompt!r} at depth {depth}"


def test_shards_reach_nodes_without_the_model(first: dict, root: Path, single_node) -> None:
    model = root / "model"
    placement = first["serving"]["placement"]
    assert first["serving"]["batching"] == "ring"
    assert [p["node"] for p in placement] == ["node-a", "node-b", "node-c"]
    num_layers = placement[-1]["layers"][1]
    expected = [shard_bytes(model, p["layers"], num_layers) for p in placement]
    rows = first["health"]["nodes"]
    assert [r["node_id"] for r in rows] == ["node-a", "node-b", "node-c"], first["health"]
    fp = model_fingerprint(model)
    weights = [r["weights"] for r in rows]
    assert all(w["fingerprint"] == fp for w in weights)
    assert weights[0]["source"] == "local" and weights[0]["fetched_bytes"] == 0
    for w, total in zip(weights[1:], expected[1:]):
        assert w["source"].startswith("peer ") and "10.78.0.1" in w["source"], w
        assert w["fetched_bytes"] == total > 0
        assert w["transfer"] == {"state": "done", "done": total, "total": total}
    assert weights[0]["served_bytes"] == expected[1] + expected[2]
    # What arrived is exactly each shard's tensors, in each node's own cache.
    for i, p in ((2, placement[1]), (3, placement[2])):
        (entry,) = [d for d in (root / f"cache{i}" / fp).iterdir()]
        assert sorted(checkpoint_index(entry)) == shard_names(model, *p["layers"], num_layers, True)
    check_generation(first, single_node)


def test_a_second_launch_transfers_nothing(first: dict, topology: Topology, root: Path, single_node) -> None:
    """Launched again, now with the nodes listed in cluster.yaml and discovery off (static nodes: elected
    by asking each other, no interfaces known, the coordinator's own host only as listed, each node's
    memory as its Health offers it, a layer count fixed by host): the same placement, the ring back to
    the coordinator's listed host, and every shard from each node's cache."""
    c_layers = first["serving"]["placement"][2]["layers"]
    config = (root / "cluster.yaml").read_text()
    for was, now in (("discovery:\n  expect: 3\n", "discovery:\n  enabled: false\n"),
                     ("placement:\n", f"placement:\n  layers: {{10.78.0.3: {c_layers[1] - c_layers[0]}}}\n")):
        assert was in config
        config = config.replace(was, now)
    (root / "static.yaml").write_text(config + f"nodes: [10.78.0.1, 10.78.0.2, '10.78.0.3:{PORT}']\n")
    again = launch(topology, root, "static.yaml")
    assert again["serving"]["placement"] == first["serving"]["placement"]
    assert again["serving"]["batching"] == "ring" and again["serving"]["ring"]["address"] == f"10.78.0.1:{PORT}"
    weights = [r["weights"] for r in again["health"]["nodes"]]
    assert [w["source"] for w in weights] == ["local", "cache", "cache"]
    assert [w["fetched_bytes"] for w in weights] == [0, 0, 0]
    assert weights[0]["served_bytes"] == 0
    assert all(w["transfer"] is None for w in weights)
    check_generation(again, single_node)
