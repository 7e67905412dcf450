"""Write a tiny fake CIFAR-10 directory in exactly the format of ``cifar-10-batches-py``.

The real directory holds ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, each a
pickled dict with ``b"data"`` (uint8, N x 3072: the 1024 red, then green, then blue values of
each 32x32 image, row-major) and ``b"labels"`` (a list of N ints in 0..9), plus
``batches.meta`` with ``b"label_names"``. This writes the same files with random images from a
fixed seed, for tests that must not download anything.

    python examples/cifar10/make_fake_cifar.py OUT_DIR [--per-batch 20] [--test 20]
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import numpy as np

LABEL_NAMES = [
    b"airplane", b"automobile", b"bird", b"cat", b"deer",
    b"dog", b"frog", b"horse", b"ship", b"truck",
]  # fmt: skip


def _write_batch(path: Path, rng: np.random.Generator, n: int, name: str) -> None:
    batch = {
        b"batch_label": name.encode(),
        b"labels": [int(v) for v in rng.integers(0, 10, size=n)],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [f"fake_{name}_{i}.png".encode() for i in range(n)],
    }
    with path.open("wb") as f:
        pickle.dump(batch, f, protocol=2)


def make_fake_cifar(
    out_dir: Path | str, per_batch: int = 20, test: int = 20, seed: int = 0
) -> Path:
    """Create ``out_dir`` (a ``cifar-10-batches-py``-style directory) and return its path."""
    if per_batch < 1 or test < 1:
        raise ValueError(f"per_batch ({per_batch}) and test ({test}) must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(1, 6):
        _write_batch(out / f"data_batch_{i}", rng, per_batch, f"training batch {i} of 5")
    _write_batch(out / "test_batch", rng, test, "testing batch 1 of 1")
    meta = {b"label_names": LABEL_NAMES, b"num_cases_per_batch": per_batch, b"num_vis": 3072}
    with (out / "batches.meta").open("wb") as f:
        pickle.dump(meta, f, protocol=2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--per-batch", type=int, default=20, help="images per training batch")
    parser.add_argument("--test", type=int, default=20, help="images in test_batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_fake_cifar(args.out_dir, args.per_batch, args.test, args.seed))


if __name__ == "__main__":
    main()
