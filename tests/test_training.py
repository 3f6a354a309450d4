"""The demo model's training script and corpus: held-out prompts that are held out under any Python,
bad options refused before any work, and evaluation that weighs rows and keeps the models' modes."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from mtpipe.models.registry import DEMO_MODEL
from mtpipe.training import corpus

try:
    import torch
except ImportError:  # (the corpus is torch-free: its tests run without the [train] extra)
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="the training script needs the [train] extra (torch==2.13.0)")


def test_held_out_files_are_the_ones_the_demo_names_not_this_pythons_split(tmp_path: Path) -> None:
    """The split counts files of this Python's standard library, so under another Python the files at
    its held-out positions are others, ones the demo was trained on; the manifest names the right ones."""
    root = corpus.stdlib_root()
    manifest = json.loads((DEMO_MODEL / corpus.MANIFEST).read_text())
    card = (DEMO_MODEL / "README.md").read_text()
    listed = re.search(r"Held-out manifest.*?```\n(.*?)```", card, re.S).group(1).split()
    assert manifest["held"] == listed
    held = corpus.held_out_files()
    assert held and {f.relative_to(root).as_posix() for f in held} <= set(listed)
    # A model trained on another Python: its manifest names files this Python's split does not hold out.
    train, _ = corpus.split_files(corpus.stdlib_files())
    chosen = sorted(f.relative_to(root).as_posix() for f in train if f.stat().st_size > 20_000)[:3]
    (tmp_path / corpus.MANIFEST).write_text(json.dumps({"python": "3.99", "held": chosen}))
    assert [f.relative_to(root).as_posix() for f in corpus.held_out_files(tmp_path)] == chosen
    prompts = corpus.heldout_prompts(3, chars=1000, model_dir=tmp_path)
    assert all(p in corpus.read_text(root / name) for p, name in zip(prompts, chosen))


def test_asking_for_more_held_out_prompts_than_there_are_is_an_error() -> None:
    with pytest.raises(ValueError, match="held-out files"):
        corpus.heldout_prompts(1000)


@needs_torch
@pytest.mark.parametrize("option", [["--steps", "0"], ["--steps", "-3"], ["--eval-every", "0"], ["--seq-len", "1"],
                                    ["--batch-size", "0"], ["--vocab-size", "0"], ["--max-minutes", "-1"]])
def test_bad_options_are_refused_before_any_work(option: list[str], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from mtpipe.training import train_demo

    with pytest.raises(SystemExit) as e:
        train_demo.parse_args(["--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w"), *option])
    assert e.value.code == 2 and option[0] in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@needs_torch
def test_a_corpus_cache_from_another_python_is_refused(tmp_path: Path) -> None:
    from mtpipe.training import train_demo

    torch.save({"vocab_size": 512, "stdlib_root": "/elsewhere/lib/python3.13", "python": "3.13.0"},
               tmp_path / "data.pt")
    with pytest.raises(SystemExit, match="fresh --work-dir"):
        train_demo.prepare_data(tmp_path, 512)


@needs_torch
def test_importing_the_script_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.training import train_demo

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    importlib.reload(train_demo)
    import os

    assert "OMP_WAIT_POLICY" not in os.environ


@needs_torch
def test_evaluation_weighs_every_row_alike_and_keeps_the_models_modes() -> None:
    """Nine rows are a chunk of 8 and one of 1: the mean is over rows, not over chunks."""
    from mtpipe.training import train_demo

    backbone, mtp = train_demo.load_demo(DEMO_MODEL, dtype=torch.float32)
    assert not backbone.training and not mtp.training
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 4000, (9, 12), generator=gen)
    whole = train_demo.evaluate(backbone, mtp, rows)
    assert not backbone.training and not mtp.training
    per_row = [train_demo.evaluate(backbone, mtp, rows[i : i + 1]) for i in range(9)]
    for key in ("main", "mtp", "main_acc", "mtp_acc", "agree"):
        assert whole[key] == pytest.approx(sum(r[key] for r in per_row) / 9, rel=1e-4, abs=1e-6)
    backbone.train()
    train_demo.evaluate(backbone, mtp, rows[:1])
    assert backbone.training and not mtp.training
