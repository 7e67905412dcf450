"""A small transformer encoder that finds the most frequent token of a sequence, trained with
the parts of the training API real work uses: bfloat16 autocast, global gradient clipping,
AdamW with weight decay on the matrices only (parameter groups), a warmup-cosine schedule by
name, and an EDT-style callback that logs
on the primary learner, notes every rescale and saves the model at each epoch's end.

The data is generated (seeded, the same in every learner): nothing is downloaded.

Standalone:   python examples/transformer/train.py --tiny          (CPU, well under a minute)
On shoal:     shoal submit examples/transformer --max-workers 4 --sync-mode collective
              (parameter groups need the collective mode on the cluster; see
              docs/training-api.md)
"""

from __future__ import annotations

import argparse
import logging
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import Callback, ElasticTrainer

log = logging.getLogger("transformer")


def make_data(n: int, length: int, vocab: int, seed: int) -> TensorDataset:
    """``n`` random sequences; the label is the most frequent token (the lowest on ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, length), generator=g)
    counts = torch.nn.functional.one_hot(x, vocab).sum(dim=1)
    return TensorDataset(x, counts.argmax(dim=1))


def get_datasets(n: int, length: int, vocab: int) -> tuple[TensorDataset, TensorDataset]:
    return make_data(n, length, vocab, seed=1), make_data(max(256, n // 8), length, vocab, seed=2)


class Encoder(nn.Module):
    def __init__(self, vocab: int, length: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(1, length, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )  # no dropout: each learner's random draws would differ from one process's
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.tokens(x) + self.positions)
        return self.head(h.mean(dim=1))


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only: biases, norms and embeddings' positions keep theirs."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    return [
        {"params": decay},
        {"params": [p for p in model.parameters() if p.ndim != 2], "weight_decay": 0.0},
    ]


class EDTStyle(Callback):
    """What the seeds' EDT callbacks did, with shoal's hooks."""

    def __init__(self, out_dir: Path | None, every: int) -> None:
        self.out_dir, self.every = out_dir, every

    def on_train_begin(self, plan, step) -> None:
        log.info("%d iterations to go of %d", plan.total_steps - step, plan.total_steps)

    def on_rescale(self, old_world, new_world, assignment) -> None:
        log.info("world %d -> %d at step %d", old_world, new_world, assignment.step)

    def on_iteration_end(self, record) -> None:
        if self.trainer.is_primary and record.step % self.every == 0:
            log.info(
                "step %d loss %.4f lr %.2e grad norm %.3f world %d",
                record.step,
                record.best_loss,
                record.lr,
                record.grad_norm,
                record.world_size,
            )

    def on_epoch_end(self, epoch, result) -> None:
        if result is not None and self.out_dir is not None:  # the learner that evaluated
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(self.trainer.model.state_dict(), self.out_dir / f"epoch-{epoch}.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--tiny", action="store_true", help="2048 samples, 2 epochs, dim 32")
    parser.add_argument("--out-dir", type=Path, default=None, help="save the model per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-workers", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    length, vocab = 24, 8
    samples, epochs, dim = args.samples, args.epochs, 64
    if args.tiny:
        samples, epochs, dim = 2048, 2, 32

    torch.manual_seed(args.seed)
    trainer = ElasticTrainer(
        Encoder(vocab, length, dim, layers=2, heads=4),
        partial(get_datasets, samples, length, vocab),
        nn.CrossEntropyLoss(),
        ("AdamW", {"lr": args.lr, "weight_decay": 0.01}),
        param_groups=param_groups,
        lr_schedule=("warmup_cosine", {"warmup": 20}),
        amp="bfloat16",
        clip_grad_norm=1.0,
        callbacks=[EDTStyle(args.out_dir, every=20)],
        seed=args.seed,
    )
    result = trainer.train(epochs=epochs, batch_size=args.batch_size, max_workers=args.max_workers)
    if result.is_primary and result.epochs:
        print(f"final test accuracy {result.epochs[-1].metrics['accuracy']:.4f}")


if __name__ == "__main__":
    main()
