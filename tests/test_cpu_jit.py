"""On Linux, the kernels MLX builds for compiled functions are built for this CPU, with results unchanged."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtpipe.models import cpu_jit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("g++") is None,
                                reason="MLX builds CPU kernels with g++ on Linux")

# a compiled function whose kernel MLX builds now (a new shape of a new graph), against the same ops uncompiled
COMPILED = """
import mtpipe, mlx.core as mx
from mtpipe.models import cpu_jit
f = lambda a, b, c: mx.sigmoid(a * b + c) * mx.exp(-a) + a * b
a, b, c = (mx.random.normal((3, 1000), key=mx.random.key(i)) for i in range(3))
same = mx.array_equal(mx.compile(f)(a, b, c), f(a, b, c)).item()
print(cpu_jit.info(), same)
"""


def _run(tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    """Run COMPILED in a fresh interpreter, with a fresh kernel cache and cache directory, and a `g++`
    first on PATH that records its arguments; (its output, the arguments of each build)."""
    spy = tmp_path / "spy"
    spy.mkdir(exist_ok=True)
    record = tmp_path / "builds"
    (spy / "g++").write_text(f"#!/bin/sh\necho \"$@\" >> {record}\nexec {shutil.which('g++')} \"$@\"\n")
    (spy / "g++").chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k != cpu_jit.ENV}
    full.update(PATH=f"{spy}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(tmp_path / "tmp"),
                XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, "-c", COMPILED], env=full, capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip()
    return out, record.read_text().splitlines() if record.exists() else []


def test_kernels_are_built_for_this_cpu_with_the_same_results(tmp_path: Path) -> None:
    out, builds = _run(tmp_path)
    assert out == "native True"  # bit for bit: no multiply and add fused that the source does not fuse
    assert builds and all("-march=native" in b and "-ffp-contract=off" in b for b in builds)
    wrapper = tmp_path / "cache" / "mtpipe" / "cpu-jit" / "g++"
    assert str(tmp_path / "spy" / "g++") in wrapper.read_text()  # (it runs the g++ found on PATH)
    assert not wrapper.parent.stat().st_mode & 0o022


def test_plain_when_asked_for(tmp_path: Path) -> None:
    out, builds = _run(tmp_path, MTPIPE_CPU_JIT="plain")
    assert out == "plain True"
    assert builds and not any("-march=native" in b for b in builds)


def test_a_process_started_by_one_that_set_it_up_runs_the_real_compiler(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Its PATH has the wrapper first: the wrapper it writes must not run itself."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = cpu_jit.wrapper_dir()
    ours.mkdir(parents=True, mode=0o700)
    (ours / "g++").write_text("#!/bin/sh\n")
    monkeypatch.setenv("PATH", f"{ours}{os.pathsep}{os.environ['PATH']}")
    assert cpu_jit._real_compiler(ours) == shutil.which("g++", path=os.environ["PATH"].split(os.pathsep, 1)[1])


def test_a_wrapper_directory_others_may_write_to_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", os.environ["PATH"])
    cpu_jit.wrapper_dir().mkdir(parents=True)
    cpu_jit.wrapper_dir().chmod(0o777)
    assert cpu_jit._install().startswith("plain (")
    assert not (cpu_jit.wrapper_dir() / "g++").exists() and str(cpu_jit.wrapper_dir()) not in os.environ["PATH"]
