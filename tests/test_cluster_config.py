"""cluster.yaml: the documented example, validation errors that name the key, flags over the file,
and the cluster-formation choices made from it (discovery addresses, election)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from mtpipe.coordinator.cli.main import build_parser
from mtpipe.coordinator.cluster.config import (
    ClusterConfig,
    ClusterConfigError,
    StaticNode,
    load_cluster_config,
    parse_cluster_config,
)
from mtpipe.coordinator.cluster.discovery import elect_coordinator
from mtpipe.coordinator.cluster.launch import (
    advertised_interfaces,
    discovery_addresses,
    resolve_config,
)
from mtpipe.node.advertise import NodeAdvert
from mtpipe.node.links import Interface, LinkType

EXAMPLE = Path(__file__).parent.parent / "cluster.yaml"


def _field_paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        out.append(prefix + f.name)
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            out += _field_paths(f.default_factory, prefix + f.name + ".")
    return out


def test_example_documents_every_field_with_the_defaults() -> None:
    text = EXAMPLE.read_text()
    for path in _field_paths(ClusterConfig):
        assert f"{path.rsplit('.', 1)[-1]}:" in text, f"cluster.yaml does not document {path}"
    assert load_cluster_config(EXAMPLE) == ClusterConfig()


def test_full_config(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "name: lab\nsecret_env: LAB_SECRET\nmodel: /models/qwen\nmtp_depth: 3\ndtype: bfloat16\n"
        "nodes: ['10.0.0.5', '10.0.0.6:6000', {host: 'fe80::1%en2', port: 7000}]\n"
        "node: {port: 6000, max_memory_gib: 48}\n"
        "discovery: {interfaces: [en0, 10.0.0.2], expect: 3, settle: 10}\n"
        "placement: {layers: {a1b2c3: 20}, reserve_gib: 4}\n"
        "api: {host: 0.0.0.0, port: 52415, api_key_env: LAB_KEY}\n"
    )
    cfg = load_cluster_config(path)
    assert cfg.nodes == [StaticNode("10.0.0.5", 52700), StaticNode("10.0.0.6", 6000), StaticNode("fe80::1%en2", 7000)]
    assert [n.address for n in cfg.nodes] == ["10.0.0.5:52700", "10.0.0.6:6000", "[fe80::1%en2]:7000"]
    assert (cfg.discovery.expect, cfg.discovery.settle, cfg.placement.layers) == (3, 10.0, {"a1b2c3": 20})
    assert (cfg.api.port, cfg.node.max_memory_gib, cfg.mtp_depth) == (52415, 48.0, 3)


def test_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_SECRET", "s3")
    monkeypatch.setenv("MTPIPE_SECRET", "default")
    assert parse_cluster_config({"secret_env": "LAB_SECRET"}).resolve_secret() == "s3"
    assert parse_cluster_config({}).resolve_secret() == "default"
    assert parse_cluster_config({"secret": "literal"}).resolve_secret() == "literal"
    monkeypatch.delenv("MTPIPE_SECRET")
    assert parse_cluster_config({}).resolve_secret() is None
    monkeypatch.setenv("LAB_KEY", "k")
    assert parse_cluster_config({"api": {"api_key_env": "LAB_KEY"}}).resolve_api_key() == "k"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"nmae": "x"}, "unknown field 'nmae'"),
        ({"api": {"prot": 1}}, r"api: unknown field 'prot' \(known: host, port, api_key, api_key_env\)"),
        ({"api": {"port": "eighty"}}, "api.port: expected int, got 'eighty'"),
        ({"api": {"port": 70000}}, "api.port: 70000 is not a TCP port"),
        ({"mtp_depth": 12}, "mtp_depth: 12 is not in 0..8"),
        ({"mtp_depth": True}, "mtp_depth: expected int, got True"),
        ({"nodes": "10.0.0.1"}, "nodes: expected a list"),
        ({"nodes": ["h:port"]}, r"nodes\[0\]: 'h:port': 'port' is not a TCP port"),
        ({"placement": {"layers": {"a": 0}}}, "placement.layers.a: 0 layers"),
        ({"discovery": {"expect": 0}}, "discovery.expect: must be at least 1"),
        ({"dtype": "int8"}, "dtype: 'int8' is not one of"),
        ({"secret": "x", "secret_env": "OTHER"}, "either secret or secret_env"),
        (["a"], "must be a mapping at the top level"),
    ],
)
def test_errors_name_the_key(data: object, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=message):
        parse_cluster_config(data)


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        load_cluster_config(bad)
    bad.write_text("api:\n  port: x\n")
    with pytest.raises(ClusterConfigError, match=r"cluster\.yaml: api\.port: expected int"):
        load_cluster_config(bad)
    with pytest.raises(FileNotFoundError):
        load_cluster_config(tmp_path / "missing.yaml")


def _launch_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *argv])


def test_flags_override_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: lab\ndiscovery: {expect: 2, interfaces: [en0]}\napi: {port: 9000}\nnode: {port: 6000}\n")
    monkeypatch.chdir(tmp_path)  # no ./cluster.yaml here
    cfg = resolve_config(_launch_args("--config", str(path), "--cluster", "lab2", "--expect", "4", "--interface",
                                      "10.0.0.2", "--api-port", "9100", "--node", "10.0.0.9", "--max-memory", "12"))
    assert (cfg.name, cfg.discovery.expect, cfg.discovery.interfaces, cfg.api.port) == ("lab2", 4, ["10.0.0.2"], 9100)
    assert cfg.nodes == [StaticNode("10.0.0.9", 6000)] and cfg.node.max_memory_gib == 12.0
    assert resolve_config(_launch_args()) == ClusterConfig()
    with pytest.raises(ClusterConfigError, match="api.port"):
        resolve_config(_launch_args("--api-port", "0"))


ETH = Interface("en0", LinkType.ETHERNET, ("192.168.1.20/24", "fe80::1/64"))
TB = Interface("bridge0", LinkType.THUNDERBOLT, ("169.254.3.4/16",))
LO = Interface("lo0", LinkType.LOOPBACK, ("127.0.0.1/8", "::1/128"))
VPN = Interface("utun0", LinkType.OTHER, ("10.8.0.2/24",))


def test_discovery_binds_only_named_or_physical_interfaces() -> None:
    ifaces = [LO, ETH, TB, VPN]
    assert discovery_addresses([], ifaces) == ["192.168.1.20"]  # not loopback, a VPN, or a Thunderbolt bridge
    assert discovery_addresses([], [LO, TB, VPN]) == ["169.254.3.4"]  # Thunderbolt when there is nothing else
    assert discovery_addresses(["en0"], ifaces) == ["192.168.1.20"]
    assert discovery_addresses(["127.0.0.1"], ifaces) == ["127.0.0.1"]
    with pytest.raises(ValueError, match="neither an address nor an interface"):
        discovery_addresses(["en9"], ifaces)
    with pytest.raises(ValueError, match="no network interface"):
        discovery_addresses([], [LO, VPN])
    assert advertised_interfaces(ifaces, ["192.168.1.20"]) == (ETH, TB, VPN)
    assert advertised_interfaces(ifaces, ["127.0.0.1"]) == (LO, ETH, TB, VPN)  # nodes on one host share it


def _ad(node_id: str, coordinator: bool = False) -> NodeAdvert:
    return NodeAdvert(node_id, "h", 1, 1, 1, "", "", coordinator=coordinator)


def test_election() -> None:
    peers = {n: _ad(n) for n in ("c3", "a1", "b2")}
    assert [elect_coordinator(me, peers) for me in peers] == ["a1"] * 3  # every node agrees: the lowest id
    assert elect_coordinator("b2", peers, forced=True) == "b2"
    peers["c3"] = _ad("c3", coordinator=True)  # started with --coordinator, or already serving
    assert [elect_coordinator(me, peers) for me in ("a1", "b2")] == ["c3", "c3"]


def test_static_nodes_and_reachability() -> None:
    """Static nodes are asked for their id and memory; a hop address must answer as the right node."""
    from mtpipe.coordinator.cluster.health import first_reachable, probe_node
    from mtpipe.coordinator.cluster.formation import static_resources
    from mtpipe.node.server import NodeServer

    server = NodeServer("127.0.0.1", 0, node_id="static-1", secret="s3").start()
    try:
        (res,) = static_resources([StaticNode("127.0.0.1", server.port)], "s3", reserve=2**20)
        assert (res.node_id, res.port, res.addresses, res.interfaces) == ("static-1", server.port, ("127.0.0.1",), ())
        assert res.available > 0
        target = f"127.0.0.1:{server.port}"
        reached = first_reachable(["127.0.0.1:1", target], "s3", "static-1", timeout=2.0)
        assert reached.target == target and reached.node_id == "static-1" and reached.rtt_ms > 0
        assert first_reachable([target], "s3", "another-node", timeout=2.0) is None  # answers, but as someone else
        assert first_reachable([target], "wrong", None, timeout=2.0) is None  # refused: UNAUTHENTICATED
        row = probe_node(target, "s3")
        assert (row["status"], row["problems"], row["node_id"]) == ("degraded", ["no shard loaded"], "static-1")
        with pytest.raises(ConnectionError, match="UNAUTHENTICATED"):
            static_resources([StaticNode("127.0.0.1", server.port)], None, reserve=0)
    finally:
        server.stop()
