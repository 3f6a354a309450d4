"""`cluster.yaml`: what a cluster is called, what it serves, and how it forms.

Every field is optional; the top-level `cluster.yaml` of the repository documents each one. The
models are strict (no silent coercion) and refuse unknown keys, and every error names the file and
the key path, so a typo never passes silently. Command-line flags of `mtpipe launch` override the
file through `overlay`, which validates the result the same way.
"""

from __future__ import annotations

import logging
import os
import stat
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ...node.links import DEFAULT_PORT as DEFAULT_GRPC_PORT
from ...node.links import format_host_port, is_host, split_host_port
from ...node.secrets import read_secret
from ..api.defaults import API_KEY_ENV, check_origins
from ..api.defaults import DEFAULT_HOST as DEFAULT_API_HOST
from ..api.defaults import DEFAULT_PORT as DEFAULT_API_PORT

log = logging.getLogger(__name__)

DEFAULT_SECRET_ENV = "MTPIPE_SECRET"
DTYPES = ("float32", "float16", "bfloat16")


class ClusterConfigError(ValueError):
    pass


def _number_to_str(value: Any) -> Any:
    """YAML reads `secret: 123456` or `name: 42` as numbers; they are meant as text."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _secret_text(value: Any) -> Any:
    """A secret YAML reads as a number may not be what was written (`0123` is 83): it must be quoted."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError("YAML reads this secret as a number, maybe not what was written: quote it")
    return value


def _key_to_str(value: Any) -> Any:
    """Mapping keys (node ids) are text even when YAML reads them as numbers."""
    return value if isinstance(value, str) else str(value)


Text = Annotated[str, BeforeValidator(_number_to_str)]
SecretText = Annotated[str, BeforeValidator(_secret_text)]
Key = Annotated[str, BeforeValidator(_key_to_str)]
Port = Annotated[int, Field(ge=1, le=65535)]
Dtype = Literal["float32", "float16", "bfloat16"]


class _Section(BaseModel):
    # strict: an int is still accepted for a float (YAML `settle: 10`), but never "10" for an int or
    # 1.0 for an int; validate_assignment: a later `cfg.api.port = 0` is refused too.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)


class StaticNode(_Section):
    """A node given by address rather than discovered: "host", "host:port", "[v6]:port" or a mapping."""

    host: Text = Field(min_length=1)
    port: Port = DEFAULT_GRPC_PORT

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, str):
            return data
        # In the file a bare host means the default node port; on the command line, node.port.
        host, port = split_host_port(data, (info.context or {}).get("node_port", DEFAULT_GRPC_PORT))
        return {"host": host, "port": port}

    @field_validator("host")
    @classmethod
    def _a_host(cls, host: str) -> str:
        if host and not is_host(host):
            raise ValueError(f"{host!r} is neither an IP address nor a host name")
        return host

    @property
    def address(self) -> str:
        return format_host_port(self.host, self.port)


class DiscoveryConfig(_Section):
    enabled: bool = True
    interfaces: list[Text] = Field(default_factory=list)  # names (en0, bridge0) or addresses
    expect: int | None = Field(None, ge=1)  # nodes to wait for, this one included
    # seconds: with `expect`, the most to wait; without, quiet time after the last join (0: do not wait)
    settle: float = Field(5.0, ge=0)


class PlacementConfig(_Section):
    layers: dict[Key, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)  # node id or static host -> layers
    reserve_gib: float = Field(2.0, ge=0)  # memory kept free on every node for caches and the OS
    # seconds a node of the pipeline may stay lost before the others take its layers (null: never)
    heal_after_s: float | None = Field(10.0, ge=0)


