"""The shared kit for method tests: contexts, models, tiny synthetic clients, tensor checks.

A method test file states its setup once, as a :class:`MethodKit`, and asks the kit for
everything else::

    KIT = MethodKit(num_classes=3, input_shape=(1, 6, 6), spec=ModelSpec(arch="mlp", feature_dim=6))

    method, model = KIT.build("dualfed", {"ensemble": "softmax"}, seed=0)
    method.local_update(model, KIT.template_data(seed=0, n_train=48), KIT.ctx(seed=1, epochs=2))

Every helper is deterministic for its seeds, so a test sees the same data, the same
initial weights and the same batch order on every run.

The tensor checks (:func:`snapshot`, :func:`params_of`, :func:`same`, :func:`changed`)
compare exactly (``torch.equal``): "unchanged" means bit for bit, and :func:`changed`
refuses a prefix that matches nothing, so a check cannot pass by comparing no tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from edgepfl.data.client import ClientData, ClientTensors
from edgepfl.methods import LocalContext, Method, create_method
from edgepfl.specs import ModelSpec, TrainConfig

CPU = torch.device("cpu")


def generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class MethodKit:
    """One test file's setup: label space, input shape, model spec, training defaults.

    The defaults are the tiny setup most method tests use: 4 classes of 1x28x28 images,
    the small CNN with 16 features, one epoch of batches of 16.
    """

    num_classes: int = 4
    input_shape: tuple[int, ...] = (1, 28, 28)
    spec: ModelSpec = field(default_factory=lambda: ModelSpec(arch="cnn", feature_dim=16))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=1, batch_size=16))
    #: options every :meth:`build` passes to the method, under the call's own options
    method_options: Mapping[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ context, models
    def ctx(self, seed: int = 0, *, round: int = 0, generator_seed: int | None = None,
            train: TrainConfig | None = None, **train_options: Any) -> LocalContext:
        """A CPU :class:`LocalContext`; its generator is seeded with ``generator_seed``
        (default ``seed``). ``train_options`` (epochs, batch_size, lr, ...) override the
        kit's training defaults; ``train`` replaces them."""
        if train is not None and train_options:
            raise TypeError("pass either train or train options, not both")
        if train is None:
            train = TrainConfig.model_validate({**self.train.model_dump(), **train_options})
        return LocalContext(train=train, device=CPU, round=round, seed=seed, num_classes=self.num_classes,
                            generator=generator(seed if generator_seed is None else generator_seed))

    def model(self, method: Method, seed: int = 0) -> nn.Module:
        """``method``'s model for this kit's spec and shapes, initialised from ``seed``."""
        torch.manual_seed(seed)
        return method.build_model(self.spec, self.input_shape, self.num_classes)

    def build(self, name: str, options: Mapping[str, Any] | None = None, seed: int = 0) -> tuple[Method, nn.Module]:
        """The registered method ``name`` with the kit's and the call's options, and its model."""
        method = create_method(name, {**self.method_options, **(options or {})})
        return method, self.model(method, seed)

    # ------------------------------------------------------------------ synthetic clients
    def gaussian_client(self, seed: int, n_train: int, classes: Iterable[int] | None = None, *,
                        shift: float = 0.0, n_test: int = 20) -> ClientData:
        """Numpy client: standard-normal images whose mean is ``shift + 0.5 * label``.

        Every listed class occurs (labels cycle through ``classes``, then are shuffled);
        ``shift`` makes two clients' inputs differ.
        """
        rng = np.random.default_rng(seed)
        labels = np.asarray(list(range(self.num_classes) if classes is None else classes))

        def split(n: int) -> tuple[np.ndarray, np.ndarray]:
            y = rng.permutation(np.resize(labels, n)).astype(np.int64)
            x = (rng.standard_normal((n, *self.input_shape)) + shift + 0.5 * y[:, None, None, None]).astype(np.float32)
            return x, y

        x_train, y_train = split(n_train)
        x_test, y_test = split(n_test)
        return ClientData(x_train, y_train, x_test, y_test, num_classes=self.num_classes)

    def quadrant_data(self, n: int = 48, seed: int = 0) -> ClientTensors:
        """Torch client: class k (of at most 4) brightens image quadrant k by 1.5 over
        N(0, 0.3^2) noise; learnable in a few steps. The test split is the training split."""
        if self.num_classes > 4:
            raise ValueError("quadrant_data has 4 quadrants: at most 4 classes")
        g = generator(seed)
        y = torch.arange(n) % self.num_classes
        x = 0.3 * torch.randn(n, *self.input_shape, generator=g)
        bh, bw = self.input_shape[-2] // 2, self.input_shape[-1] // 2
        for k in range(self.num_classes):
            r, c = divmod(k, 2)
            x[y == k, :, bh * r : bh * r + bh, bw * c : bw * c + bw] += 1.5
        return ClientTensors(x_train=x, y_train=y, x_test=x.clone(), y_test=y.clone(), num_classes=self.num_classes)

    def template_data(self, seed: int = 0, n_train: int = 48, n_test: int = 12, *, classes: Iterable[int] | None = None,
                      signal: float = 1.0, noise: float = 1.0, smooth: bool = False,
                      test_from_train: bool = False) -> ClientTensors:
        """Torch client: ``signal * template[label] + noise * N(0, 1)``, labels cycling
        through ``classes``.

        Templates are N(0, 1) images, or with ``smooth`` upsampled 4x4 noise made
        mirror-symmetric and scaled to unit std (so crops and flips keep the class).
        ``test_from_train``: the test split is a copy of the first ``n_test`` training
        samples instead of fresh draws.
        """
        g = generator(seed)
        c, h, w = self.input_shape
        if smooth:
            t = F.interpolate(torch.randn(self.num_classes, c, 4, 4, generator=g), size=(h, w), mode="bilinear",
                              align_corners=False)
            t = t + t.flip(-1)
            templates = t / t.std()
        else:
            templates = torch.randn(self.num_classes, *self.input_shape, generator=g)
        labels = torch.tensor(list(range(self.num_classes) if classes is None else classes))

        def split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            y = labels[torch.arange(n) % len(labels)]
            return signal * templates[y] + noise * torch.randn(n, *self.input_shape, generator=g), y

        x, y = split(n_train)
        if test_from_train:
            x_test, y_test = x[:n_test].clone(), y[:n_test].clone()
        else:
            x_test, y_test = split(n_test)
        return ClientTensors(x, y, x_test, y_test, self.num_classes)


