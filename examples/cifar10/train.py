"""Train a ResNet-18-style network on CIFAR-10 from the standard ``cifar-10-batches-py``
directory (nothing is downloaded: point ``--data-dir`` at an extracted copy).

Standalone:   python examples/cifar10/train.py --data-dir ~/data/cifar-10-batches-py
Quick check:  python examples/cifar10/make_fake_cifar.py /tmp/fake-cifar
              python examples/cifar10/train.py --data-dir /tmp/fake-cifar --tiny --epochs 1
On shoal:     submit this script; the same code joins its job and trains elastically.
"""

from __future__ import annotations

import argparse
import logging
import math
import pickle
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shoal.learner import ElasticTrainer

MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILE = "test_batch"


def _resolve(data_dir: Path) -> Path:
    """Accept the ``cifar-10-batches-py`` directory itself or its parent."""
    if (data_dir / TEST_FILE).is_file():
        return data_dir
    if (data_dir / "cifar-10-batches-py" / TEST_FILE).is_file():
        return data_dir / "cifar-10-batches-py"
    raise FileNotFoundError(f"--data-dir ({data_dir}) holds no cifar-10-batches-py files")


def _load(paths: list[Path], limit: int | None) -> TensorDataset:
    images, labels = [], []
    for path in paths:
        with path.open("rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    x = torch.from_numpy(np.concatenate(images))
    y = torch.from_numpy(np.concatenate(labels))
    if limit is not None:
        x, y = x[:limit], y[:limit]
    # uint8 images: 150 MB for the whole training set; the model normalizes on the device.
    return TensorDataset(x, y)


def get_datasets(data_dir: str, limit: int | None = None) -> tuple[TensorDataset, TensorDataset]:
    root = _resolve(Path(data_dir).expanduser())
    return _load([root / f for f in TRAIN_FILES], limit), _load([root / TEST_FILE], limit)


class Normalize(nn.Module):
    """uint8 NCHW images -> normalized float32."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1) * 255, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mean) / self.std


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(
    width: int = 64, blocks: tuple[int, ...] = (2, 2, 2, 2), classes: int = 10
) -> nn.Module:
    """ResNet-18 for 32x32 inputs (3x3 stem, no max-pool); ``width`` channels in the first
    stage, doubling per stage; ``blocks`` basic blocks per stage."""
    layers: list[nn.Module] = [
        Normalize(),
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    c_in = width
    for stage, n in enumerate(blocks):
        c_out = width * 2**stage
        for i in range(n):
            layers.append(BasicBlock(c_in, c_out, 2 if stage > 0 and i == 0 else 1))
            c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    return nn.Sequential(*layers)


def cosine(epoch: int, base_lr: float, epochs: int) -> float:
    return base_lr * 0.5 * (1 + math.cos(math.pi * epoch / epochs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", required=True, help="cifar-10-batches-py directory")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
    parser.add_argument("--tiny", action="store_true", help="width 8, one block per stage")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-workers", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="epochs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(args.seed)
    model = resnet18(8, (1, 1, 1, 1)) if args.tiny else resnet18(args.width)
    trainer = ElasticTrainer(
        model,
        partial(get_datasets, args.data_dir, args.limit),
        nn.CrossEntropyLoss(),
        ("SGD", {"lr": args.lr, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True}),
        lr_schedule=partial(cosine, base_lr=args.lr, epochs=args.epochs),
        lr_schedule_unit="epoch",
        seed=args.seed,
    )
    result = trainer.train(
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_workers=args.max_workers,
        checkpoint_every=args.checkpoint_every,
    )
    if result.epochs:
        print(f"final test accuracy {result.epochs[-1].metrics['accuracy']:.4f}")


if __name__ == "__main__":
    main()
