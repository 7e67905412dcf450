"""A learner process for the data-plane tests: the digits MLP of examples/digits/train.py,
trained with SGD by ElasticTrainer through the "grpc" backend, or the "collective" one with
``--backend collective`` (configured by the SHOAL_* environment, as a host-agent would start
it).

Test hooks (flags): ``--gate FILE`` waits for FILE before joining (so the process is warm when
the test lets it join); ``--delay S`` sleeps S seconds before each sync (paces the job so the
test can act mid-epoch); ``--hang-at-step K`` stops forever before sending step K's gradients
(the test then SIGKILLs it mid-iteration); ``--pause-at K1,K2 --pause-dir D`` waits before
sending step K's gradients until ``D/release-K`` exists (the job is then frozen
mid-iteration). ``--history FILE`` receives the iterations this learner completed, its process
id and (collective) the process groups it formed. ``--clip-grad-norm X`` and ``--amp DTYPE``
(with ``--init-scale S``) turn on global clipping and mixed precision; the history then also
holds each iteration's loss scale and whether its step was skipped, and the callbacks' view
(``is_primary``, ``rescales``). ``--bucket-bytes N`` (collective) sets the gradient bucket
size; the history's ``buckets_sent`` counts the buckets the overlap hooks sent during backward
and in all; ``tensors_sent`` (parameter-server mode) the parameters streamed during backward
and in all. ``--unused-param 1`` adds a parameter that never gets a gradient.
``--functional-read 1`` computes the MLP's last layer as ``F.linear(h, last.weight,
last.bias)`` without calling that module (the same function; early forward's guard must catch
it); ``--watch 0`` leaves out the test's callback (a callback that overrides
``on_iteration_end`` makes the trainer load the whole answer before calling it); the history's
``early_tensors`` are ``GrpcBackend.early_tensors`` (early forward's counters);
``inline_bundles`` ``GrpcBackend.inline_bundles`` (bundles sent and answers read as one
message, SHOAL_INLINE_KB); ``ahead_boundaries`` ``GrpcBackend.ahead_boundaries`` (Boundaries
answered ahead and asked again, SHOAL_BOUNDARY_AHEAD); ``control_answers`` the control calls
answered on a lane's control connection instead of gRPC (``ShardSession.control_answers``);
``direct_syncs`` the syncs sent and answered on the trainer's thread
(``GrpcBackend.direct_syncs``); ``applied_ahead`` (collective) the updates applied ahead of
their commit and of them taken back (``CollectiveBackend.applied_ahead``: the vote ahead is
allowed only with ``--watch 0``, SHOAL_COLLECTIVE_AHEAD).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]


def load_digits_example():
    spec = importlib.util.spec_from_file_location(
        "digits_train", REPO / "examples" / "digits" / "train.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: With --param-groups: weight decay for the default group, none for biases, a slower first
#: layer (the reference in _param_sync_cluster.py builds the same groups).
PARAM_GROUPS_WD = {False: {}, True: {"weight_decay": 1e-3}}


def param_groups(model: nn.Module) -> list[dict]:
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": [model[0].weight], "lr": 0.02}, {"params": biases, "weight_decay": 0.0}]


class WithUnused(nn.Module):
    """A model with a parameter its forward never uses (``--unused-param``)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(5))
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class FunctionalLast(nn.Module):
    """The MLP with its last Linear read functionally, never called (``--functional-read``):
    the same function and parameter names; its module's forward pre-hook never runs."""

    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = self.net[-1]
        return nn.functional.linear(self.net[:-1](x), last.weight, last.bias)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--history", required=True)
    parser.add_argument("--gate")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--hang-at-step", type=int, default=-1)
    parser.add_argument("--pause-at", default="")
    parser.add_argument("--pause-dir", default=".")
    parser.add_argument("--backend", default="grpc")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clip-grad-norm", type=float, default=None)
    parser.add_argument("--amp", default=None)
    parser.add_argument("--init-scale", type=float, default=2.0**16)
    parser.add_argument("--param-groups", type=int, default=0)
    # Collective mode: gradient bucket size in bytes (first bucket too), to get many buckets
    # out of the small MLP.
    parser.add_argument("--bucket-bytes", type=int, default=0)
    # 1: the loss function logs loss_x2 (twice each micro-batch's mean loss) and a callback
    # logs prev_step (the step just ended) between steps, with trainer.log.
    parser.add_argument("--log-metrics", type=int, default=0)
    # 1: the model gets a parameter "unused" (ones, no gradient ever) registered before the
    # MLP's (so the MLP's names are "net.<name>"); the MLP's initialization is unchanged.
    parser.add_argument("--unused-param", type=int, default=0)
    parser.add_argument("--functional-read", type=int, default=0)
    parser.add_argument("--watch", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)

    from shoal.learner import (
        Callback,
        ElasticTrainer,
        MixedPrecision,
        collective,  # noqa: F401 - registers the "collective" backend
        create_backend,
        grpc_backend,  # noqa: F401 - registers the "grpc" backend
    )

    digits = load_digits_example()
    torch.manual_seed(args.seed)
    model = digits.build_model()
    if args.unused_param:
        model = WithUnused(model)
    if args.functional_read:
        model = FunctionalLast(model)
    backend = create_backend(args.backend)
    if args.bucket_bytes:
        backend._bucket_bytes = backend._first_bucket_bytes = args.bucket_bytes
    sync = backend.sync
    pauses = {int(k) for k in args.pause_at.split(",") if k}

    def paced_sync(assignment, contribution, *, lr=None):
        if assignment.step == args.hang_at_step:
            print(f"HANGING at step {assignment.step}", flush=True)
            while True:
                time.sleep(60)
        if assignment.step in pauses:
            pauses.discard(assignment.step)
            print(f"PAUSED at step {assignment.step}", flush=True)
            release = Path(args.pause_dir) / f"release-{assignment.step}"
            while not release.exists():
                time.sleep(0.01)
        if args.delay:
            time.sleep(args.delay)
        return sync(assignment, contribution, lr=lr)

    backend.sync = paced_sync  # type: ignore[method-assign]

    class Watch(Callback):
        def __init__(self) -> None:
            self.rescales: list[tuple[int, int, int]] = []
            self.primary_steps: list[int] = []

        def on_rescale(self, old_world, new_world, assignment) -> None:
            self.rescales.append((old_world, new_world, assignment.step))

        def on_iteration_end(self, record) -> None:
            if self.trainer.is_primary:
                self.primary_steps.append(record.step)
            if args.log_metrics:
                self.trainer.log({"prev_step": record.step})  # counts for the next step

    cross_entropy = nn.CrossEntropyLoss()

    def logging_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(out, target)
        trainer.log({"loss_x2": 2 * loss.item()})
        return loss

    watch = Watch()
    amp = None if args.amp is None else MixedPrecision(args.amp, init_scale=args.init_scale)
    trainer = ElasticTrainer(
        model,
        digits.get_datasets,
        logging_loss if args.log_metrics else cross_entropy,
        (
            "SGD",
            {"lr": args.lr, "momentum": args.momentum, **PARAM_GROUPS_WD[bool(args.param_groups)]},
        ),
        seed=args.seed,
        backend=backend,
        device=args.device,
        callbacks=[watch] if args.watch else [],
        clip_grad_norm=args.clip_grad_norm,
        amp=amp,
        param_groups=param_groups if args.param_groups else None,
    )
    if args.gate:  # everything is imported and built: joining is all that is left
        print("READY", flush=True)
        while not Path(args.gate).exists():
            time.sleep(0.01)
    try:
        result = trainer.train(epochs=args.epochs, batch_size=args.batch_size)
    finally:
        backend.close()
    history = [
        {
            "step": r.step,
            "epoch": r.epoch,
            "iteration": r.iteration,
            "generation": r.generation,
            "rank": r.rank,
            "world_size": r.world_size,
            "batch_size": r.batch_size,
            "n_samples": r.n_samples,
            "loss": r.loss,
            "skipped": r.skipped,
            "loss_scale": r.loss_scale,
            "grad_norm": r.grad_norm,
            "metrics": dict(r.metrics),
        }
        for r in result.history
    ]
    Path(args.history).write_text(
        json.dumps(
            {
                "retired": result.retired,
                "completed": result.completed,
                "history": history,
                "pid": os.getpid(),
                "formations": getattr(backend, "formations", []),
                "buckets_sent": getattr(backend, "buckets_sent", None),
                "tensors_sent": getattr(backend, "tensors_sent", None),
                "inline_bundles": getattr(backend, "inline_bundles", None),
                "ahead_boundaries": getattr(backend, "ahead_boundaries", None),
                "control_answers": backend.session.control_answers,
                "direct_syncs": getattr(backend, "direct_syncs", None),
                "applied_ahead": getattr(backend, "applied_ahead", None),
                "early_tensors": getattr(backend, "early_tensors", None),
                "early_forward": getattr(backend, "early_forward", None),
                "is_primary": result.is_primary,
                "primary_steps": watch.primary_steps,
                "rescales": watch.rescales,
            }
        )
    )
    print("LEARNER DONE", "retired" if result.retired else "completed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
