"""Agent-side building blocks shared by methods: optimizers, epoch loops, evaluation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from ..data import ClientTensors
    from ..models import SplitModel
    from ..specs import TrainConfig

#: the model type a training loop is given, and what its loss function receives
ModelT = TypeVar("ModelT", bound="nn.Module")


@dataclass
class LocalContext:
    """What a local update may use besides the model and the data."""

    train: TrainConfig
    device: Any
    round: int
    seed: int
    num_classes: int
    generator: Any = None  # torch.Generator seeded per (run, round, agent)
    log: Any = None

    def batches(self, n: int, batch_size: int | None = None, *, shuffle: bool = True):
        """Index tensors for one epoch over ``n`` samples, reproducible for the seed."""
        import torch

        bs = batch_size or self.train.batch_size
        order = torch.randperm(n, generator=self.generator) if shuffle else torch.arange(n)
        for start in range(0, n, bs):
            yield order[start : start + bs]


@dataclass
class EvalResult:
    """Correct predictions, sample count and mean loss of one evaluation."""

    correct: int
    total: int
    loss: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else math.nan


def make_optimizer(params: Iterable, ctx: LocalContext, *, optimizer: str | None = None, lr: float | None = None,
                   momentum: float | None = None, weight_decay: float | None = None):
    """An optimizer from the run's train config; an override that is None is the run's
    ``train.<field>`` (a method's options reach it through :func:`~edgepfl.methods.base.method_optimizer`)."""
    import torch

    params = [p for p in params if p.requires_grad]
    t = ctx.train
    kind = optimizer or t.optimizer
    lr = t.lr if lr is None else lr
    wd = t.weight_decay if weight_decay is None else weight_decay
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    return torch.optim.SGD(params, lr=lr, momentum=t.momentum if momentum is None else momentum, weight_decay=wd)


def fit(
    model: ModelT,
    data: ClientTensors,
    ctx: LocalContext,
    loss_fn: Callable[[ModelT, torch.Tensor, torch.Tensor], torch.Tensor],
    params: Iterable,
    epochs: int,
    *,
    optimizer=None,
    batch_size: int | None = None,
) -> float:
    """Minimise ``loss_fn(model, x, y)`` over ``params`` for ``epochs``; returns the mean loss.

    Parameters not in ``params`` are not stepped (their gradients are still computed
    unless the caller detaches them), so phase-wise schedules pass the part they train.
    ``optimizer``: the phase's own (default: one from the run's train section);
    ``batch_size``: None is the run's ``train.batch_size``. With ``train.max_grad_norm``
    each step's gradient over ``params`` is clipped to that norm first.
    """
    import torch

    params = list(params)
    opt = optimizer or make_optimizer(params, ctx)
    max_norm = ctx.train.max_grad_norm
    model.train()
    total, count = 0.0, 0
    for _ in range(epochs):
        for idx in ctx.batches(data.num_train, batch_size):
            x, y = data.x_train[idx], data.y_train[idx]
            if len(y) < 2 and _has_batchnorm(model):
                continue  # BatchNorm cannot train on a batch of one
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, x, y)
            loss.backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()
            total += float(loss.detach()) * len(y)
            count += len(y)
    return total / count if count else math.nan


def evaluate_logits(logits_fn, model, x, y, ctx: LocalContext, batch_size: int = 512) -> EvalResult:
    """Accuracy and mean cross-entropy of ``logits_fn`` on (x, y), in eval mode."""
    import torch
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            out = logits_fn(xb)
            loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    model.train(was_training)
    n = len(y)
    return EvalResult(correct=correct, total=n, loss=loss_sum / n if n else math.nan)


def encoder_features(model: SplitModel, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """``model.encoder``'s features of ``x``, in batches, without gradient and in eval mode
    (no BatchNorm statistic moves); the model's training mode is restored afterwards.

    The features a method computes on frozen data outside its training loop: RepPer's
    stage-2 head, FedPAC's class statistics.
    """
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return torch.cat([model.encoder(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])
    finally:
        model.train(was_training)


def noise_generator(ctx: LocalContext, salt: int):
    """A CPU generator for a method's own noise (Gumbel draws, masks), derived from the
    task's seed without consuming ``ctx.generator``, so the batch order is the same with
    or without the noise and runs stay reproducible on any device."""
    import torch

    base = ctx.generator.initial_seed() if ctx.generator is not None else ctx.seed * 1_000_003 + ctx.round
    g = torch.Generator()
    g.manual_seed((base * 6_364_136_223_846_793_005 + salt) % (2**63))
    return g


def freeze(module: nn.Module, frozen: bool = True) -> None:
    for p in module.parameters():
        p.requires_grad_(not frozen)


def _has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm; asked only for a batch of one, so not cached."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return any(isinstance(m, _BatchNorm) for m in model.modules())


def recalibrate_batchnorm(model: nn.Module, forward: Callable[[torch.Tensor], object], x: torch.Tensor,
                          batch_size: int = 256, layers: Sequence[nn.Module] | None = None) -> int:
    """Re-estimate the BatchNorm running statistics of ``model`` on ``x``.

    Statistics are reset and accumulated as a cumulative average (``momentum=None``)
    over ``forward`` calls on batches of ``x``, without gradient; no parameter changes. A
    last batch of one sample is skipped (BatchNorm cannot use it). By default every
    BatchNorm layer is re-estimated with the model in training mode; with ``layers``
    only those are, and the rest of the model stays in eval mode (its other BatchNorm
    layers normalize with, and keep, their running statistics: an export re-estimates
    only the statistics the federation does not hold). Returns the number of samples
    seen; the model's modes and momenta are restored.
    """
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    pool = model.modules() if layers is None else layers
    chosen = [m for m in pool if isinstance(m, _BatchNorm) and m.track_running_stats]
    if not chosen or len(x) < 2:
        return 0
    modes = {m: m.training for m in model.modules()}
    momenta = [bn.momentum for bn in chosen]
    for bn in chosen:
        bn.reset_running_stats()
        bn.momentum = None
    if layers is None:
        model.train()
    else:
        model.eval()
        for bn in chosen:
            bn.train()
    seen = 0
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                batch = x[start : start + batch_size]
                if len(batch) < 2:
                    continue
                forward(batch)
                seen += len(batch)
    finally:
        for bn, momentum in zip(chosen, momenta):
            bn.momentum = momentum
        for module, training in modes.items():
            module.training = training
    return seen
