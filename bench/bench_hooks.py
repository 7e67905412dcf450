"""The gradient hooks' cost per parameter: what overlapping the all-reduce with backward adds to
the learner's thread, against the same backward without hooks.

Collective mode's overlap (``shoal.learner.overlap.GradientBucketer``) registers a
``post_accumulate_grad`` hook on every parameter: each copies its gradient into its bucket's
flat tensor and launches the bucket once it is full. The hooks run in Python, once per
parameter per iteration, so their cost grows with the model's tensor count (DDP's reducer does
the same in C++): a ResNet-50 has 161 parameter tensors, a BERT-base ~200.

Measured here in one process, with the launch a no-op (no process group: what is timed is the
learner's own work), as the thread's CPU time per iteration (``time.thread_time``), the
median of ``--rounds`` rounds of ``--iters`` iterations each, alternating with and without the
hooks. Model: ``--layers`` x (Linear(16, 16) + ReLU), batch 32: small tensors, so the per-call
cost shows. Also the cost of a trivial hook (autograd's own dispatch of a Python hook).

    .venv/bin/python bench/bench_hooks.py [--layers 4 40 80] [--iters 300] [--rounds 5]

Old and new code in turns: ``PYTHONPATH=<tree>/learner/src:<tree>/clients/src ...``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from shoal.learner.overlap import GradientBucketer


def model_of(layers: int) -> nn.Module:
    torch.manual_seed(0)
    parts: list[nn.Module] = []
    for _ in range(layers):
        parts += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*parts)


def per_iteration_ms(
    model: nn.Module, x: torch.Tensor, iters: int, bucketer: GradientBucketer | None
) -> float:
    params = list(model.parameters())
    began = 0.0
    for i in range(iters + 20):  # 20 warm-up iterations
        if i == 20:
            began = time.thread_time()
        for p in params:
            p.grad = None
        if bucketer is not None:
            bucketer.begin()
            bucketer.arm(int(x.shape[0]), None)
        model(x).sum().backward()
        if bucketer is not None:
            bucketer.finish()
            bucketer.take()
    return (time.thread_time() - began) / iters * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 40, 80])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, thread CPU time")
    print(
        "| parameters | backward (ms/iter) | + trivial hooks | + GradientBucketer | per parameter |"
    )
    print("|---|---|---|---|---|")
    for layers in args.layers:
        model = model_of(layers)
        params = list(model.parameters())
        x = torch.randn(32, 16)
        plain, trivial, bucketed = [], [], []
        for _ in range(args.rounds):
            plain.append(per_iteration_ms(model, x, args.iters, None))
            handles = [p.register_post_accumulate_grad_hook(lambda p: None) for p in params]
            trivial.append(per_iteration_ms(model, x, args.iters, None))
            for h in handles:
                h.remove()
            bucketer = GradientBucketer(params, lambda flat: None, lambda: torch.device("cpu"))
            bucketed.append(per_iteration_ms(model, x, args.iters, bucketer))
            bucketer.remove()
        base, t, b = (statistics.median(v) for v in (plain, trivial, bucketed))
        print(
            f"| {len(params)} | {base:.3f} | +{t - base:.3f} | +{b - base:.3f} | "
            f"{(b - base) / len(params) * 1e3:.1f} us |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
