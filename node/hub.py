"""A node's shard from the Hugging Face hub (`mtpipe node --download`): only the files that hold it.

The coordinator names a model it took from the hub by repo and commit, beside its fingerprint. Before
it downloads any weights, a node checks that the repo at that commit is that model: the fingerprint
is computed from the repo's config and tokenizer files (downloaded, small), its safetensors headers
(read with range requests) and its files' content hashes (a git-LFS object id is the file's sha256).
Then it downloads only the safetensors files that hold its shard's tensors into its hub cache, checks
each against its hash, and loads from that partial snapshot. A marker beside the files records what
was verified, so the next Load of the same shard needs no network. A downloaded file is read once for
its hash: the same pass hashes its tensors into the fingerprint sidecar, which the marker's next check
and peers fetching tensors from this node read instead of the file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Protocol

from ..models.fingerprint import TOKENIZER_FILES, digest, file_hashes, hash_range, identity_of, tensor_bytes
from .shards import DISK_MARGIN, NoDiskSpace, free_bytes

log = logging.getLogger(__name__)

VERIFIED = ".mtpipe-hub-verified.json"  # in the snapshot directory: fingerprint -> files checked


class HubRepo(Protocol):
    """One repo at one commit, as far as a node needs it."""

    def files(self) -> list[str]:
        """Every file name in the repo."""

    def safetensors(self) -> dict[str, tuple[str, dict[str, tuple[str, list[int]]]]]:
        """Each safetensors file at the repo's top (all of them, as a model directory's fingerprint takes
        them) -> (its sha256, {tensor: (dtype, shape)}), without the tensor bytes."""

    def download(self, filename: str) -> Path:
        """The file in the local snapshot directory, downloaded if it is not there yet."""

    def local_dir(self) -> Path:
        """Where the snapshot's files are (or will be) on this machine."""


class HfHubRepo:
    """The Hugging Face hub through huggingface_hub (for real users; tests use a local repo)."""

    def __init__(self, repo: str, revision: str):
        self.repo, self.revision = repo, revision
        self._files: list[str] | None = None

    def files(self) -> list[str]:
        """(Asked of the hub once: `safetensors` reads the same listing.)"""
        from huggingface_hub import HfApi

        if self._files is None:
            self._files = HfApi().list_repo_files(self.repo, revision=self.revision)
        return self._files

    def safetensors(self) -> dict[str, tuple[str, dict[str, tuple[str, list[int]]]]]:
        """Each file's header read on its own: huggingface_hub's `get_safetensors_metadata` reads only
        model.safetensors, or the files the index names, and misses an mtp.safetensors beside them."""
        from huggingface_hub import HfApi

        api = HfApi()
        try:
            names = sorted(f for f in self.files() if "/" not in f and f.endswith(".safetensors"))
            headers = {n: api.parse_safetensors_file_metadata(self.repo, n, revision=self.revision) for n in names}
            infos = api.get_paths_info(self.repo, names, revision=self.revision, expand=True) if names else []
        except (OSError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - huggingface_hub's parsing errors: a refused Load, not UNKNOWN
            raise ValueError(f"{self.repo}@{self.revision}: the hub's safetensors headers could not be read "
                             f"({type(e).__name__}: {e})") from e
        if not names:
            raise ValueError(f"{self.repo}@{self.revision}: no safetensors files at the top of the repo")
        sha = {i.path: i.lfs.sha256 for i in infos if getattr(i, "lfs", None) is not None}
        missing = [n for n in names if n not in sha]
        if missing:
            raise ValueError(f"{self.repo}: no content hash on the hub for {missing[0]} (not stored in LFS)")
        return {n: (sha[n], {t: (info.dtype, list(info.shape)) for t, info in headers[n].tensors.items()})
                for n in names}

    def download(self, filename: str) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.repo, filename, revision=self.revision))

    def local_dir(self) -> Path:
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.file_download import repo_folder_name

        return Path(HF_HUB_CACHE) / repo_folder_name(repo_id=self.repo, repo_type="model") / "snapshots" / self.revision


def hub_repo(repo: str, revision: str) -> HfHubRepo:
    """The repo named by a Load request, checked: an "owner/name" id and a commit hash, since both end
    up in a path under the hub cache."""
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo) or ".." in repo:
        raise ValueError(f"not a hub repo id: {repo!r}")
    if not re.fullmatch(r"[0-9a-f]{40}", revision):
        raise ValueError(f"not a commit hash: {revision!r}")
    return HfHubRepo(repo, revision)


def _sha256(path: Path) -> str:
    return hash_range(path, 0, path.stat().st_size)


def _verified(snapshot: Path, fingerprint: str, names: list[str]) -> bool:
    """The files holding `names`, config and tokenizer were checked against `fingerprint` before and
    have not changed since (weight hashes from the fingerprint sidecar, kept by size and mtime)."""
    try:
        marker = json.loads((snapshot / VERIFIED).read_text())[fingerprint]
        needed = {marker["tensors"][n] for n in names}
        weights = {name: h.sha256 for name, h in file_hashes(snapshot).items()}
        others = {f: sha for f, sha in marker["files"].items() if not f.endswith(".safetensors")}
        return all(weights.get(f) == marker["files"][f] for f in needed) and all(
            _sha256(snapshot / f) == sha for f, sha in others.items())
    except (OSError, ValueError, KeyError):
        return False


