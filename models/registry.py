"""Where models come from: a local directory, the bundled demo model, or the Hugging Face hub."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .fingerprint import missing_files

log = logging.getLogger(__name__)

DEMO_MODEL = Path(__file__).parent / "demo"


def default_model_path() -> Path:
    """The bundled demo model. Missing, it is an error that says how to get it: a random model
    standing in for it would answer with noise and look like a bug."""
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (DEMO_MODEL / f).exists()]
    if missing:
        raise FileNotFoundError(
            f"the bundled demo model is incomplete at {DEMO_MODEL} (missing {', '.join(missing)}): install mtpipe "
            "from a full checkout of its repository (`pip install -e .`), retrain it "
            "(models/demo/README.md has the command), or pass --model PATH"
        )
    return DEMO_MODEL


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]  # what a model needs of its repo
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_repo_id(model: str | Path) -> str | None:
    """`model` as a hub repo id (owner/name), or None when it cannot be one (`~/x`, `./x`, `a/b/c`, `x/`)."""
    text = str(model)
    return text if _REPO_ID.fullmatch(text) and not text.endswith((".", "-")) else None


def complete(path: Path) -> bool:
    """A model directory with its config and every weight file its index names (a download that
    stopped halfway leaves a snapshot without some)."""
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        return False
    try:
        return not missing_files(path)
    except ValueError:  # (an index that cannot be read: not a finished download)
        return False


def check_revision(model: str | Path | None, revision: str | None) -> None:
    """A revision (branch, tag or commit) names a version of a hub repo: with anything else it would
    be ignored, so it is refused."""
    if revision is None:
        return
    if not revision.strip():
        raise ValueError("the revision is empty")
    if model is None or Path(model).expanduser().exists() or hub_repo_id(model) is None:
        raise ValueError(f"a revision ({revision}) applies only to a Hugging Face repo id, not to "
                         f"{'the bundled demo model' if model is None else model}")


def local_model(model: str | Path | None, revision: str | None = None) -> Path | None:
    """The model's directory on this machine, if it has one, without downloading anything: a local
    path, the bundled demo model, or a hub repo id (at `revision`, else its main branch) whole in this
    machine's hub cache."""
    check_revision(model, revision)
    if model is None:
        return DEMO_MODEL if (DEMO_MODEL / "config.json").exists() else None
    path = Path(model).expanduser()
    if path.exists():
        return path if (path / "config.json").is_file() else None  # (an empty mount point holds no model)
    if repo := hub_repo_id(model):
        try:
            from huggingface_hub import snapshot_download

            snapshot = Path(snapshot_download(repo, revision=revision, local_files_only=True, allow_patterns=HUB_FILES))
        except (ImportError, OSError, ValueError):  # not in the cache: the node fetches its shard from a peer
            return None
        return snapshot if complete(snapshot) else None
    return None


def resolve_model(model: str | Path | None, revision: str | None = None) -> Path:
    """A local path as is; otherwise a hub repo id at `revision` (else its main branch), downloaded
    (for real users; tests never do)."""
    check_revision(model, revision)
    if model is None:
        return default_model_path()
    if not str(model).strip():
        raise ValueError("the model is empty: give a directory or a hub repo id (or leave --model out: the demo model)")
    path = Path(model).expanduser()
    if path.exists():
        return path
    repo = hub_repo_id(model)
    if repo is None:
        raise FileNotFoundError(f"model {model}: no directory {path.absolute()}, and not a Hugging Face repo id "
                                "(owner/name)")
    from huggingface_hub import snapshot_download

    log.info("downloading %s%s from the Hugging Face hub", repo, f" at {revision}" if revision else "")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES))
    except Exception as e:  # noqa: BLE001 - the hub's many kinds (not found, gated, offline): one message for all
        raise FileNotFoundError(f"model {model}: no directory {path.absolute()}, and the Hugging Face hub did not "
                                f"give it{f' at {revision}' if revision else ''} ({type(e).__name__}: {e})") from e


def hub_origin(path: Path | str) -> tuple[str, str] | None:
    """The hub repo id and commit a model directory is a snapshot of, from the hub cache's layout
    (`.../models--owner--name/snapshots/<commit>`), or None for any other directory."""
    parts = Path(path).resolve().parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not re.fullmatch(r"[0-9a-f]{40}", parts[-1]):
        return None
    folder = parts[-3]
    if not folder.startswith("models--") or folder.count("--") < 2:
        return None
    owner, name = folder.removeprefix("models--").split("--", 1)
    return f"{owner}/{name}", parts[-1]


def model_name_for(model: str | None, path: Path) -> str:
    """What clients call the model: a hub id as given, else the directory name."""
    if model and not Path(model).expanduser().exists():
        return model
    return path.name
