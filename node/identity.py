"""A node's persistent identity: an id kept in a state directory, stable across restarts.

The state directory is `$MTPIPE_STATE_DIR`, else `~/.mtpipe`. The id is created once, on first use,
and written atomically so two processes starting together agree on it.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

STATE_ENV = "MTPIPE_STATE_DIR"
NODE_ID_FILE = "node_id"
_VALID_ID = re.compile(r"^[0-9a-z][0-9a-z-]{3,62}$")


def is_node_id(value: str) -> bool:
    """A node id as `persistent_id` keeps them: a DNS label (adverts carry it in a service name)."""
    return _VALID_ID.match(value) is not None


def state_dir(path: Path | str | None = None) -> Path:
    """The state directory: `path`, else $MTPIPE_STATE_DIR, else ~/.mtpipe."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get(STATE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".mtpipe"


def node_id(path: Path | str | None = None) -> str:
    """This node's id (12 hex digits), created on first use and kept in the state directory."""
    directory = state_dir(path)
    if directory.exists() and not directory.is_dir():  # (a usage error, not an errno of mkdir's)
        raise ValueError(f"the state directory {directory} (--state-dir, node.state_dir) is a file, not a directory")
    file = directory / NODE_ID_FILE
    if file.exists():
        value = file.read_text().strip()
        if not is_node_id(value):
            raise ValueError(f"{file} holds {value!r}, not a node id; delete the file to make a new one")
        return value
    directory.mkdir(parents=True, exist_ok=True)
    value = uuid.uuid4().hex[:12]
    tmp = directory / f".{NODE_ID_FILE}.{os.getpid()}"
    tmp.write_text(value + "\n")
    try:
        os.link(tmp, file)  # fails if another process won the race: then its id is the id
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    value = file.read_text().strip()
    log.info("node id %s (kept in %s)", value, file)
    return value
