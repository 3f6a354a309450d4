"""On x86-64 Linux, the kernels MLX builds for compiled functions use AVX2 and FMA, with results unchanged."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtpipe.models import cpu_jit

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() != "x86_64" or shutil.which("g++") is None
    or not cpu_jit.NEEDS <= cpu_jit._cpu_flags(), reason="x86-64-v3 Linux, where MLX builds CPU kernels with g++")

# a compiled function whose kernel MLX builds now (a new graph), against the same ops uncompiled; then
# another build through the same PATH, as a program that imports mtpipe might run one
COMPILED = """
import subprocess, mtpipe, mlx.core as mx
from mtpipe.models import cpu_jit
f = lambda a, b, c: mx.sigmoid(a * b + c) * mx.exp(-a) + a * b
a, b, c = (mx.random.normal((3, 1000), key=mx.random.key(i)) for i in range(3))
same = mx.array_equal(mx.compile(f)(a, b, c), f(a, b, c)).item()
subprocess.run(["g++", "-x", "c++", "-fsyntax-only", "/dev/null"], check=True)
print(cpu_jit.info(), same)
"""


def _run(tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    """Run COMPILED in a fresh interpreter, with a fresh kernel cache and cache directory, and a `g++`
    first on PATH that records its arguments; (its output, the arguments of each run of it)."""
    spy = tmp_path / "spy"
    spy.mkdir(exist_ok=True)
    record = tmp_path / "builds"
    (spy / "g++").write_text(f"#!/bin/sh\necho \"$@\" >> {record}\nexec {shutil.which('g++')} \"$@\"\n")
    (spy / "g++").chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k != cpu_jit.ENV}
    full.update(PATH=f"{spy}{os.pathsep}{os.environ['PATH']}", TMPDIR=str(tmp_path / "tmp"),
                XDG_CACHE_HOME=str(tmp_path / "cache"))
    full.update(env)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, "-c", COMPILED], env=full, capture_output=True, text=True, timeout=300,
                         check=True).stdout.strip()
    return out, record.read_text().splitlines() if record.exists() else []


def test_mlx_kernels_are_built_for_x86_64_v3_with_the_same_results(tmp_path: Path) -> None:
    out, builds = _run(tmp_path)
    assert out == "x86-64-v3 True"  # bit for bit: no multiply and add fused that the source does not fuse
    kernels, other = [b for b in builds if "/mlx/" in b], [b for b in builds if "/mlx/" not in b]
    assert kernels and all("-march=x86-64-v3 -ffp-contract=off" in b for b in kernels)
    assert other[-1] == "-x c++ -fsyntax-only /dev/null"  # any other build: as it was asked
    assert [b for b in other if "-march" in b] == [f"{' '.join(cpu_jit.FLAGS)} -x c++ -fsyntax-only /dev/null"]  # probe
    wrapper = tmp_path / "cache" / "mtpipe" / "cpu-jit" / "g++"
    assert str(tmp_path / "spy" / "g++") in wrapper.read_text()  # (it runs the g++ found on PATH)
    assert all(not d.stat().st_mode & 0o077 for d in (wrapper.parent, wrapper.parent.parent))


def test_plain_when_asked_for_even_where_a_parent_set_it_up(tmp_path: Path) -> None:
    ours = tmp_path / "cache" / "mtpipe" / "cpu-jit"
    ours.mkdir(parents=True)
    (ours / "g++").write_text("#!/bin/sh\nexit 1\n")  # (never run: taken off PATH)
    (ours / "g++").chmod(0o700)
    out, builds = _run(tmp_path, MTPIPE_CPU_JIT="plain", PATH=f"{ours}{os.pathsep}{tmp_path / 'spy'}{os.pathsep}"
                                                               f"{os.environ['PATH']}")
    assert out == "plain True"
    assert builds and not any("-march" in b for b in builds)


def test_the_compiler_it_runs_is_not_its_own_nor_a_launcher_that_runs_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A process started by one that set it up has the wrapper first on PATH; ccache as `g++` runs the
    next `g++` on PATH, which would be the wrapper again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = cpu_jit.wrapper_dir()
    ours.mkdir(parents=True, mode=0o700)
    (ours / "g++").write_text("#!/bin/sh\n")
    launcher = tmp_path / "ccache-bin"
    launcher.mkdir()
    (tmp_path / "ccache").write_text("#!/bin/sh\n")
    (tmp_path / "ccache").chmod(0o755)
    (launcher / "g++").symlink_to(tmp_path / "ccache")
    monkeypatch.setenv("PATH", os.pathsep.join([str(ours), str(launcher), "relative/bin", os.environ["PATH"]]))
    assert cpu_jit._real_compiler(ours) == shutil.which("g++", path=os.environ["PATH"].split(os.pathsep, 3)[3])


def test_a_wrapper_directory_others_may_write_to_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", os.environ["PATH"])
    monkeypatch.delenv(cpu_jit.ENV, raising=False)
    cpu_jit.wrapper_dir().parent.mkdir(parents=True)
    cpu_jit.wrapper_dir().parent.chmod(0o777)
    assert cpu_jit._setup().startswith("plain (")
    assert not (cpu_jit.wrapper_dir() / "g++").exists() and str(cpu_jit.wrapper_dir()) not in os.environ["PATH"]


def test_no_home_no_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    monkeypatch.setenv("HOME", "")
    assert cpu_jit.wrapper_dir() is None
    monkeypatch.delenv(cpu_jit.ENV, raising=False)
    assert cpu_jit._setup() == "plain (no home directory)"
