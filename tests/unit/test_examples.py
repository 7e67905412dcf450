"""The example training scripts run standalone, as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def _standalone_env() -> dict[str, str]:
    """The caller's environment minus the learner contract: a plain ``python train.py``."""
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "TRACEPARENT"
    }
    environ["OMP_NUM_THREADS"] = "1"
    return environ


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        env=_standalone_env(),
        cwd=REPO,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_digits_runs_standalone_and_prints_per_epoch_accuracy() -> None:
    proc = _run(EXAMPLES / "digits" / "train.py", "--epochs", "1")
    output = proc.stdout + proc.stderr
    assert re.search(r"epoch 1/1, train loss [\d.]+, test loss [\d.]+, accuracy [\d.]+", output)
    assert re.search(r"final test accuracy 0\.\d{4}", proc.stdout)


def test_digits_reaches_90_percent_test_accuracy_in_three_epochs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES / "digits"))
    try:
        import train as digits_train  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES / "digits"))
        sys.modules.pop("train", None)
    digits_train.main(["--epochs", "3"])
    match = re.search(r"final test accuracy (0\.\d+)", capsys.readouterr().out)
    assert match is not None
    assert float(match.group(1)) > 0.9


def test_cifar10_runs_one_tiny_epoch_on_a_fake_cifar_directory(tmp_path: Path) -> None:
    data = tmp_path / "cifar-10-batches-py"
    _run(EXAMPLES / "cifar10" / "make_fake_cifar.py", data, "--per-batch", "12", "--test", "10")
    assert sorted(p.name for p in data.iterdir()) == [
        "batches.meta",
        *(f"data_batch_{i}" for i in range(1, 6)),
        "test_batch",
    ]
    proc = _run(
        EXAMPLES / "cifar10" / "train.py",
        "--data-dir",
        tmp_path,  # the parent of cifar-10-batches-py is accepted too
        "--tiny",
        "--epochs",
        "1",
        "--batch-size",
        "16",
    )
    output = proc.stdout + proc.stderr
    assert "training 60 samples" in output
    assert re.search(r"epoch 1/1, train loss [\d.]+, test loss [\d.]+, accuracy [\d.]+", output)


def test_fake_cifar_has_the_format_of_the_real_files(tmp_path: Path) -> None:
    import pickle

    sys.path.insert(0, str(EXAMPLES / "cifar10"))
    try:
        from make_fake_cifar import make_fake_cifar  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES / "cifar10"))
        sys.modules.pop("make_fake_cifar", None)
    out = make_fake_cifar(tmp_path / "c", per_batch=4, test=3, seed=1)
    with (out / "test_batch").open("rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert batch[b"data"].shape == (3, 3072) and batch[b"data"].dtype.name == "uint8"
    assert len(batch[b"labels"]) == 3 and all(0 <= v < 10 for v in batch[b"labels"])
    again = make_fake_cifar(tmp_path / "d", per_batch=4, test=3, seed=1)
    assert (again / "data_batch_3").read_bytes() == (out / "data_batch_3").read_bytes()


def test_transformer_example_runs_tiny_with_amp_clipping_warmup_cosine_and_callbacks(
    tmp_path: Path,
) -> None:
    proc = _run(EXAMPLES / "transformer" / "train.py", "--tiny", "--out-dir", tmp_path)
    output = proc.stdout + proc.stderr
    assert re.search(r"epoch 2/2, train loss [\d.]+, test loss [\d.]+, accuracy [\d.]+", output)
    # The EDT-style callback logged on the primary (with the clipped gradient's norm and the
    # warmup's first learning rate) and saved the model at each epoch's end.
    assert re.search(r"step 0 loss [\d.]+ lr 5\.00e-05 grad norm [\d.]+ world 1", output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0.pt", "epoch-1.pt"]
    assert re.search(r"final test accuracy 0\.\d{4}", proc.stdout)
