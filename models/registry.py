"""Where models come from: a local directory, the bundled demo model, or the Hugging Face hub."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_MODEL = Path(__file__).parent / "demo"


def default_model_path() -> Path:
    """The bundled demo model; a tiny random checkpoint if this checkout has none."""
    if (DEMO_MODEL / "config.json").exists():
        return DEMO_MODEL
    from .tiny import build_tiny_checkpoint

    log.warning("bundled demo model not found at %s; using a tiny random checkpoint", DEMO_MODEL)
    return build_tiny_checkpoint()


def resolve_model(model: str | Path | None) -> Path:
    """A local path as is; otherwise a hub repo id, downloaded (for real users; tests never do)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if "/" in str(model) and not str(model).startswith((".", "/")):
        from huggingface_hub import snapshot_download

        log.info("downloading %s from the Hugging Face hub", model)
        return Path(
            snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"])
        )
    raise FileNotFoundError(f"model {model} not found")