# ---------------------------------------------------------------------- tensor checks


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``module.state_dict()``: parameters and buffers (BN statistics)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``module``'s parameters only (no buffers)."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def changed(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], prefix: str = "") -> set[str]:
    """Keys under ``prefix`` whose tensor differs between two snapshots.

    ``num_batches_tracked`` counters are left out (they tick on any train-mode forward
    pass). Raises if ``before`` holds no tensor under ``prefix``: an empty comparison
    would make "nothing changed" trivially true.
    """
    keys = [k for k in before if k.startswith(prefix) and not k.endswith("num_batches_tracked")]
    if not keys:
        raise AssertionError(f"no tensor under {prefix!r} to compare")
    return {k for k in keys if not torch.equal(before[k], after[k])}


def bn_modules(model: nn.Module) -> set[str]:
    """Names of ``model``'s BatchNorm modules."""
    return {name for name, m in model.named_modules() if isinstance(m, _BatchNorm)}


def bn_keys(model: nn.Module) -> set[str]:
    """``state_dict`` keys of ``model``'s BatchNorm modules (affine and statistics)."""
    bn = bn_modules(model)
    return {k for k in model.state_dict() if k.rpartition(".")[0] in bn}


def bn_inputs(module: nn.Module, forward, x: torch.Tensor, kind: type[nn.Module] = _BatchNorm) -> dict[str, torch.Tensor]:
    """The input each ``kind`` BatchNorm layer of ``module`` sees in one training-mode
    ``forward(x)`` of all of ``x``, by its name in ``module``: what a re-estimation of the
    running statistics on ``x`` must average."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, name=name: seen.__setitem__(name, inp[0].detach()))
             for name, m in module.named_modules() if isinstance(m, kind)]
    module.train()
    with torch.no_grad():
        forward(x)
    for h in hooks:
        h.remove()
    return seen


def eval_logits(method: Method, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``method``'s inference rule on ``x`` in eval mode, without gradients."""
    model.eval()
    with torch.no_grad():
        return method.logits(model, x)
