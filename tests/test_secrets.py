"""Secrets come from a file or the environment, never argv; a node without one stays on loopback."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from mtpipe.coordinator.bench.nodes import free_port
from mtpipe.coordinator.cli.main import build_parser
from mtpipe.coordinator.cluster.config import ClusterConfig
from mtpipe.node.secrets import check_exposure, is_loopback, read_secret

CLI = [sys.executable, "-m", "mtpipe"]


SECRET_FLAGS = [(argv, "--secret", "--secret-file", "MTPIPE_SECRET")
                for argv in (["node"], ["serve", "--nodes", "a:1"], ["generate", "--nodes", "a:1"], ["launch"],
                             ["health"])]
API_KEY_FLAGS = [(argv, "--api-key", "--api-key-file", "MTPIPE_API_KEY") for argv in (["serve"], ["launch"])]


@pytest.mark.parametrize(("argv", "option", "instead", "env"), SECRET_FLAGS + API_KEY_FLAGS)
def test_a_secret_on_the_command_line_is_refused(argv: list[str], option: str, instead: str, env: str,
                                                 capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, option, "hunter2"])
    assert e.value.code == (3 if argv == ["health"] else 2)  # (health: its check could not run, never "unreachable")
    err = capsys.readouterr().err
    assert instead in err and env in err and "ps" in err


def test_an_api_key_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.coordinator.cli.cluster import resolve_config

    monkeypatch.setenv("MTPIPE_API_KEY", "from-env")
    monkeypatch.chdir(tmp_path)  # (no ./cluster.yaml)
    f = tmp_path / "key"
    f.write_text("from-file\n")
    f.chmod(0o600)
    assert resolve_config(build_parser().parse_args(["launch", "--api-key-file", str(f)])).resolve_api_key() == \
        "from-file"
    assert resolve_config(build_parser().parse_args(["launch"])).resolve_api_key() == "from-env"
    with pytest.raises(ValueError, match="--api-key-file .*missing"):
        resolve_config(build_parser().parse_args(["launch", "--api-key-file", str(tmp_path / "missing")]))


def test_secret_from_a_file_else_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTPIPE_SECRET", "from-env")
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    f.chmod(0o600)
    assert read_secret(str(f)) == "from-file"
    assert read_secret(None) == "from-env"
    monkeypatch.delenv("MTPIPE_SECRET")
    assert read_secret(None) is None
    f.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        read_secret(str(f))
    with pytest.raises(ValueError, match="No such file"):
        read_secret(str(tmp_path / "missing"))
    f.write_bytes(b"\xff\xfe key")
    with pytest.raises(ValueError, match="secret-file .*: not UTF-8 text"):
        read_secret(str(f))
    f.write_text("cfg\n")
    assert ClusterConfig(secret_file=str(f)).resolve_secret() == "cfg"
    with pytest.raises(ValueError, match="either secret or secret_file"):
        ClusterConfig(secret="a", secret_file=str(f))


def test_no_secret_means_loopback_only() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "fe80::1%eth0", "example.org"))
    check_exposure("127.0.0.1", None, insecure=False)
    check_exposure("0.0.0.0", "s3cret", insecure=False)
    check_exposure("0.0.0.0", None, insecure=True)
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without a cluster secret"):
        check_exposure("0.0.0.0", None, insecure=False)


def test_a_short_secret_on_a_network_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.WARNING):
        check_exposure("0.0.0.0", "short", insecure=False)
    assert "5 characters" in caplog.text and "openssl rand" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_exposure("127.0.0.1", "short", insecure=False)  # (reachable from this machine only)
        check_exposure("0.0.0.0", "a" * 32, insecure=False)
    assert caplog.text == ""


def test_node_without_a_secret_will_not_listen_on_all_interfaces(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run([*CLI, "node", "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True,
                       env=env, timeout=120, check=False)
    assert r.returncode == 2 and "refusing to listen on 0.0.0.0 without a cluster secret" in r.stderr
    assert "--insecure" in r.stderr


def test_only_nodes_that_prove_membership_count() -> None:
    """Adverts from a node with another secret, from nobody, or under another node's id are left out of
    the election and the placement, each with a log line; a coordinator flag in an advert wins nothing."""
    from mtpipe.coordinator.cluster.discovery import elect_coordinator
    from mtpipe.coordinator.cluster.membership import members_only
    from mtpipe.node.advertise import NodeAdvert
    from mtpipe.node.server import NodeServer

    good = NodeServer("127.0.0.1", 0, node_id="node-b", secret="s3").start()
    rogue = NodeServer("127.0.0.1", 0, node_id="node-0", secret="guess").start()
    try:
        def advert(node_id: str, port: int, coordinator: bool = False) -> NodeAdvert:
            return NodeAdvert(node_id, "h", port, 1 << 30, 1 << 30, "cpu", "v", coordinator=coordinator,
                              addresses=("127.0.0.1",))

        peers = {"node-a": advert("node-a", 1), "node-b": advert("node-b", good.port),
                 "node-0": advert("node-0", rogue.port, coordinator=True),  # wrong secret, claims to coordinate
                 "node-1": advert("node-1", 9),  # nobody listens
                 "node-c": advert("node-c", good.port)}  # someone else's address
        assert elect_coordinator("node-a", peers) == "node-0"  # what an advert alone would win
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append  # type: ignore[method-assign]
        log = logging.getLogger("mtpipe.coordinator.cluster.membership")
        log.addHandler(handler)
        try:
            kept = members_only(peers, "node-a", [], "s3", timeout=2.0)
        finally:
            log.removeHandler(handler)
        assert sorted(kept) == ["node-a", "node-b"]
        assert elect_coordinator("node-a", kept) == "node-a"
        left_out = [r.getMessage() for r in records if "did not prove" in r.getMessage()]
        assert sorted(m.split()[1] for m in left_out) == ["node-0", "node-1", "node-c"]
    finally:
        good.stop(0)
        rogue.stop(0)


def test_membership_tries_a_failed_proof_again_later() -> None:
    """A node that advertises a moment before it answers is proven once it does (not before the retry
    time has passed), and its failure is logged once; a proof is kept, not probed again."""
    from mtpipe.coordinator.cluster import membership as mod
    from mtpipe.node.advertise import NodeAdvert
    from mtpipe.node.server import NodeServer

    port = free_port()
    ad = NodeAdvert("late", "h", port, 1, 1, "cpu", "v", addresses=("127.0.0.1",))
    now = [0.0]
    members = mod.Membership("me", [], "s3", timeout=1.0, retry_s=5.0, clock=lambda: now[0])
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(mod.__name__).addHandler(handler)
    server = None
    try:
        assert members.members({"late": ad}) == {}
        server = NodeServer("127.0.0.1", port, node_id="late", secret="s3").start()
        now[0] = 4.0
        assert members.members({"late": ad}) == {}  # not tried again yet
        assert members.report({"late": ad}) == ([], {"late": "did not prove it belongs"})
        now[0] = 5.0
        assert list(members.members({"late": ad})) == ["late"]
        assert members.address(ad) == f"127.0.0.1:{port}"
        # The memory it offers is what it says over the authenticated link: a forged copy of its advert
        # (the same id and address) claims any.
        server.service.memory_offered = lambda: 5 << 30
        forged = NodeAdvert("late", "h", port, 1, 1 << 50, "forged", "v", addresses=("127.0.0.1",))
        assert mod.Membership("me", [], "s3").members({"late": forged})["late"].mem_available == 5 << 30
        probes = []
        real_prove = members._prove
        members._prove = lambda key: probes.append(key) or real_prove(key)  # type: ignore[method-assign]
        assert list(members.members({"late": ad})) == ["late"] and probes == []
        new = NodeAdvert("new", "h", port + 1, 1, 1, "cpu", "v", addresses=("127.0.0.1",))
        assert members.report({"late": ad, "new": new}) == (["late"], {"new": "not checked"})
        # GET /v1/cluster asks a node that joined since to prove it belongs before it reports on it.
        from types import SimpleNamespace

        from mtpipe.coordinator.cluster.config import parse_cluster_config
        from mtpipe.coordinator.cluster.formation import cluster_info_fn

        engine = SimpleNamespace(has_mtp=True, batching="batch", max_context=8,
                                 pipeline=SimpleNamespace(describe=lambda: {"stages": [{"layers": [0, 4]}]}))
        agent = SimpleNamespace(peers=lambda: {"late": ad, "new": new}, discovery=SimpleNamespace(ignored=set()))
        info = cluster_info_fn(parse_cluster_config({}), "me", f"127.0.0.1:{port}", engine, "m", None, agent, "s3",
                               members)()
        assert (info["discovered"], info["left_out"]) == (["late"], {"new": "did not prove it belongs"})
        assert (info["spares"], info["unreachable"]) == (["late"], [])
        server.stop(0)  # (as a node killed outright: its advert stays until zeroconf's records expire)
        server = None
        info = cluster_info_fn(parse_cluster_config({}), "me", f"127.0.0.1:{port}", engine, "m", None, agent, "s3",
                               members)()
        assert (info["discovered"], info["spares"], info["unreachable"]) == (["late"], [], ["late"])
    finally:
        logging.getLogger(mod.__name__).removeHandler(handler)
        if server is not None:
            server.stop(0)
    assert sum("node late" in r.getMessage() for r in records) == 1


def test_the_coordinator_flag_is_the_one_the_node_reports() -> None:
    """An advert claiming that a member coordinates (say, someone replaying its advert with the flag
    set) counts the flag only if the member says so over the authenticated channel."""
    from mtpipe.coordinator.cluster.discovery import elect_coordinator
    from mtpipe.coordinator.cluster.membership import Membership
    from mtpipe.node.advertise import NodeAdvert
    from mtpipe.node.server import NodeServer

    node = NodeServer("127.0.0.1", 0, node_id="node-b", secret="s3").start()
    try:
        claims = NodeAdvert("node-b", "h", node.port, 1, 1, "cpu", "v", coordinator=True, addresses=("127.0.0.1",))
        members = Membership("node-c", [], "s3", timeout=2.0)
        kept = members.members({"node-b": claims})
        assert not kept["node-b"].coordinator
        assert elect_coordinator("node-c", {**kept, "node-c": claims}) == "node-b"  # the lowest id, not a flag
        node.service.coordinating = True  # elected: from now on its Ping says so
        assert Membership("node-c", [], "s3", timeout=2.0).members({"node-b": claims})["node-b"].coordinator
    finally:
        node.stop(0)


def test_a_peer_with_another_secret_gets_mtpipes_error_not_grpcs_log_lines(tmp_path: Path) -> None:
    """`mtpipe health` with the wrong secret: the node is reported unreachable, and gRPC's core does not
    add its own "Handshake failed" lines to stderr."""
    import json

    from mtpipe.node.server import NodeServer

    node = NodeServer("127.0.0.1", 0, secret="right").start()
    try:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MTPIPE_SECRET": "wrong"}
        r = subprocess.run([*CLI, "health", "--json", "--timeout", "3", node.address], capture_output=True,
                           text=True, env=env, timeout=120, check=False, cwd=tmp_path)
    finally:
        node.stop(0)
    assert r.returncode == 2, r.stderr  # unreachable
    reported = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Handshake failed" not in r.stderr and "ssl_transport_security" not in r.stderr, r.stderr
    assert node.address in json.dumps(reported) and "handshake" in json.dumps(reported).lower()


def test_launched_nodes_on_one_machine_share_what_it_offers() -> None:
    """`mtpipe launch` places discovered nodes by the memory each offers over its authenticated link; nodes
    that run on one machine (this one's node among them) each offer their share of it, as a static
    cluster's placement counts them."""
    from mtpipe.coordinator.cluster.membership import Membership
    from mtpipe.node.advertise import NodeAdvert
    from mtpipe.node.server import NodeServer

    servers = [NodeServer("127.0.0.1", 0, node_id=f"node-{c}", secret="s3").start() for c in "bc"]
    try:
        for s in servers:
            s.service.memory_offered = lambda: 1 << 50  # (a cap above what the machine has: its free memory counts)
        peers = {s.service.node_id: NodeAdvert(s.service.node_id, "h", s.port, 1, 1, "cpu", "v",
                                               addresses=("127.0.0.1",)) for s in servers}
        me = NodeAdvert("node-a", "h", 1, 1, 9 << 30, "cpu", "v", addresses=("127.0.0.1",))
        membership = Membership("node-a", [], "s3", timeout=2.0)
        members = membership.members({**peers, "node-a": me})
        alone = {node_id: ad.mem_available for node_id, ad in members.items()}
        assert alone["node-a"] == 9 << 30 and alone["node-b"] > 1 << 20  # (each as if it had the machine)
        shared = {node_id: ad.mem_available
                  for node_id, ad in membership.shared(members, lambda k: (9 << 30) // k).items()}
        assert shared == {node_id: mem // 3 for node_id, mem in alone.items()}  # (no shard held: a third each)
        capped = Membership("node-a", [], "s3", timeout=2.0)
        for s in servers:
            s.service.memory_offered = lambda: 1 << 20  # (a cap below a third of what the machine has free)
        members = capped.members({**peers, "node-a": me})
        shared = capped.shared(members, lambda k: (9 << 30) // k)
        assert {node_id: ad.mem_available for node_id, ad in shared.items()} == \
            {"node-a": 3 << 30, "node-b": 1 << 20, "node-c": 1 << 20}  # (a cap is a node's own)
        assert capped.shared({"node-b": members["node-b"]}, lambda k: 0)["node-b"].mem_available == 1 << 20
    finally:
        for s in servers:
            s.stop(0)
