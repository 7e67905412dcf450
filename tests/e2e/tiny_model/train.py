"""A tiny regression (y = 3x - 1 plus noise, one linear layer) for tests that need real,
cheap learners: no dataset to load, an iteration costs next to nothing, so a job with many
epochs keeps its learners busy while the test moves the scheduler around."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import ElasticTrainer


def get_datasets() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(512, 1, generator=g)
    y = 3 * x - 1 + 0.05 * torch.randn(512, 1, generator=g)
    return TensorDataset(x[:448], y[:448]), TensorDataset(x[448:], y[448:])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    mse = nn.MSELoss()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        trainer.log({"mae": (out - target).abs().mean()})  # the script's own metric
        return mse(out, target)

    trainer = ElasticTrainer(nn.Linear(1, 1), get_datasets, loss_fn, ("SGD", {"lr": 0.2}))
    trainer.train(epochs=1000, batch_size=64, max_workers=8)
