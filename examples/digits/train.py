"""Classify 8x8 handwritten digits (scikit-learn's copy of the UCI digits data) with an MLP.

Standalone:   python examples/digits/train.py --epochs 3
On shoal:     submit this script; the same code joins its job and trains elastically.
"""

from __future__ import annotations

import argparse
import logging

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import ElasticTrainer

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def get_datasets() -> tuple[TensorDataset, TensorDataset]:
    """The 1797 images as float features in [0, 1], split deterministically 80/20."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build_model(hidden: int = 128) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-workers", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(args.seed)
    trainer = ElasticTrainer(
        build_model(),
        get_datasets,
        nn.CrossEntropyLoss(),
        ("Adam", {"lr": args.lr}),
        seed=args.seed,
    )
    result = trainer.train(
        epochs=args.epochs, batch_size=args.batch_size, max_workers=args.max_workers
    )
    if result.epochs:
        print(f"final test accuracy {result.epochs[-1].metrics['accuracy']:.4f}")


if __name__ == "__main__":
    main()
