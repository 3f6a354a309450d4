"""`cluster.yaml`: what a cluster is called, what it serves, and how it forms.

Every field is optional; the top-level `cluster.yaml` of the repository documents each one. Unknown
keys and wrong types are errors that name the offending key, so a typo never passes silently.
Command-line flags of `mtpipe launch` override the file.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...node.links import format_host_port, split_host_port
from ...node.server import DEFAULT_PORT as DEFAULT_GRPC_PORT
from ..api.app import API_KEY_ENV
from ..api.app import DEFAULT_HOST as DEFAULT_API_HOST
from ..api.app import DEFAULT_PORT as DEFAULT_API_PORT

DEFAULT_SECRET_ENV = "MTPIPE_SECRET"


class ClusterConfigError(ValueError):
    pass


@dataclass
class StaticNode:
    host: str
    port: int = DEFAULT_GRPC_PORT

    @property
    def address(self) -> str:
        return format_host_port(self.host, self.port)


@dataclass
class DiscoveryConfig:
    enabled: bool = True
    interfaces: list[str] = field(default_factory=list)  # names (en0, bridge0) or addresses
    expect: int | None = None  # nodes to wait for, this one included
    settle: float = 5.0  # seconds: with `expect`, the most to wait; without, quiet time after the last join


@dataclass
class PlacementConfig:
    layers: dict[str, int] = field(default_factory=dict)  # node id (or static host) -> layer count
    reserve_gib: float = 2.0  # memory kept free on every node for caches and the OS


@dataclass
class ApiConfig:
    host: str = DEFAULT_API_HOST
    port: int = DEFAULT_API_PORT
    api_key: str | None = None
    api_key_env: str | None = API_KEY_ENV


@dataclass
class NodeConfig:
    host: str = "0.0.0.0"  # where the gRPC server listens ("::" for IPv6 link-local hops too)
    port: int = DEFAULT_GRPC_PORT
    state_dir: str | None = None  # default $MTPIPE_STATE_DIR or ~/.mtpipe
    max_memory_gib: float | None = None  # offer at most this much memory, whatever is free


@dataclass
class ClusterConfig:
    name: str = "default"
    secret: str | None = None
    secret_env: str | None = DEFAULT_SECRET_ENV
    model: str | None = None
    dtype: str | None = None  # cast weights on load: float32, float16, bfloat16
    mtp_depth: int | None = None  # None: 2 when the model has an MTP head
    nodes: list[StaticNode] = field(default_factory=list)
    node: NodeConfig = field(default_factory=NodeConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    api: ApiConfig = field(default_factory=ApiConfig)

    def resolve_secret(self) -> str | None:
        """The literal secret, else the one in the environment variable `secret_env`."""
        if self.secret:
            return self.secret
        return os.environ.get(self.secret_env) if self.secret_env else None

    def resolve_api_key(self) -> str | None:
        if self.api.api_key:
            return self.api.api_key
        return os.environ.get(self.api.api_key_env) if self.api.api_key_env else None


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str) and tp is StaticNode:  # "host", "host:port", "[v6]:port"
            try:
                host, port = split_host_port(value, DEFAULT_GRPC_PORT)
            except ValueError as e:
                raise ClusterConfigError(f"{where}: {e}") from e
            value = {"host": host, "port": port}
        if not isinstance(value, dict):
            raise ClusterConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ClusterConfigError(f"{where}: expected a list, got {value!r}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ClusterConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): _convert(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ClusterConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ClusterConfigError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(names)})")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ClusterConfigError(f"{where or 'cluster.yaml'}: {e}") from e


def validate(config: ClusterConfig) -> ClusterConfig:
    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ClusterConfigError(message)

    check(bool(config.name.strip()), "name: must not be empty")
    for key, port in (("node.port", config.node.port), ("api.port", config.api.port)):
        check(0 < port < 65536, f"{key}: {port} is not a TCP port")
    for i, n in enumerate(config.nodes):
        check(0 < n.port < 65536, f"nodes[{i}].port: {n.port} is not a TCP port")
        check(bool(n.host), f"nodes[{i}].host: must not be empty")
    check(config.dtype in (None, "float32", "float16", "bfloat16"),
          f"dtype: {config.dtype!r} is not one of float32, float16, bfloat16")
    check(config.node.max_memory_gib is None or config.node.max_memory_gib > 0, "node.max_memory_gib: must be > 0")
    check(config.mtp_depth is None or 0 <= config.mtp_depth <= 8, f"mtp_depth: {config.mtp_depth} is not in 0..8")
    check(config.discovery.expect is None or config.discovery.expect >= 1, "discovery.expect: must be at least 1")
    check(config.discovery.settle >= 0, "discovery.settle: must be >= 0")
    check(config.placement.reserve_gib >= 0, "placement.reserve_gib: must be >= 0")
    for node, layers in config.placement.layers.items():
        check(layers >= 1, f"placement.layers.{node}: {layers} layers; every stage holds at least one")
    check(not (config.secret and config.secret_env and config.secret_env != DEFAULT_SECRET_ENV),
          "give either secret or secret_env, not both")
    return config


def parse_cluster_config(data: dict[str, Any] | None) -> ClusterConfig:
    if data is None:
        return ClusterConfig()
    if not isinstance(data, dict):
        raise ClusterConfigError(f"cluster.yaml must be a mapping at the top level, got {type(data).__name__}")
    return validate(_build(ClusterConfig, data, ""))


def load_cluster_config(path: Path | str) -> ClusterConfig:
    import yaml

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"cluster config {path} not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ClusterConfigError(f"{path}: not valid YAML: {e}") from e
    try:
        return parse_cluster_config(data)
    except ClusterConfigError as e:
        raise ClusterConfigError(f"{path}: {e}") from e
