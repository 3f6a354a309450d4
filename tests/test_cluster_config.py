"""cluster.yaml: the documented example, strict validation with errors that name the file and the
key path, flags over the file, and the cluster-formation choices made from it (discovery
addresses, election)."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from pathlib import Path

import pydantic
import pytest
import yaml

from mtpipe.coordinator.cli.cluster import resolve_config
from mtpipe.coordinator.cli.main import build_parser
from mtpipe.coordinator.cluster.agent import advertised_interfaces, discovery_addresses
from mtpipe.coordinator.cluster.config import (
    ClusterConfig,
    ClusterConfigError,
    StaticNode,
    load_cluster_config,
    overlay,
    parse_cluster_config,
)
from mtpipe.coordinator.cluster.discovery import elect_coordinator
from mtpipe.node.advertise import NodeAdvert
from mtpipe.node.links import Interface, LinkType

EXAMPLE = Path(__file__).parent.parent / "cluster.yaml"


def _field_paths(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        out.append(prefix + name)
        if isinstance(info.annotation, type) and issubclass(info.annotation, pydantic.BaseModel):
            out += _field_paths(info.annotation, prefix + name + ".")
    return out


def test_example_documents_every_field_with_the_defaults() -> None:
    text = EXAMPLE.read_text()
    example = yaml.safe_load(text)
    paths = _field_paths(ClusterConfig)
    assert {"discovery.settle", "placement.layers", "api.api_key_env", "node.max_memory_gib"} <= set(paths)
    for path in paths:
        *sections, key = path.split(".")
        section = example
        for name in sections:
            section = section[name]
        # given a value in the example, or shown commented out (the literal secret)
        documented = key in section or re.search(rf"^\s*#\s*{key}:", text, re.MULTILINE)
        assert documented, f"cluster.yaml does not document {path}"
    nodes_doc = text[text.index("\nnodes:"):text.index("\nnode:")]
    for key in StaticNode.model_fields:
        assert f"{key}:" in nodes_doc, f"cluster.yaml does not document nodes[].{key}"
    assert load_cluster_config(EXAMPLE) == ClusterConfig()


def test_full_config(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "name: lab\nsecret_env: LAB_SECRET\nmodel: /models/qwen\nmtp_depth: 3\ndtype: bfloat16\n"
        "draft_vocab: 8192\nmtp_window: 0\nprefix_cache_gib: 2\n"
        "nodes: ['10.0.0.5', '10.0.0.6:6000', {host: 'fe80::1%en2', port: 7000}]\n"
        "node: {port: 6000, max_memory_gib: 48}\n"
        "discovery: {interfaces: [en0, 10.0.0.2], expect: 3, settle: 10}\n"
        "placement: {layers: {a1b2c3: 20, 123456: 4}, reserve_gib: 4}\n"
        "api: {host: 0.0.0.0, port: 52415, api_key_env: LAB_KEY}\n"
    )
    cfg = load_cluster_config(path)
    assert cfg.nodes == [StaticNode(host="10.0.0.5", port=52700), StaticNode(host="10.0.0.6", port=6000),
                         StaticNode(host="fe80::1%en2", port=7000)]
    assert [n.address for n in cfg.nodes] == ["10.0.0.5:52700", "10.0.0.6:6000", "[fe80::1%en2]:7000"]
    assert (cfg.discovery.expect, cfg.discovery.settle, cfg.placement.layers) == (3, 10.0, {"a1b2c3": 20, "123456": 4})
    assert (cfg.api.port, cfg.node.max_memory_gib, cfg.mtp_depth, cfg.dtype) == (52415, 48.0, 3, "bfloat16")
    assert cfg.drafting() == {"draft_vocab": 8192, "mtp_window": 0}  # (0: the whole context)
    assert ClusterConfig().drafting() == {}  # the node's own defaults
    assert cfg.prefix_cache() == 2 * 2**30 and ClusterConfig().prefix_cache() is None  # (None: the engine's default)
    assert type(cfg.discovery.settle) is float and type(cfg.placement.reserve_gib) is float  # YAML ints, as floats


def test_numbers_meant_as_text_and_bounds_that_are_allowed() -> None:
    cfg = parse_cluster_config({"name": 42, "secret": "123456", "mtp_depth": 0, "discovery": {"settle": 0},
                                "placement": {"reserve_gib": 0}, "node": {"port": 1}, "api": {"port": 65535}})
    assert (cfg.name, cfg.secret, cfg.mtp_depth, cfg.discovery.settle) == ("42", "123456", 0, 0.0)
    assert (cfg.placement.reserve_gib, cfg.node.port, cfg.api.port) == (0.0, 1, 65535)
    assert parse_cluster_config({"mtp_depth": 8, "discovery": {"expect": 1}}).mtp_depth == 8
    assert parse_cluster_config(None) == ClusterConfig()


def test_secrets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_SECRET", "s3")
    monkeypatch.setenv("MTPIPE_SECRET", "default")
    assert parse_cluster_config({"secret_env": "LAB_SECRET"}).resolve_secret() == "s3"
    assert parse_cluster_config({}).resolve_secret() == "default"
    assert parse_cluster_config({"secret": "literal"}).resolve_secret() == "literal"
    assert parse_cluster_config({"secret_env": None}).resolve_secret() is None
    monkeypatch.delenv("MTPIPE_SECRET")
    assert parse_cluster_config({}).resolve_secret() is None
    monkeypatch.setenv("LAB_KEY", "k")
    assert parse_cluster_config({"api": {"api_key_env": "LAB_KEY"}}).resolve_api_key() == "k"
    assert parse_cluster_config({"api": {"api_key": "lit", "api_key_env": "LAB_KEY"}}).resolve_api_key() == "lit"


def test_a_secret_flag_replaces_the_files_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "secret").write_text("from-file\n")
    monkeypatch.setenv("LAB_SECRET", "from-env")
    from_file = parse_cluster_config({"secret_file": str(tmp_path / "secret")})
    assert overlay(from_file, {"secret_env": "LAB_SECRET"}).resolve_secret() == "from-env"
    literal = parse_cluster_config({"secret": "literal"})
    assert overlay(literal, {"secret_file": str(tmp_path / "secret")}).resolve_secret() == "from-file"
    assert overlay(literal, {"secret_env": "LAB_SECRET"}).resolve_secret() == "from-env"


KNOWN_TOP = ("name, secret, secret_file, secret_env, model, revision, dtype, mtp_depth, draft_vocab, mtp_window, "
             "prefix_cache_gib, nodes, node, discovery, placement, api")
KNOWN_API = ("host, port, api_key, api_key_env, generation_config, max_tokens, allowed_origins, scheduling_policy, "
             "chat_template, chat_template_args, ssl_certfile, ssl_keyfile")


@pytest.mark.parametrize(
    "data, message",
    [
        # unknown keys, at the top level and in sections, named with their path and the known ones
        ({"nmae": "x"}, rf": nmae: unknown key \(known: {KNOWN_TOP}\)$"),
        ({"api": {"prot": 1}}, rf": api\.prot: unknown key \(known: {KNOWN_API}\)$"),
        ({"discovery": {"setle": 1}}, r": discovery\.setle: unknown key \(known: enabled, interfaces,"),
        ({"nodes": ["h", {"host": "h", "prt": 1}]}, r": nodes\[1\]\.prt: unknown key \(known: host, port\)$"),
        # wrong types: nothing is coerced silently
        ({"api": {"port": "eighty"}}, r": api\.port: Input should be a valid integer \(got 'eighty'\)$"),
        ({"api": {"allowed_origins": ["localhost:3000"]}}, r": api\.allowed_origins: .*expected '\*', 'none' or origins"),
        ({"node": {"port": "6000"}}, r": node\.port: Input should be a valid integer \(got '6000'\)$"),
        ({"mtp_depth": True}, r": mtp_depth: Input should be a valid integer \(got True\)$"),
        ({"discovery": {"expect": 2.0}}, r": discovery\.expect: Input should be a valid integer"),
        ({"discovery": {"settle": "5"}}, r": discovery\.settle: Input should be a valid number"),
        ({"discovery": {"enabled": "yes"}}, r": discovery\.enabled: Input should be a valid boolean"),
        ({"discovery": {"interfaces": "en0"}}, r": discovery\.interfaces: Input should be a valid list"),
        ({"nodes": "10.0.0.1"}, r": nodes: Input should be a valid list"),
        ({"nodes": [5]}, r": nodes\[0\]: Input should be a valid dictionary"),
        ({"name": None}, r": name: Input should be a valid string \(got None\)$"),
        ({"api": None}, r": api: Input should be a valid dictionary"),
        ({"placement": {"layers": {"a": 1.5}}}, r": placement\.layers\.a: Input should be a valid integer"),
        (["a"], r" must be a mapping at the top level, got list$"),
        # value constraints
        ({"name": " "}, r": name: must not be empty$"),
        ({"node": {"port": 0}}, r": node\.port: Input should be greater than or equal to 1 \(got 0\)$"),
        ({"api": {"port": 70000}}, r": api\.port: Input should be less than or equal to 65535 \(got 70000\)"),
        ({"nodes": [{"host": "h", "port": 65536}]}, r": nodes\[0\]\.port: Input should be less than or"),
        ({"nodes": ["h:port"]}, r": nodes\[0\]: 'h:port': 'port' is not a TCP port$"),
        ({"nodes": [""]}, r": nodes\[0\]: '': '' is neither an IP address nor a host name"),
        ({"nodes": ["10.0.0.2:52700:1"]}, r": nodes\[0\]: .* is neither an IP address nor a host name"),
        ({"nodes": ["[::1]junk"]}, r": nodes\[0\]: '\[::1\]junk' is not \[address\]:port"),
        ({"nodes": [{"host": "http://mac"}]}, r": nodes\[0\]\.host: 'http://mac' is neither an IP address nor"),
        ({"dtype": "int8"}, r": dtype: Input should be 'float32', 'float16' or 'bfloat16' \(got 'int8'\)$"),
        ({"node": {"max_memory_gib": 0}}, r": node\.max_memory_gib: Input should be greater than 0"),
        ({"mtp_depth": 9}, r": mtp_depth: Input should be less than or equal to 8 \(got 9\)$"),
        ({"mtp_depth": -1}, r": mtp_depth: Input should be greater than or equal to 0 \(got -1\)$"),
        ({"draft_vocab": -1}, r": draft_vocab: Input should be greater than or equal to 0 \(got -1\)$"),
        ({"mtp_window": "long"}, r": mtp_window: Input should be a valid integer"),
        ({"discovery": {"expect": 0}}, r": discovery\.expect: Input should be greater than or equal to 1"),
        ({"discovery": {"settle": -0.5}}, r": discovery\.settle: Input should be greater than or equal to 0"),
        ({"placement": {"reserve_gib": -1}}, r": placement\.reserve_gib: Input should be greater than or"),
        ({"placement": {"layers": {"a": 0}}}, r": placement\.layers\.a: Input should be greater than or equal"),
        ({"secret": "x", "secret_env": "OTHER"}, r": give either secret or secret_env, not both$"),
        ({"secret": 83}, r": secret: YAML reads this secret as a number, .*: quote it$"),  # (0123; never echoed)
        ({"discovery": {"settle": float("inf")}}, r": discovery\.settle: Input should be a finite number"),
        ({"node": {"max_memory_gib": float("nan")}}, r": node\.max_memory_gib: Input should be a finite number"),
    ],
)
def test_errors_name_the_file_and_key(data: object, message: str) -> None:
    with pytest.raises(ClusterConfigError, match=r"^cluster\.yaml" + message):
        parse_cluster_config(data)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ClusterConfigError) as e:
        parse_cluster_config({"api": {"port": 0}, "discovery": {"settle": -1}, "typo": 1})
    lines = str(e.value).splitlines()
    assert len(lines) == 3 and all(line.startswith("cluster.yaml: ") for line in lines)
    assert {line.split(": ")[1] for line in lines} == {"api.port", "discovery.settle", "typo"}


def test_assignment_is_validated_too() -> None:
    cfg = ClusterConfig()
    cfg.api.port = 9000
    assert cfg.api.port == 9000
    with pytest.raises(ValueError, match="less than or equal to 65535"):
        cfg.api.port = 70000
    with pytest.raises(ValueError, match="valid integer"):
        cfg.node.port = "52700"  # type: ignore[assignment]
    assert (cfg.api.port, cfg.node.port) == (9000, 52700)


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        load_cluster_config(bad)
    where = re.escape(str(bad))  # errors start with the file's path
    bad.write_text("api:\n  port: x\n")
    with pytest.raises(ClusterConfigError, match=rf"^{where}: api\.port: Input should be a valid integer \(got 'x'\)$"):
        load_cluster_config(bad)
    bad.write_text("- a\n")
    with pytest.raises(ClusterConfigError, match=rf"^{where} must be a mapping at the top level"):
        load_cluster_config(bad)
    bad.write_text("name: a\nnode:\n  host: 127.0.0.1\nnode:\n  port: 6000\n")  # half of node lost, were it let through
    with pytest.raises(ClusterConfigError, match=rf"^{where}, line 4: 'node' given twice$"):
        load_cluster_config(bad)
    bad.write_text("api: {port: 9000, port: 9001}\n")
    with pytest.raises(ClusterConfigError, match=rf"^{where}, line 1: 'port' given twice$"):
        load_cluster_config(bad)
    bad.write_text("")
    assert load_cluster_config(bad) == ClusterConfig()
    with pytest.raises(FileNotFoundError):
        load_cluster_config(tmp_path / "missing.yaml")


def test_overlay_puts_flags_over_the_file() -> None:
    cfg = parse_cluster_config({"name": "lab", "secret": "literal", "node": {"port": 6000},
                                "discovery": {"expect": 2, "interfaces": ["en0"]}, "api": {"port": 9000}})
    out = overlay(cfg, {"name": "lab2", "discovery.expect": 4, "discovery.interfaces": ["10.0.0.2"],
                        "nodes": ["10.0.0.9", "10.0.0.8:7000"], "api.port": None, "secret_env": "LAB_SECRET",
                        "node.max_memory_gib": 12})
    assert (out.name, out.discovery.expect, out.discovery.interfaces) == ("lab2", 4, ["10.0.0.2"])
    assert out.api.port == 9000 and out.node.port == 6000  # None: not given, the file's value stays
    # a bare static host takes this cluster's node port; a secret_env flag replaces the file's literal secret
    assert out.nodes == [StaticNode(host="10.0.0.9", port=6000), StaticNode(host="10.0.0.8", port=7000)]
    assert (out.secret, out.secret_env, out.node.max_memory_gib) == (None, "LAB_SECRET", 12.0)
    assert overlay(cfg, {"nodes": ["h"], "node.port": 7100}).nodes == [StaticNode(host="h", port=7100)]
    assert (cfg.name, cfg.secret, cfg.nodes) == ("lab", "literal", [])  # the input is left alone


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"api.port": 0}, r"api\.port: Input should be greater than or equal to 1 \(got 0\)$"),
        ({"mtp_depth": 9}, r"mtp_depth: Input should be less than or equal to 8 \(got 9\)$"),
        ({"discovery.settle": "soon"}, r"discovery\.settle: Input should be a valid number"),
        ({"nodes": ["h:99999"]}, r"nodes\[0\]: 'h:99999': '99999' is not a TCP port$"),
        ({"api.prot": 1}, rf"api\.prot: unknown key \(known: {KNOWN_API}\)$"),
        ({"dtype": "fp8"}, r"dtype: Input should be 'float32', 'float16' or 'bfloat16'"),
    ],
)
def test_overlay_refuses_bad_values_like_the_file(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ClusterConfigError, match="^command line: " + message):
        overlay(ClusterConfig(), flags)


def _launch_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *argv])


def test_flags_override_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: lab\ndiscovery: {expect: 2, interfaces: [en0]}\napi: {port: 9000}\nnode: {port: 6000}\n"
                    "draft_vocab: 1000\nmtp_window: 512\n")
    monkeypatch.chdir(tmp_path)  # no ./cluster.yaml here
    monkeypatch.delenv("MTPIPE_CONFIG", raising=False)
    cfg = resolve_config(_launch_args("--config", str(path), "--cluster", "lab2", "--expect", "4", "--interface",
                                      "10.0.0.2", "--api-port", "9100", "--node", "10.0.0.9", "--max-memory", "12",
                                      "--mtp-depth", "3", "--dtype", "float16", "--settle", "0.5", "--mtp-window", "64",
                                      "--prefix-cache", "0"))
    assert (cfg.name, cfg.discovery.expect, cfg.discovery.interfaces, cfg.api.port) == ("lab2", 4, ["10.0.0.2"], 9100)
    assert cfg.nodes == [StaticNode(host="10.0.0.9", port=6000)] and cfg.node.max_memory_gib == 12.0
    assert (cfg.mtp_depth, cfg.dtype, cfg.discovery.settle, cfg.node.port) == (3, "float16", 0.5, 6000)
    assert cfg.drafting() == {"draft_vocab": 1000, "mtp_window": 64}  # the file's, and the flag's over it
    assert cfg.prefix_cache() == 0  # (0: none kept)
    assert resolve_config(_launch_args("--config", str(path))) == load_cluster_config(path)
    assert resolve_config(_launch_args()) == ClusterConfig()
    monkeypatch.setenv("MTPIPE_CONFIG", str(path))
    assert resolve_config(_launch_args()).name == "lab"
    assert resolve_config(_launch_args("--secret-env", "LAB_SECRET")).secret_env == "LAB_SECRET"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--api-port", "0"], r"api\.port: Input should be greater than or equal to 1 \(got 0\)$"),
        (["--port", "70000"], r"node\.port: Input should be less than or equal to 65535"),
        (["--settle", "-1"], r"discovery\.settle: Input should be greater than or equal to 0"),
        (["--expect", "0"], r"discovery\.expect: Input should be greater than or equal to 1"),
        (["--max-memory", "0"], r"node\.max_memory_gib: Input should be greater than 0"),
        (["--node", "h:x"], r"nodes\[0\]: 'h:x': 'x' is not a TCP port$"),
        (["--cluster", ""], r"name: must not be empty$"),
        (["--prefix-cache", "-1"], r"prefix_cache_gib: Input should be greater than or equal to 0"),
    ],
)
def test_a_bad_flag_is_refused_clearly(argv: list[str], message: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MTPIPE_CONFIG", raising=False)
    with pytest.raises(ClusterConfigError, match="^command line: " + message):
        resolve_config(_launch_args(*argv))


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
    assert discovery_addresses(["fe80::1%en0", "::1"], ifaces) == ["fe80::1", "::1"]  # zeroconf: unscoped
    with pytest.raises(ValueError, match="neither an address nor an interface"):
        discovery_addresses(["en9"], ifaces)
    with pytest.raises(ValueError, match="10.99.9.9: not an address of this machine"):  # (zeroconf: "No such device")
        discovery_addresses(["10.99.9.9"], ifaces)
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
    with pytest.raises(ValueError, match="node c3 coordinates this cluster too"):  # (two: neither may)
        elect_coordinator("b2", peers, forced=True)
    assert elect_coordinator("c3", peers, forced=True) == "c3"
    assert elect_coordinator("b2", peers, forced=True, taking_over=True) == "b2"
    # Static nodes vote by their Ping: each machine alone on its multicast still agrees with the others.
    alone = {"b2": _ad("b2")}
    assert elect_coordinator("b2", alone, listed={"a1": False, "b2": False}) == "a1"
    assert elect_coordinator("a1", {"a1": _ad("a1")}, listed={"a1": False, "b2": False}) == "a1"
    assert elect_coordinator("a1", {"a1": _ad("a1")}, listed={"b2": True}) == "b2"
    # The model on some machines only: one of them coordinates (and serves the others their shards).
    without = {"a1": replace(_ad("a1"), has_model=False), "b2": _ad("b2"), "c3": _ad("c3")}
    assert [elect_coordinator(me, without) for me in without] == ["b2"] * 3
    nobody = {n: replace(ad, has_model=False) for n, ad in without.items()}  # (each fetches it from the hub)
    assert [elect_coordinator(me, nobody) for me in nobody] == ["a1"] * 3


def test_static_nodes_and_reachability(monkeypatch: pytest.MonkeyPatch) -> None:
    """Static nodes are asked for their id and memory; a hop address must answer as the right node."""
    from mtpipe.coordinator.cluster import formation
    from mtpipe.coordinator.cluster.formation import static_resources
    from mtpipe.coordinator.cluster.health import first_reachable, probe_node
    from mtpipe.node.server import NodeServer

    server = NodeServer("127.0.0.1", 0, node_id="static-1", secret="s3").start()
    try:
        listed = [StaticNode(host="127.0.0.1", port=1), StaticNode(host="127.0.0.1", port=server.port)]
        assert formation.static_flags(listed, "s3", wait=0.2) == {"static-1": False}  # (port 1: nobody, left out)
        server.service.coordinating = True
        assert formation.static_flags(listed[1:], "s3", wait=0.0) == {"static-1": True}
        (res,) = static_resources([StaticNode(host="127.0.0.1", port=server.port)], "s3", reserve=2**20)
        assert (res.node_id, res.port, res.addresses, res.interfaces) == ("static-1", server.port, ("127.0.0.1",), ())
        assert res.available > 0
        other = NodeServer("127.0.0.1", 0, node_id="static-2", secret="s3").start()
        try:  # (two nodes of one machine share what it has free)
            pair = static_resources([StaticNode(host="127.0.0.1", port=p) for p in (server.port, other.port)], "s3",
                                    reserve=0)
            assert [r.node_id for r in pair] == ["static-1", "static-2"]
            assert sum(r.available for r in pair) == pytest.approx(res.available + 2**20, rel=0.2)
        finally:
            other.stop()
        target = f"127.0.0.1:{server.port}"
        reached = first_reachable(["127.0.0.1:1", target], "s3", "static-1", timeout=2.0)
        assert reached.target == target and reached.node_id == "static-1" and reached.rtt_ms > 0
        assert first_reachable([target], "s3", "another-node", timeout=2.0) is None  # answers, but as someone else
        assert first_reachable([target], "wrong", None, timeout=2.0) is None  # refused: the TLS handshake fails
        row = probe_node(target, "s3")
        assert (row["status"], row["problems"], row["node_id"]) == ("idle", [], "static-1")  # waits for a placement
        with pytest.raises(ValueError, match="are the same node .static-1.: list each machine once"):
            static_resources([StaticNode(host="127.0.0.1", port=server.port)] * 2, "s3", reserve=0)
        with pytest.raises(ConnectionError, match="static node 127.0.0.1"):  # no TLS: never connects
            static_resources([StaticNode(host="127.0.0.1", port=server.port)], None, reserve=0, timeout=1.0)
        # A launch goes on without a listed node that does not answer (as without one it did not discover).
        both = parse_cluster_config({"nodes": ["127.0.0.1:1", f"127.0.0.1:{server.port}"], "secret": "s3"})
        assert list(formation.static_nodes(both, "s3", "static-1", [], timeout=1.0)) == ["static-1"]
        # Listed, and answering with this node's id: this machine (here), else a clone of its state directory.
        cfg = parse_cluster_config({"nodes": [f"127.0.0.1:{server.port}"], "secret": "s3"})
        assert list(formation.static_nodes(cfg, "s3", "static-1", [])) == ["static-1"]
        monkeypatch.setattr(formation, "is_this_machine", lambda host, local: False)
        with pytest.raises(ValueError, match="answers with this node's id 'static-1': two machines share an id"):
            formation.static_nodes(cfg, "s3", "static-1", [])
    finally:
        server.stop()


def test_health_with_static_nodes_only_and_when_it_cannot_check(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With discovery off, `mtpipe health` probes the static nodes and browses nothing; when it cannot
    check at all it exits 3 (never 1 or 2, which a monitor reads as degraded or unreachable), with a
    JSON status "error"."""
    import json

    from mtpipe.coordinator.cli import health as cli_health
    from mtpipe.coordinator.cli.main import main
    from mtpipe.node.server import NodeServer

    def no_browsing(*args: object) -> None:
        raise AssertionError("zeroconf was started with discovery off")

    monkeypatch.setattr(cli_health, "ClusterAgent", no_browsing)
    monkeypatch.setenv("MTPIPE_SECRET", "s3")
    server = NodeServer("127.0.0.1", 0, node_id="static-1", secret="s3").start()
    try:
        config = tmp_path / "cluster.yaml"
        config.write_text(yaml.safe_dump({"discovery": {"enabled": False}, "nodes": [f"127.0.0.1:{server.port}"]}))
        assert main(["health", "--json", "--config", str(config)]) == 0  # idle: up, and no shard placed yet
        report = json.loads(capsys.readouterr().out)
        assert report["status"] == "idle" and [n["node_id"] for n in report["nodes"]] == ["static-1"]
    finally:
        server.stop()
    assert main(["health", "--json", "--secret-file", str(tmp_path / "missing"), "127.0.0.1:1"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "error" and "missing" in report["error"]


def test_this_machine_by_address_or_name() -> None:
    from mtpipe.coordinator.cluster.formation import is_this_machine

    eth = Interface("en0", LinkType.ETHERNET, ("192.168.1.20/24",))
    assert is_this_machine("127.0.0.1", []) and is_this_machine("localhost", []) and is_this_machine("::1", [])
    assert is_this_machine("192.168.1.20", [eth]) and not is_this_machine("192.168.1.21", [eth])
    assert not is_this_machine("no-such-host.invalid", [eth])


def test_health_shows_a_node_found_twice_once() -> None:
    from mtpipe.coordinator.cluster.health import distinct_nodes

    rows = [{"address": "10.0.0.1:1", "node_id": "node-a"}, {"address": "10.0.0.2:1", "node_id": "node-b"},
            {"address": "mac-b.local:1", "node_id": "node-b"}, {"address": "10.0.0.9:1", "node_id": None},
            {"address": "10.0.0.8:1", "node_id": None}]  # (unreachable: no id to tell them apart by)
    assert [r["address"] for r in distinct_nodes(rows)] == ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.9:1", "10.0.0.8:1"]


def test_a_config_holding_a_secret_that_others_can_read_is_warned_of(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cluster.yaml"
    for text, warned in (("secret: 's3cret-value'\n", True), ("api: {api_key: 'k3y-value'}\n", True),
                         ("secret_env: LAB_SECRET\n", False)):
        path.write_text(text)
        for mode, readable in ((0o644, True), (0o600, False)):
            path.chmod(mode)
            caplog.clear()
            load_cluster_config(path)
            assert ("can be read by other users" in caplog.text) == (warned and readable), (text, mode)
            assert "s3cret-value" not in caplog.text and "k3y-value" not in caplog.text


def test_expected_nodes_count_the_listed_ones_that_answer() -> None:
    """Without multicast between the machines, discovery sees this node alone: cluster.yaml's nodes that
    answer count toward `expect`, so the launch does not wait out `settle` for them."""
    import asyncio
    import time

    from mtpipe.coordinator.cluster.agent import wait_for_peers

    class Agent:  # discovery that sees nothing but this node
        def __init__(self) -> None:
            self.discovery = self
            self.waits = 0

        def peers(self) -> dict[str, NodeAdvert]:
            return {"a1": _ad("a1")}

        def wait_for(self, changed, timeout: float):
            self.waits += 1
            return asyncio.sleep(min(timeout, 0.01))

        def run(self, coro):
            return asyncio.run(coro)

    cfg = parse_cluster_config({"discovery": {"expect": 2, "settle": 30}})
    agent = Agent()
    start = time.monotonic()
    assert list(wait_for_peers(agent, "a1", cfg, False, lambda peers: peers, lambda: {"b2"})) == ["a1"]
    assert time.monotonic() - start < 5 and agent.waits == 0
    answered: set[str] = set()
    agent.wait_for = lambda changed, timeout: (answered.add("b2"), asyncio.sleep(0.01))[1]  # (answers later)
    assert list(wait_for_peers(agent, "a1", cfg, False, lambda peers: peers, lambda: answered)) == ["a1"]
    assert time.monotonic() - start < 5


def test_the_cluster_is_idle_only_when_every_node_is() -> None:
    """Nodes up with no shard placed yet wait for a coordinator (exit 0); a node without one beside
    nodes that serve is a gap in the pipeline (degraded) where a coordinator waits for it, unless the
    coordinator placed the model without it (a spare: back after the others took its layers); with no
    placement among the nodes (`serve --nodes`), an idle node no coordinator is subscribed to is a spare."""
    from mtpipe.coordinator.cluster.health import EXIT_CODES, overall

    def rows(*statuses: str, coordinators: int = 1) -> list[dict]:
        return [{"status": s, "coordinators": coordinators} for s in statuses]

    assert overall(rows("idle", "idle")) == "idle" and EXIT_CODES["idle"] == 0
    assert overall(rows("healthy", "idle")) == "degraded"
    assert overall([*rows("healthy"), *rows("idle", coordinators=0)]) == "healthy"
    assert overall(rows("healthy", "healthy")) == "healthy"
    assert overall(rows("idle", "unreachable")) == overall([]) == "unreachable"
    coordinator = {"node_id": "a", "status": "healthy", "placed": ["a", "b"]}
    placed, spare = {"node_id": "b", "status": "idle"}, {"node_id": "c", "status": "idle"}
    assert overall([coordinator, {**placed, "status": "healthy"}, spare]) == "healthy"
    assert overall([coordinator, placed, spare]) == "degraded"  # (b was placed, and holds nothing)
    # A node that hung and came back after the others took its layers holds its old shard: a spare too.
    from mtpipe.coordinator.cluster.health import mark_spares

    back = {"node_id": "c", "status": "degraded", "reachable": True, "layers": [5, 8],
            "problems": ["next stage 10.0.0.9:52700 unreachable"]}
    marked = mark_spares([coordinator, {**placed, "status": "healthy", "layers": [0, 8]}, back])
    assert marked[2] == {**back, "status": "idle", "spare": True, "problems": []} and marked[:2] == [
        coordinator, {**placed, "status": "healthy", "layers": [0, 8]}]
    assert overall(marked) == "healthy"
    assert mark_spares([back]) == [back]  # (no coordinator among them: nothing says it is not placed)


def test_a_placed_node_is_listed_missing_once() -> None:
    """A coordinator's placed members not among the rows are listed (unreachable), but not a member
    already there (by id, an unreachable one included) nor one left out (listed apart)."""
    from mtpipe.coordinator.cluster.health import missing_members

    rows = [{"node_id": "a", "status": "healthy", "placed": ["a", "b", "c", "d"]},
            {"node_id": "b", "address": "10.0.0.2:52700", "status": "unreachable"}]
    missing = missing_members(rows, {"d"})
    assert [(m["node_id"], m["status"]) for m in missing] == [("c", "unreachable")]
    assert missing_members([{"node_id": "a", "status": "healthy", "placed": None}]) == []


def test_layers_no_node_holds_are_listed_once_the_coordinator_is_gone() -> None:
    """With no coordinator among the rows (its placement went with it), the runs of a model's layers no
    node found holds are listed, unreachable: the node left, healthy on its own, serves nothing."""
    from mtpipe.coordinator.cluster.health import missing_layers, overall

    follower = {"node_id": "b", "address": "10.0.0.2:52700", "status": "healthy", "reachable": True,
                "model": "/m", "layers": [5, 8], "num_layers": 8}
    missing = missing_layers([follower])
    assert [(m["layers"], m["status"]) for m in missing] == [([0, 5], "unreachable")]
    assert overall([follower, *missing]) == "unreachable"
    middle = [{**follower, "layers": [0, 2]}, {**follower, "layers": [6, 8]}]
    assert [m["layers"] for m in missing_layers(middle)] == [[2, 6]]
    assert missing_layers([{**follower, "layers": [0, 5]}, follower]) == []  # (all held)
    assert missing_layers([{**follower, "placed": ["a", "b"]}]) == []  # (a coordinator: missing_members says)
    assert missing_layers([{"node_id": "c", "status": "idle", "layers": None}]) == []


def test_a_static_node_that_is_down_is_named_and_listed_once() -> None:
    """A cluster.yaml node that does not answer has no id of its own; the coordinator placed the model
    on it at that address, so the row takes that id and no second row says it is missing."""
    from mtpipe.coordinator.cluster.health import distinct_nodes, missing_members, name_placed

    coordinator = {"node_id": "a", "address": "10.0.0.1:52700", "status": "degraded", "placed": ["a", "b", "c"],
                   "placed_at": {"a": "10.0.0.1:52700", "b": "10.0.0.2:52700", "c": "10.0.0.3:52700"}}
    down = {"address": "10.0.0.2:52700", "status": "unreachable", "reachable": False}
    elsewhere = {"address": "10.0.0.9:52700", "status": "unreachable", "reachable": False}
    rows = distinct_nodes(name_placed([coordinator, down, elsewhere]))
    assert [r.get("node_id") for r in rows] == ["a", "b", None] and "node_id" not in down
    assert [(m["node_id"], m["address"]) for m in missing_members(rows)] == [("c", "10.0.0.3:52700")]


def test_the_coordinator_names_a_cluster_yaml_node_at_its_listed_address() -> None:
    """What the coordinator's Health says it placed where (`placed_at`): a node of cluster.yaml at the
    address listed there, even when discovery found it on a better link (the coordinator reaches it
    there), so that `mtpipe health` names that node's row when it is down; another where it is reached."""
    from mtpipe.coordinator.cluster.formation import Formation, placed_addresses
    from mtpipe.coordinator.cluster.placement import NodeResources, StagePlan

    plan = [StagePlan("a", 0, 4, 1, 1), StagePlan("b", 4, 8, 1, 1), StagePlan("c", 8, 12, 1, 1)]
    control = {"a": "127.0.0.1:52700", "b": "[fe80::2%bridge0]:52700", "c": "169.254.3.3:52701"}
    static = {"b": NodeResources("b", 1, (), 52700, ("mac-b.local",))}
    assert placed_addresses(Formation(plan, control, []), static) == {
        "a": "127.0.0.1:52700", "b": "mac-b.local:52700", "c": "169.254.3.3:52701"}


@pytest.mark.parametrize("given, origins", [('"*"', ["*"]), ("none", []), ("[]", []),
                                            ("http://a:3000,https://b", ["http://a:3000", "https://b"])])
def test_allowed_origins_in_the_file_as_on_the_command_line(given: str, origins: list[str], tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"api:\n  allowed_origins: {given}\n")
    assert load_cluster_config(path).api.allowed_origins == origins


def test_a_machine_alone_is_placed_as_one_of_several_would_be(dense_ckpt: Path) -> None:
    """`mtpipe launch` with no peers: its memory (less the reserve) must hold the model, and
    placement.layers may name only it, with every layer."""
    from mtpipe.coordinator.cluster.formation import check_alone
    from mtpipe.coordinator.cluster.placement import PlacementError

    GiB = 2**30
    ample, tiny = _ad("a1"), _ad("a1")
    ample, tiny = replace(ample, mem_available=8 * GiB), replace(tiny, mem_available=2 * GiB + 1000)
    cfg = ClusterConfig()
    check_alone(cfg, ample, dense_ckpt, mtp=True)
    with pytest.raises(PlacementError, match="GiB short"):
        check_alone(cfg, tiny, dense_ckpt, mtp=True)
    for layers, match in (({"b2": 2}, "names node b2"), ({"a1": 100}, "give 100 of")):
        with pytest.raises(PlacementError, match=match):
            check_alone(ClusterConfig.model_validate({"placement": {"layers": layers}}), ample, dense_ckpt, mtp=True)


def test_a_follower_whose_coordinator_is_gone_elects_again() -> None:
    """A follower asks its coordinator once a second; silent for `lost_after` seconds, it is gone, and the
    nodes answering elect another: one that is not this node is followed from then on (and is asked in
    turn), this node returns to coordinate. A coordinator that answers again in time is kept."""
    from mtpipe.coordinator.cluster.follow import follow

    now = [0.0]
    alive = {"c": [(0, 5), (12, 14)], "b": [(0, 31)]}  # answering between these times
    votes: list[float] = []
    followed: list[str] = []

    def answers(node_id: str) -> bool:
        return any(a <= now[0] < b for a, b in alive[node_id])

    def elect() -> str | None:
        votes.append(now[0])
        return "b" if now[0] < 30 else None if now[0] < 45 else "me"  # (None: no node there holds the model)

    def sleep(s: float) -> None:
        now[0] += s

    follow("me", "c", answers, elect, followed.append, lost_after=10.0, check_s=1.0, clock=lambda: now[0],
           sleep=sleep)
    # c silent 5-12 s (kept), then from 14 s: gone at 24 s, b elected and followed; b silent from 31 s: gone
    # at 41 s, but no node holds the model: b waited for, silent again to 52 s, this node elected then
    assert followed == ["b"] and len(votes) == 3
    assert 24 <= votes[0] < 25.5 and 41 <= votes[1] < 42.5 and 51 <= votes[2] < 53.5
    assert now[0] == pytest.approx(votes[2], abs=0.3)


def test_a_node_that_listens_counts_as_there_whatever_its_loop_does() -> None:
    """(A coordinator in a long step answers no Ping, but the kernel still takes its connections.)"""
    import socket

    from mtpipe.coordinator.cluster.follow import accepts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert accepts(f"127.0.0.1:{port}")  # (never accepted by anyone: the backlog takes it)
    assert not accepts(f"127.0.0.1:{port}")


def test_a_follower_elects_only_a_node_that_holds_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Among the members there now, one that holds the model; none: nobody (the coordinator is waited for,
    not replaced by a node that would fail to load it). A member that follows is no coordinator to wait for."""
    from types import SimpleNamespace

    from mtpipe.coordinator.cluster.follow import Watch
    from mtpipe.node.advertise import NodeAdvert

    def ad(node_id: str, has_model: bool, coordinator: bool = False) -> NodeAdvert:
        return NodeAdvert(node_id, "h", 1, 0, 0, "cpu", "v", coordinator=coordinator, has_model=has_model)

    peers: dict[str, NodeAdvert] = {}
    agent = SimpleNamespace(peers=lambda: dict(peers))
    membership = SimpleNamespace(members=lambda p: p)
    # (there, its Ping's answer): a follows, b coordinates, c is busy (no Ping answered, its port takes one)
    probed = {"a": (True, SimpleNamespace(coordinator=False)), "b": (True, SimpleNamespace(coordinator=True)),
              "c": (True, None)}
    monkeypatch.setattr(Watch, "_probe", lambda self, node_id: probed.get(node_id, (False, None)))
    me = ad("m", has_model=False)
    watch = Watch(me, agent, membership, [], [], None)
    peers.update(a=ad("a", has_model=False), c=ad("c", has_model=False))
    assert watch.elect() is None  # (no member there holds it; this node neither)
    peers["d"] = ad("d", has_model=True)  # (not there: gone)
    assert watch.elect() is None
    probed["d"] = (True, None)
    assert watch.elect() == "d"
    assert watch.coordinates("b") and not watch.coordinates("a") and watch.coordinates("c")  # (c busy: counts)


def test_two_coordinators_are_degraded_each_saying_so() -> None:
    """Two nodes each coordinating a placement of their own (a partition healed after the nodes on each
    side elected one): `mtpipe health` says so on both, and the cluster is degraded, not healthy."""
    from mtpipe.coordinator.cluster.health import mark_coordinators, overall

    a = {"address": "a:1", "node_id": "a", "status": "healthy", "problems": [], "placed": ["a", "c"]}
    b = {"address": "b:1", "node_id": "b", "status": "healthy", "problems": [], "placed": ["b"]}
    c = {"address": "c:1", "node_id": "c", "status": "healthy", "problems": []}
    assert mark_coordinators([a, c]) == [a, c] and overall([a, c]) == "healthy"
    marked = mark_coordinators([a, b, c])
    assert [r["status"] for r in marked] == ["degraded", "degraded", "healthy"] and overall(marked) == "degraded"
    assert "one of 2 coordinators (a, b)" in marked[0]["problems"][0]


def test_each_coordinators_term_is_named_and_health_reports_it() -> None:
    """(Which of the two the cluster follows: the newer term.) A node's Health says the newest term it saw."""
    from mtpipe.coordinator.cluster.health import mark_coordinators, probe_node
    from mtpipe.node.coordinators import Claim
    from mtpipe.node.server import NodeServer

    a = {"address": "a:1", "node_id": "a", "status": "healthy", "problems": [], "placed": ["a"], "term": 2}
    b = {"address": "b:1", "node_id": "b", "status": "healthy", "problems": [], "placed": ["b"], "term": 3}
    assert "one of 2 coordinators (a term 2, b term 3)" in mark_coordinators([a, b])[0]["problems"][0]
    node = NodeServer("127.0.0.1", 0).start()
    try:
        assert "term" in probe_node(node.address, None) and probe_node(node.address, None)["term"] is None
        node.service.coordinators.see(Claim(4, "node-z"))
        row = probe_node(node.address, None)
        assert (row["term"], row["term_holder"]) == (4, "node-z")
    finally:
        node.stop()