class ApiConfig(_Section):
    host: Text = DEFAULT_API_HOST
    port: Port = DEFAULT_API_PORT
    api_key: Text | None = None
    api_key_env: Text | None = API_KEY_ENV
    # The request defaults: the model's, none (OpenAI's), or a directory's, checked on the coordinator
    # alone (`mtpipe launch`): the others never serve the API, and may not have that directory.
    generation_config: Text = "auto"
    # The max_tokens of a request that leaves it out (None: the generation config's, else 32768).
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # Web pages that may call the API from a browser (CORS): "*" any, [] only the API's own origin.
    allowed_origins: list[Text] = Field(default_factory=lambda: ["*"])
    # How waiting requests are ordered: first come, first served, or by their `priority` (lower first).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # A chat template in place of the model's (a file, or the template), and the variables every prompt gets
    # unless its request sets them; checked on the coordinator alone, against the model's tokenizer.
    chat_template: Text | None = None
    chat_template_args: dict[str, Any] | None = None
    # HTTPS: a certificate (chain) and its private key, PEM files on the coordinator.
    ssl_certfile: Text | None = None
    ssl_keyfile: Text | None = None

    @field_validator("chat_template_args")
    @classmethod
    def _template_args(cls, value: Any) -> Any:  # (what the file alone says: refused before anything starts)
        from ..api.templates import template_args

        try:
            return None if value is None else template_args(value, "")
        except ValueError as e:
            raise ValueError(str(e).lstrip()) from None

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _origins(cls, value: Any) -> Any:  # (a list, or as on the command line: "*", "none", "a,b")
        return check_origins(value) if isinstance(value, (str, list)) and all(
            isinstance(o, str) for o in ([value] if isinstance(value, str) else value)) else value


class NodeConfig(_Section):
    host: Text = "0.0.0.0"  # where the gRPC server listens ("::" for IPv6 link-local hops too)
    port: Port = DEFAULT_GRPC_PORT
    state_dir: Text | None = None  # default $MTPIPE_STATE_DIR or ~/.mtpipe
    max_memory_gib: float | None = Field(None, gt=0)  # offer at most this much memory, whatever is free
    model_dirs: list[Text] = Field(default_factory=list)  # where it may load models from (node/model_dirs.py)
    download: bool = False  # may take its shard's files from the hub when no node can send them (node/hub.py)


class ClusterConfig(_Section):
    name: Text = "default"
    secret: SecretText | None = None
    secret_file: Text | None = None  # a file holding the secret (kept out of cluster.yaml and argv)
    secret_env: Text | None = DEFAULT_SECRET_ENV
    model: Text | None = None
    revision: Text | None = None  # a hub repo id's branch, tag or commit (None: main)
    dtype: Dtype | None = None  # cast weights on load
    mtp_depth: Annotated[int, Field(ge=0, le=8)] | None = None  # None ("auto"): picked per round with an MTP head
    # How the last stage drafts (models/draft_vocab.py, models/mtp.py); None: the stage's default, 0: no limit
    draft_vocab: Annotated[int, Field(ge=0)] | None = None
    mtp_window: Annotated[int, Field(ge=0)] | None = None
    # GiB of prompt prefixes kept (engine/kept.py over nodes, engine/batch.py alone); None: the default, 0: none
    prefix_cache_gib: Annotated[float, Field(ge=0)] | None = None
    nodes: list[StaticNode] = Field(default_factory=list)
    node: NodeConfig = Field(default_factory=NodeConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)

    def prefix_cache(self) -> int | None:
        """Bytes of kept prompt prefixes (None: the engine's default)."""
        return None if self.prefix_cache_gib is None else int(self.prefix_cache_gib * 2**30)

    def drafting(self) -> dict[str, int]:
        """The drafting options given (a node's `draft_vocab` and `mtp_window` keywords)."""
        return {k: v for k, v in (("draft_vocab", self.draft_vocab), ("mtp_window", self.mtp_window)) if v is not None}

    @field_validator("name")
    @classmethod
    def _name_not_blank(cls, name: str) -> str:
        if not name.strip():
            raise ValueError("must not be empty")
        return name

    @model_validator(mode="after")
    def _one_secret_source(self) -> ClusterConfig:
        # secret_env defaults to MTPIPE_SECRET, so only an explicitly different one conflicts
        if self.secret and self.secret_env and self.secret_env != DEFAULT_SECRET_ENV:
            raise ValueError("give either secret or secret_env, not both")
        if self.secret and self.secret_file:
            raise ValueError("give either secret or secret_file, not both")
        return self

    def resolve_secret(self) -> str | None:
        """The literal secret, else the one in `secret_file`, else in the environment variable `secret_env`."""
        if self.secret:
            return self.secret
        if self.secret_file is not None:
            return read_secret(self.secret_file, env=None, option="--secret-file (cluster.yaml secret_file)")
        return os.environ.get(self.secret_env) if self.secret_env else None

    def resolve_api_key(self) -> str | None:
        if self.api.api_key:
            return self.api.api_key
        return os.environ.get(self.api.api_key_env) if self.api.api_key_env else None

    @field_validator("mtp_depth", mode="before")
    @classmethod
    def _auto_depth(cls, value: Any) -> Any:
        return None if value == "auto" else value