def download_shard(repo: HubRepo, fingerprint: str, names: list[str]) -> Path:
    """The snapshot directory holding config, tokenizer and the files with `names`, all checked against
    `fingerprint` (ValueError if the repo is another model; NoDiskSpace, before any weights come, if
    the files would not fit; OSError if a download fails)."""
    if _verified(repo.local_dir(), fingerprint, names):
        return repo.local_dir()
    files = set(repo.files())
    if "config.json" not in files:
        raise ValueError("the repo has no config.json")
    config_path = repo.download("config.json")
    snapshot = config_path.parent
    tokenizer = {name: _sha256(repo.download(name)) for name in TOKENIZER_FILES if name in files}
    small = {"config.json": _sha256(config_path), **tokenizer}  # the files checked, for the marker
    weights = repo.safetensors()
    tensors: dict[str, tuple[str, list[int]]] = {}
    holder: dict[str, str] = {}
    for file in sorted(weights):  # a later file wins, as in loading
        tensors.update(weights[file][1])
        holder.update(dict.fromkeys(weights[file][1], file))
    got = digest(identity_of(json.loads(config_path.read_text()), tokenizer, tensors,
                             {f: sha for f, (sha, _) in weights.items()}))
    if got != fingerprint:
        raise ValueError(f"the repo is model {got[:12]}, not {fingerprint[:12]}")
    unknown = [n for n in names if n not in holder]
    if unknown:
        raise ValueError(f"the repo has no tensor {unknown[0]!r}")
    needed = sorted({holder[n] for n in names})
    log.info("this shard reads %d of the model's %d weight files: %s", len(needed), len(weights), ", ".join(needed))
    # Here already (another shard's), as the repo has it; a copy that is not (a bad download before,
    # its header unreadable perhaps) goes, else the hub cache would hand it back.
    have = {f: _downloaded_sha256(snapshot, snapshot / f) for f in needed if (snapshot / f).exists()}
    for file in [f for f, sha in have.items() if sha != weights[f][0]]:
        _drop(snapshot / file)
    _check_room(snapshot, {f: weights[f][1] for f in needed if have.get(f) != weights[f][0]})
    for file in needed:
        if have.get(file) == weights[file][0]:  # here already (another shard's), as the repo has it
            small[file] = have[file]
            continue
        path = repo.download(file)
        sha = _downloaded_sha256(snapshot, path)
        if sha != weights[file][0]:
            _drop(path)  # else the hub cache would hand the same bad copy back next time
            raise ValueError(f"{file} downloaded with sha256 {sha[:12]}, the repo says {weights[file][0][:12]}")
        small[file] = sha
    _mark(snapshot, fingerprint, holder, small)
    return snapshot


def _drop(path: Path) -> None:
    """A file of the hub cache's snapshot: its blob, and its link."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)


def _check_room(snapshot: Path, files: dict[str, dict[str, tuple[str, list[int]]]]) -> None:
    """Refuse before downloading what the disk cannot hold (the files' tensor bytes, from the headers)."""
    need = sum(tensor_bytes(dtype, shape) for tensors in files.values() for dtype, shape in tensors.values())
    free = free_bytes(snapshot)
    if need and free < need + DISK_MARGIN:
        raise NoDiskSpace(f"not enough disk space for the shard's hub files: {len(files)} file(s), "
                          f"{need / 2**30:.2f} GiB to download into {snapshot}, {free / 2**30:.2f} GiB free")


def _downloaded_sha256(snapshot: Path, path: Path) -> str:
    """A downloaded file's sha256, from the pass that also hashes its tensors for the sidecar; a file
    whose header does not parse (a bad download) is hashed whole, and then fails its check."""
    try:
        return file_hashes(snapshot, [path.name])[path.name].sha256
    except Exception as e:  # noqa: BLE001 (any malformed header: the whole-file hash decides)
        log.warning("%s: its tensors could not be hashed (%s); hashing the whole file", path.name, e)
        return _sha256(path)


def _mark(snapshot: Path, fingerprint: str, holder: dict[str, str], checked: dict[str, str]) -> None:
    """Note files as checked. Nodes that share a hub cache and load other shards of one model note
    theirs at once: each reads, adds and writes under a lock, so none drops another's."""
    try:
        lock: int | None = os.open(snapshot / f"{VERIFIED}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # (a cache it cannot write: the marker cannot be written either)
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            marker: dict[str, Any] = json.loads((snapshot / VERIFIED).read_text())
        except (OSError, ValueError):
            marker = {}
        entry = marker.setdefault(fingerprint, {"tensors": holder, "files": {}})
        entry["files"].update(checked)
        tmp = snapshot / f"{VERIFIED}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, snapshot / VERIFIED)  # whole or not at all, for a node that reads it meanwhile
    finally:
        if lock is not None:
            os.close(lock)
