"""Where secrets come from: a file (`--secret-file`, `--api-key-file`) or the environment, never argv.

A secret on a command line shows in `ps` and in shell history, so `--secret` and `--api-key` are
refused with the alternatives. Every command that talks to nodes reads the secret the same way.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import stat
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SECRET_ENV = "MTPIPE_SECRET"
ON_ARGV = "a secret on the command line shows in `ps` and in shell history: put it in a file"


class _RefuseOnArgv(argparse.Action):
    """An option that would put a secret on the command line: refused, saying where it goes instead."""

    def __init__(self, *args: Any, instead: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        parser.error(f"{option}: {ON_ARGV} {self.instead}")


def add_secret_args(p: argparse.ArgumentParser, what: str = "the nodes' shared secret") -> None:
    add_secret_file(p, "--secret", what, SECRET_ENV)


def add_secret_file(p: argparse.ArgumentParser, option: str, what: str, env: str) -> None:
    """`OPTION-file PATH` for a secret, and `OPTION` itself refused (the secret would show in `ps`)."""
    p.add_argument(f"{option}-file", metavar="PATH", help=f"a file holding {what} (default: ${env})")
    p.add_argument(option, nargs="?", action=_RefuseOnArgv, instead=f"({option}-file PATH) or in ${env}",
                   help=argparse.SUPPRESS)


SHORT_SECRET_CHARS = 16  # shorter secrets are warned about (`openssl rand -hex 32` gives 64)


def read_secret(path: str | None = None, env: str | None = SECRET_ENV, option: str = "--secret-file") -> str | None:
    """The secret in `path` (surrounding whitespace dropped), else in $env; None when neither has one.
    `option` names the path in errors. An empty path is an error, never "no secret": it is what a
    script's unset variable gives."""
    if path is not None:
        if not path.strip():
            raise ValueError(f"{option}: the path is empty")
        file = Path(path).expanduser()
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"{option} {path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{option} {path}: not UTF-8 text") from None
        if not text.strip():
            raise ValueError(f"{option} {path}: the file is empty")
        if os.name == "posix" and file.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("%s can be read by other users (chmod 600 it)", path)
        return text.strip()
    return (os.environ.get(env) or None) if env else None


def is_loopback(host: str) -> bool:
    """Whether `host` (an address to bind) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, secret: str | None, insecure: bool) -> None:
    """A node without a secret listens on loopback only, unless told `--insecure`; a short secret on a
    network gets a warning (anyone who reaches the node can try guesses offline)."""
    if secret and len(secret) < SHORT_SECRET_CHARS and not is_loopback(host):
        log.warning("the cluster secret is %d characters: anyone who reaches this node can fetch its certificate and "
                    "guess a short secret offline; use a long random one (openssl rand -hex 32)", len(secret))
    if secret or insecure or is_loopback(host):
        return
    raise ValueError(f"refusing to listen on {host} without a cluster secret: anyone who reaches it could load "
                     f"files and read hidden states. Give one (--secret-file PATH or ${SECRET_ENV}), listen on "
                     "127.0.0.1, or pass --insecure on a network you trust")
