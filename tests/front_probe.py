"""What the API's own process loads, probed in a spawned process: a module of its own, importing nothing
at its top, because a spawned process imports the module of its target before running it."""

from __future__ import annotations

import sys
from typing import Any


def front_imports(conn: Any) -> None:
    """In a spawned process: what the front's preparation and imports load (see front_main)."""
    from mtpipe.coordinator.api.front import prepare_process

    prepare_process()
    from mtpipe.coordinator.api.app import create_app  # noqa: F401
    from mtpipe.coordinator.api.link import EngineClient  # noqa: F401
    from mtpipe.coordinator.engine.tokenizer import load_tokenizer

    load_tokenizer(conn.recv(), [])
    import mlx.core as mx

    conn.send(([m for m in ("torch", "mlx_lm.generate", "mlx_lm.sample_utils") if sys.modules.get(m)],
               mx.get_active_memory()))
