"""Cluster subcommands: node (a stage daemon), serve (the REST API), launch and health."""

from __future__ import annotations

import argparse

from ...node.server import add_node_command
from ..api.serve import add_serve_command
from ..cluster.launch import add_launch_commands


def add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    """Register the cluster subcommands on the main parser."""
    add_node_command(sub)
    add_serve_command(sub)
    add_launch_commands(sub)