def _known_keys(loc: tuple[int | str, ...]) -> list[str]:
    """The keys allowed where `loc` points, for the unknown-key message."""
    model: type[BaseModel] | None = ClusterConfig
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        candidates = (annotation, *typing.get_args(annotation))
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return list(model.model_fields) if model is not None else []


def _describe(error: ValidationError, source: str) -> str:
    """One line per problem: `source: key.path[0]: what is wrong (got value)`."""
    lines = []
    for err in error.errors(include_url=False):
        loc = err["loc"]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        if err["type"] == "extra_forbidden":
            message = f"unknown key (known: {', '.join(_known_keys(loc[:-1]))})"
        elif err["type"] == "value_error":
            message = err["msg"].removeprefix("Value error, ")
        else:
            message = err["msg"]
            if err.get("input") is None or isinstance(err["input"], (str, int, float, bool)):
                message += f" (got {err['input']!r})"
        lines.append(": ".join(part for part in (source, path, message) if part))
    return "\n".join(lines)


def _validate(data: Any, source: str, node_port: int = DEFAULT_GRPC_PORT) -> ClusterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ClusterConfigError(f"{source} must be a mapping at the top level, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data, context={"node_port": node_port})
    except ValidationError as e:
        raise ClusterConfigError(_describe(e, source)) from None


def parse_cluster_config(data: Any, source: str = "cluster.yaml") -> ClusterConfig:
    """Plain data (a parsed cluster.yaml) -> a validated config; errors start with `source`."""
    return _validate(data, source)


def load_cluster_config(path: Path | str) -> ClusterConfig:
    import yaml

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"cluster config {path} not found")
    class Twice(yaml.MarkedYAMLError):
        pass

    class Loader(yaml.SafeLoader):
        """YAML would let a later key replace an earlier one silently (a section given twice, half lost)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise Twice(problem=f"{key!r} given twice", problem_mark=key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ClusterConfigError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise ClusterConfigError(f"{path}: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader
    except Twice as e:
        raise ClusterConfigError(f"{path}, line {e.problem_mark.line + 1}: {e.problem}") from None
    except yaml.MarkedYAMLError as e:
        where = f", line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise ClusterConfigError(f"{path}{where}: not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ClusterConfigError(f"{path}: not valid YAML: {e}") from None
    cfg = _validate(data, str(path))
    if (cfg.secret or cfg.api.api_key) and os.name == "posix" and path.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s holds a secret and can be read by other users (chmod 600 it)", path)
    return cfg


def overlay(cfg: ClusterConfig, flags: Mapping[str, Any], source: str = "command line") -> ClusterConfig:
    """`cfg` with `flags` on top, validated like the file: keys are dotted paths ("api.port"), None
    means "not given". Static nodes given as "host[:port]" default to the resulting node.port, and a
    `secret_env` or `secret_file` given here replaces the file's other sources of the secret."""
    data = cfg.model_dump()
    for path, value in flags.items():
        if value is None:
            continue
        *sections, key = path.split(".")
        target = data
        for section in sections:
            target = target.setdefault(section, {})
        target[key] = value
    if flags.get("secret_env") is not None:
        data["secret"] = data["secret_file"] = None
    if flags.get("secret_file") is not None:
        data["secret"] = None
    port = data.get("node", {}).get("port")
    return _validate(data, source, port if type(port) is int else DEFAULT_GRPC_PORT)
