"""Cluster subcommands (node, launch, serve, health). Filled in as those capabilities land."""

from __future__ import annotations

import argparse


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    """Register the cluster subcommands on the main parser."""
