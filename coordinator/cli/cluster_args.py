"""What the cluster's commands (`launch`, `health`) share: cluster.yaml with the command line on top."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ...node.secrets import add_secret_args, read_secret
from ..cluster.config import ClusterConfig, load_cluster_config, overlay

CONFIG_ENV = "MTPIPE_CONFIG"


def resolve_config(args: argparse.Namespace) -> ClusterConfig:
    """cluster.yaml (--config, $MTPIPE_CONFIG, or ./cluster.yaml if present) with flags on top."""
    path = args.config or os.environ.get(CONFIG_ENV) or ("cluster.yaml" if Path("cluster.yaml").exists() else None)
    cfg = load_cluster_config(path) if path else ClusterConfig()
    flags = {  # config key -> argparse dest; a flag not given, or not defined for this subcommand, is None
        "name": "cluster", "model": "model", "revision": "revision", "dtype": "dtype", "mtp_depth": "mtp_depth",
        "secret_env": "secret_env", "secret_file": "secret_file", "draft_vocab": "draft_vocab",
        "mtp_window": "mtp_window", "prefix_cache_gib": "prefix_cache",
        "discovery.interfaces": "interface", "discovery.expect": "expect", "discovery.settle": "settle",
        "nodes": "node", "node.host": "host", "node.port": "port", "node.state_dir": "state_dir",
        "node.max_memory_gib": "max_memory", "node.model_dirs": "model_dir", "node.download": "download",
        "api.host": "api_host", "api.port": "api_port", "api.generation_config": "generation_config",
        "api.allowed_origins": "allowed_origins", "api.max_tokens": "default_max_tokens",
        "api.scheduling_policy": "scheduling_policy", "api.chat_template": "chat_template",
        "api.chat_template_args": "chat_template_args", "api.ssl_certfile": "ssl_certfile",
        "api.ssl_keyfile": "ssl_keyfile",
    }
    values = {key: getattr(args, dest, None) for key, dest in flags.items()}
    if getattr(args, "api_key_file", None) is not None:
        values["api.api_key"] = read_secret(args.api_key_file, env=None, option="--api-key-file")
    return overlay(cfg, values)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help=f"cluster.yaml (default: ${CONFIG_ENV}, else ./cluster.yaml if present)")
    p.add_argument("--cluster", help="cluster name (overrides cluster.yaml)")
    p.add_argument("--secret-env", help="environment variable holding the cluster secret (default MTPIPE_SECRET)")
    add_secret_args(p, "the cluster secret")
    p.add_argument("--interface", action="append",
                   help="discover on this interface name or address (repeatable; default: Ethernet and Wi-Fi, "
                        "else Thunderbolt)")
