"""A deferred package init (models/deferred.py, as the executable uses it), on a package made here."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mtpipe.models.deferred import defer_package_init

INIT = """
import time
from pathlib import Path
flag = Path(__file__).with_name("fail")
if flag.exists():
    flag.unlink()
    raise RuntimeError("init failed once")
time.sleep(0.3)
from .sub import value as answer
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "deferpkg"
    root.mkdir()
    (root / "__init__.py").write_text(INIT)
    (root / "sub.py").write_text("value = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [n for n in sys.modules if n == "deferpkg" or n.startswith("deferpkg.")]:
        del sys.modules[name]


def test_submodules_import_without_the_init_and_threads_wait_for_it(package: Path) -> None:
    defer_package_init("deferpkg")
    import deferpkg.sub

    assert deferpkg.sub.value == 42 and "answer" not in vars(sys.modules["deferpkg"])  # init not run yet
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(sys.modules["deferpkg"].answer)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [42] * 4  # every thread waited for the one init, none saw the package half done
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        sys.modules["deferpkg"].missing  # noqa: B018
    assert not hasattr(sys.modules["deferpkg"], "missing")


def test_a_failed_init_raises_and_runs_again(package: Path) -> None:
    (package / "fail").touch()
    defer_package_init("deferpkg")
    with pytest.raises(RuntimeError, match="failed once"):
        from deferpkg import answer
    from deferpkg import answer

    assert answer == 42


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 here")
def test_the_command_prints_its_threads_stacks_on_sigusr1_and_goes_on() -> None:
    """What a hung `mtpipe` process is doing, without a debugger: every thread's stack on stderr."""
    from mtpipe.node.spawn import node_command

    proc = subprocess.Popen(node_command("--host", "127.0.0.1", "--port", "0"), stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        while "listening on" not in (line := proc.stderr.readline()):
            assert line, "the node ended before it listened"
        proc.send_signal(signal.SIGUSR1)
        dumped = []
        while "asyncio" not in "".join(dumped):  # (the stack of the node's event loop)
            line = proc.stderr.readline()
            assert line, "".join(dumped)
            dumped.append(line)
        assert "most recent call first" in "".join(dumped) and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
