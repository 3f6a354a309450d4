"""On Linux, MLX's matrix products bind to an optimized BLAS, proven by the dynamic linker's own record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpipe.models import blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX uses Accelerate on macOS")

MATMUL = "import mtpipe, mlx.core as mx; a = mx.ones((64, 64)); mx.eval(a @ a)"
REPORT = "from mtpipe.models import blas; print(json.dumps(blas.info().to_dict()))"


def _optimized() -> str:
    path = blas.find_optimized()
    if path is None:
        if os.environ.get("MTPIPE_REQUIRE_BLAS"):
            pytest.fail(f"no optimized BLAS on this machine: {blas.FIX}")
        pytest.skip(f"no optimized BLAS on this machine: {blas.FIX}")
    return os.path.realpath(path)


def _run(code: str, tmp_path: Path, **env: str) -> tuple[str, str]:
    """Run `code` in a fresh interpreter with the linker's binding log on; (stdout, what cblas_sgemm bound to)."""
    log = tmp_path / "ld"
    full = {k: v for k, v in os.environ.items() if k != "MTPIPE_BLAS"}
    full.update(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(log), **env)
    out = subprocess.run([sys.executable, "-c", f"import json; {code}"], env=full, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    lines = [line for f in tmp_path.glob("ld.*") for line in f.read_text().splitlines()
             if "libmlx" in line and "`cblas_sgemm'" in line]
    assert lines, "MLX never bound cblas_sgemm: no float32 matmul ran"
    return out, lines[0].split(" to ", 1)[1].split(" [")[0]


def test_mlx_binds_cblas_sgemm_to_the_optimized_blas(tmp_path: Path) -> None:
    want = _optimized()
    out, bound = _run(f"{MATMUL}; {REPORT}", tmp_path)
    assert os.path.realpath(bound) == want
    reported = json.loads(out)
    assert reported["optimized"] is True and os.path.realpath(reported["path"]) == want


def test_reference_blas_when_asked_for_and_reported_as_such(tmp_path: Path) -> None:
    _optimized()
    out, bound = _run(f"{MATMUL}; {REPORT}", tmp_path, MTPIPE_BLAS="reference")
    assert "mlx_cpu.libs/libblas" in bound
    reported = json.loads(out)
    assert reported["optimized"] is False and reported["name"] == "reference"
    assert reported["path"] and "libblas" in reported["path"]


def test_thread_count_comes_from_the_environment(tmp_path: Path) -> None:
    _optimized()
    out, _ = _run(f"{MATMUL}; {REPORT}", tmp_path, MTPIPE_BLAS_THREADS="1")
    assert json.loads(out)["threads"] == 1


@pytest.mark.parametrize("bad", ["abc", "1.5", "0", "-2"])
def test_a_thread_count_that_is_no_count_is_left_out_with_a_warning(bad: str) -> None:
    """Read as mtpipe is imported, by every command (`--help` too): a bad value never stops one."""
    from mtpipe.models import blas

    env = {**os.environ, "MTPIPE_BLAS_THREADS": bad}
    r = subprocess.run([sys.executable, "-m", "mtpipe", "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: mtpipe" in r.stdout, r.stderr
    assert f"MTPIPE_BLAS_THREADS={bad!r} is not a positive whole number" in r.stderr
    assert blas.default_threads() >= 1


def test_blis_is_preferred_to_openblas_and_its_pthreads_build_to_the_others(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenBLAS packs the whole weight matrix on every product, which at a decode step's few rows
    costs several times the product: BLIS first wherever both are installed."""
    pthread, generic = tmp_path / "blis-pthread", tmp_path / "lib"
    for d in (pthread, generic):
        d.mkdir()
    for f in (generic / "libopenblas.so.0", generic / "libbliso.so.4"):
        f.touch()
    monkeypatch.setattr(blas, "_search_dirs", lambda: [pthread, generic])
    assert blas.find_optimized() == str(generic / "libbliso.so.4")
    (pthread / "libblis.so.4").touch()
    found = blas.find_optimized()
    assert found == str(pthread / "libblis.so.4") and blas.is_preferred(found)
    assert not blas.is_preferred(str(generic / "libopenblas.so.0")) and not blas.is_preferred(None)


def test_local_workers_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv(blas.ENV_WORKERS, "2")
    assert blas.default_threads() == 4
    monkeypatch.setenv(blas.ENV_WORKERS, "16")
    assert blas.default_threads() == 1
    monkeypatch.delenv(blas.ENV_WORKERS)
    assert blas.default_threads() == 8


def test_a_child_gets_its_share_of_the_cores_not_this_process_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes and ring ranks a bench starts beside each other: the thread count this process set for
    itself would override theirs (a count the user set is theirs too)."""
    monkeypatch.setattr(blas, "_SET_HERE", {"OPENBLAS_NUM_THREADS"})
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "8")  # (as preload set it here)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # (the user's)
    env = blas.child_env(4)
    assert "OPENBLAS_NUM_THREADS" not in env and env["MKL_NUM_THREADS"] == "3" and env[blas.ENV_WORKERS] == "4"


def test_reference_blas_warns_once_with_the_fix(tmp_path: Path) -> None:
    code = ("import logging, mtpipe, mlx.core as mx; logging.basicConfig(level=logging.INFO); "
            "from mtpipe.models import blas; blas.warn_if_reference(); blas.warn_if_reference()")
    # (a library that cannot load leaves the bundled reference BLAS, as a machine without one would)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MTPIPE_BLAS": str(tmp_path / "libnone.so")},
                       capture_output=True, text=True, timeout=120, check=True)
    warnings = [line for line in r.stderr.splitlines() if "MLX runs on the reference BLAS" in line]
    assert len(warnings) == 1 and "apt-get install libblis4-pthread" in warnings[0]
    asked = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MTPIPE_BLAS": "reference"},
                           capture_output=True, text=True, timeout=120, check=True)
    assert "WARNING" not in asked.stderr and "BLAS: reference" in asked.stderr  # (asked for: said, not warned)
