"""Encoders and heads behind one split-model shape: ``encoder`` (x -> features) + heads.

Every method builds on :func:`build_encoder`; the default model is
:class:`SplitModel` (encoder + linear head). Weights for the torchvision
backbones are read only from a local file (``ModelSpec.weights``), never downloaded.

Besides the built-in encoders, ``model.arch`` may name a user's own (a *plugin*):
``module:callable`` or an ``edgepfl.models`` entry point (:func:`load_encoder_factory`).
It is built and checked by :func:`build_encoder` (:func:`check_encoder`) wherever a model
is built: the coordinator's initial model, a trainer's, an export's.
"""

from __future__ import annotations

import importlib
import math
import typing
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .._torch import nn, torch
from ..errors import ModelSpecError
from ..specs import BuiltinArch, is_import_path

if TYPE_CHECKING:  # pragma: no cover
    from ..specs import ModelSpec

ModelT = TypeVar("ModelT", bound="nn.Module")


class Encoder(nn.Module):
    """An input encoder: (N, *input_shape) -> (N, ``out_features``)."""

    #: size of the feature vector; the heads built on an encoder are sized from it
    out_features: int


class ConvTrunk(nn.Sequential):
    """Conv blocks whose activations run channels-last on the CPU.

    oneDNN's channels-last convolution and max-pooling kernels make a training step of the
    28x28 CNNs about a third cheaper on one x86 core (docs/BENCHMARKS.md, "Channels-last
    activations"). Only activations change layout: the weights, and so every state dict,
    checkpoint, update on the wire and ONNX file, keep the default one. The first layer's
    output is converted rather than the input, because a one-channel image is laid out
    alike in both formats and would not select the fast kernels. On other devices the
    trunk is a plain ``nn.Sequential``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, *rest = self
        x = first(x)
        if x.dim() == 4 and x.device.type == "cpu":
            x = x.contiguous(memory_format=torch.channels_last)
        for layer in rest:
            x = layer(x)
        return x


class SmallCNN(Encoder):
    """Two conv blocks and a linear layer; the usual 28x28 / 32x32 FL network.

    conv5-[BN]-act-pool2 -> conv5-[BN]-act-pool2 -> flatten -> Linear -> act. The
    defaults are ``arch: cnn`` (32 and 64 channels, ReLU); ``arch: fedpac_cnn`` is the
    CNN of FedPAC's published code (16 and 32 channels, the second conv padded by one,
    LeakyReLU), see :func:`build_encoder`.
    """

    def __init__(self, in_channels: int, image_size: int, feature_dim: int = 128, norm: str = "batch",
                 widths: tuple[int, int] = (32, 64), second_padding: int = 0, leaky: bool = False):
        super().__init__()

        def activation() -> nn.Module:
            return nn.LeakyReLU(inplace=True) if leaky else nn.ReLU(inplace=True)

        def block(cin: int, cout: int, padding: int) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Conv2d(cin, cout, 5, padding=padding)]
            if norm == "batch":
                layers.append(nn.BatchNorm2d(cout))
            layers += [activation(), nn.MaxPool2d(2)]
            return layers

        first, second = widths
        self.conv = ConvTrunk(*block(in_channels, first, 0), *block(first, second, second_padding), nn.Flatten())
        side = ((image_size - 4) // 2 - 4 + 2 * second_padding) // 2
        if side < 1:
            raise ModelSpecError(f"model.arch cnn / fedpac_cnn (a SmallCNN) needs images of at least "
                                 f"{16 - 2 * second_padding} px, and these are {image_size} px: use model.arch mlp")
        self.fc = nn.Sequential(nn.Linear(second * side * side, feature_dim), activation())
        self.out_features = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))


class MLPEncoder(Encoder):
    """Flatten -> Linear-ReLU-Linear-ReLU; for vectors and tiny inputs such as 8x8 digits."""

    def __init__(self, in_features: int, feature_dim: int = 128, hidden: int = 256, norm: str = "batch"):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, hidden)]
        if norm == "batch":
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.ReLU(inplace=True), nn.Linear(hidden, feature_dim), nn.ReLU(inplace=True)]
        self.net = nn.Sequential(*layers)
        self.out_features = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Conv1dEncoder(Encoder):
    """``arch: cnn1d``, for series (N, C, T): two conv blocks, a global average over time, a linear layer.

    conv5-[BN]-ReLU -> conv5 stride 2-[BN]-ReLU -> mean over time -> Linear -> ReLU. Both
    convolutions are padded by 2, so any length T >= 1 fits, and the linear layer's size does
    not depend on T.
    """

    def __init__(self, in_channels: int, feature_dim: int = 128, norm: str = "batch", widths: tuple[int, int] = (32, 64)):
        super().__init__()

        def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Conv1d(cin, cout, 5, stride=stride, padding=2)]
            if norm == "batch":
                layers.append(nn.BatchNorm1d(cout))
            layers.append(nn.ReLU(inplace=True))
            return layers

        first, second = widths
        self.conv = nn.Sequential(*block(in_channels, first, 1), *block(first, second, 2), nn.AdaptiveAvgPool1d(1),
                                  nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(second, feature_dim), nn.ReLU(inplace=True))
        self.out_features = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))


class IdentityEncoder(Encoder):
    """No encoder (``arch: identity``): inputs already are features, flattened to (N, out_features).

    A method's model built on it is the method's head parts alone, which is how a method's
    own head is fitted on the features of an exported, frozen encoder.
    """

    def __init__(self, in_features: int):
        super().__init__()
        self.out_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


#: the archs :class:`TorchvisionEncoder` builds: only where torchvision is installed
TORCHVISION_ARCHS = ("resnet18", "mobilenet_v3_small")


class TorchvisionEncoder(Encoder):
    """ResNet-18 or MobileNetV3-Small trunk with the classifier removed."""

    def __init__(self, arch: str, in_channels: int, weights: str | None = None):
        super().__init__()
        import torchvision

        if arch == "resnet18":
            net = torchvision.models.resnet18(weights=None)
            if weights:
                _load_local_weights(net, weights)
            if in_channels != 3:
                net.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.out_features = net.fc.in_features
            net.fc = nn.Identity()
        elif arch == "mobilenet_v3_small":
            net = torchvision.models.mobilenet_v3_small(weights=None)
            if weights:
                _load_local_weights(net, weights)
            if in_channels != 3:
                first = net.features[0][0]
                net.features[0][0] = nn.Conv2d(in_channels, first.out_channels, 3, 2, 1, bias=False)
            self.out_features = net.classifier[0].in_features
            net.classifier = nn.Identity()
        else:
            raise ValueError(f"unknown torchvision arch {arch!r}")
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _load_local_weights(net: nn.Module, path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model weights file not found: {p} (weights are never downloaded)")
    state = torch.load(p, map_location="cpu", weights_only=True)
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{p}: unexpected keys {unexpected[:5]}")


#: every ``model.arch`` edgepfl builds itself; any other value names a plugin encoder
BUILTIN_ARCHS: tuple[str, ...] = typing.get_args(BuiltinArch)
#: the entry-point group a package registers its encoders in (``name = "module:callable"``)
ENTRY_POINT_GROUP = "edgepfl.models"
#: the batch a plugin encoder is checked on (:func:`check_encoder`)
CHECK_BATCH = 3


def is_plugin_arch(arch: str) -> bool:
    """Whether ``arch`` names a user's encoder (an import path or an entry point), not a built-in."""
    return arch not in BUILTIN_ARCHS


def installed_plugin_archs() -> list[str]:
    """The names of the ``edgepfl.models`` entry points installed here (not loaded)."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_encoder_factory(arch: str) -> Callable[..., nn.Module]:
    """The callable a plugin ``arch`` names: ``module:callable`` imported (the module from
    ``sys.path``: an installed package or a folder on ``PYTHONPATH``), or the entry point of
    that name in the ``edgepfl.models`` group loaded. Anything that fails is one
    :class:`~edgepfl.errors.ModelSpecError` line naming the arch."""
    if is_import_path(arch):
        module_name, _, attribute = arch.partition(":")
        try:
            target: object = importlib.import_module(module_name)
        except ImportError as exc:
            raise ModelSpecError(f"model.arch {arch}: cannot import {module_name} ({exc}); install the package that "
                                 "provides it, or put its folder on PYTHONPATH") from None
        except Exception as exc:  # the plugin's own module fails while it is imported: its error, named
            raise ModelSpecError(f"model.arch {arch}: importing {module_name} failed: {_one_line(exc)}") from None
        for part in attribute.split("."):
            if not hasattr(target, part):
                raise ModelSpecError(f"model.arch {arch}: {module_name} has no {attribute}") from None
            target = getattr(target, part)
    else:
        found = entry_points(group=ENTRY_POINT_GROUP, name=arch)
        if not found:
            installed = ", ".join(installed_plugin_archs()) or "none installed"
            raise ModelSpecError(f"model.arch {arch!r} is neither a built-in encoder ({', '.join(BUILTIN_ARCHS)}) nor "
                                 f"an import path module:callable nor an {ENTRY_POINT_GROUP} entry point ({installed})")
        entry = next(iter(found))
        try:
            target = entry.load()
        except Exception as exc:  # a missing module or attribute of the package that declares it
            raise ModelSpecError(f"model.arch {arch} (entry point {entry.value}): cannot load it: "
                                 f"{_one_line(exc)}") from None
    if not callable(target):
        raise ModelSpecError(f"model.arch {arch}: {type(target).__name__} object is not callable")
    return typing.cast(Callable[..., nn.Module], target)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class PluginEncoder(Encoder):
    """A user's encoder (``model.arch`` a plugin) under the name ``net``: its tensors are
    ``encoder.net.<its own names>``, so every method's shared / personal split applies to it
    as to a built-in encoder."""

    def __init__(self, arch: str, net: nn.Module, feature_dim: int):
        super().__init__()
        self.arch = arch
        self.net = net
        self.out_features = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _plugin_encoder(spec: ModelSpec, input_shape: tuple[int, ...]) -> PluginEncoder:
    """Build the plugin ``spec.arch`` names, called as ``factory(input_shape, feature_dim, norm)``, and check it."""
    factory = load_encoder_factory(spec.arch)
    try:
        net = factory(tuple(input_shape), spec.feature_dim, spec.norm)
    except ModelSpecError:
        raise
    except Exception as exc:  # the user's code: its error, on one line naming it
        raise ModelSpecError(f"model.arch {spec.arch}: building the encoder for inputs {tuple(input_shape)} failed: "
                             f"{_one_line(exc)}") from None
    if not isinstance(net, nn.Module):
        raise ModelSpecError(f"model.arch {spec.arch}: returned a {type(net).__name__}, not a torch.nn.Module")
    encoder = PluginEncoder(spec.arch, net, spec.feature_dim)
    check_encoder(encoder, spec, input_shape)
    return encoder


def check_encoder(encoder: nn.Module, spec: ModelSpec, input_shape: tuple[int, ...]) -> None:
    """Check that ``encoder`` is one a run can train, share and export; each failure is one
    :class:`~edgepfl.errors.ModelSpecError` line naming ``spec.arch``.

    :func:`build_encoder` calls it on every plugin encoder, so a run refuses a bad one when it
    starts (the coordinator's initial model) and an agent before it trains; a plugin's own tests
    may call it too. The checks: with ``norm: none`` no BatchNorm layer (with ``norm: batch`` an
    encoder may have BatchNorm or not); trainable parameters, and a state of floating-point
    tensors only (what travels is float; BatchNorm's step counter aside); on a batch of
    :data:`CHECK_BATCH` seeded standard-normal inputs, in eval mode: a float32 output of shape
    (batch, ``spec.feature_dim``), finite, that depends on the trainable parameters. The check
    moves no global random state and no parameter or statistic.
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    where = f"model.arch {spec.arch}"
    if spec.norm == "none":
        batchnorm = [name for name, module in encoder.named_modules() if isinstance(module, _BatchNorm)]
        if batchnorm:
            raise ModelSpecError(f"{where}: the encoder has BatchNorm layers ({', '.join(batchnorm[:3])}) and "
                                 "model.norm is none; build it without them for norm none, or set model.norm: batch")
    if not any(p.requires_grad for p in encoder.parameters()):
        raise ModelSpecError(f"{where}: the encoder has no trainable parameters (a layer kept in a plain list or "
                             "dict is not registered: use nn.ModuleList / nn.ModuleDict)")
    for key, tensor in encoder.state_dict().items():
        if not tensor.is_floating_point() and not key.endswith("num_batches_tracked"):
            raise ModelSpecError(f"{where}: the encoder's state {key} is {tensor.dtype}; every tensor a model shares "
                                 "is floating-point (register it with persistent=False to keep it out of the state)")
    if any(p.is_meta for p in encoder.parameters()):  # built on the meta device to be counted: no values to run
        return
    sample = torch.randn(CHECK_BATCH, *input_shape, generator=torch.Generator().manual_seed(0))
    shape_text = "x".join(map(str, input_shape))
    modes = {module: module.training for module in encoder.modules()}
    try:
        with torch.random.fork_rng(devices=[]):
            encoder.eval()
            out = encoder(sample)
    except Exception as exc:  # the user's forward: its error, on one line
        raise ModelSpecError(f"{where}: the encoder fails on a batch of {CHECK_BATCH} inputs {shape_text}: "
                             f"{_one_line(exc)}") from None
    finally:
        for module, training in modes.items():
            module.training = training
    if not isinstance(out, torch.Tensor):
        raise ModelSpecError(f"{where}: the encoder returns a {type(out).__name__}, not a tensor")
    if tuple(out.shape) != (CHECK_BATCH, spec.feature_dim):
        raise ModelSpecError(f"{where}: the encoder maps a batch of {CHECK_BATCH} inputs {shape_text} to shape "
                             f"{tuple(out.shape)}, not ({CHECK_BATCH}, {spec.feature_dim}) (model.feature_dim)")
    if out.dtype != torch.float32:
        raise ModelSpecError(f"{where}: the encoder returns {out.dtype} features, not torch.float32")
    if not bool(torch.isfinite(out).all()):
        raise ModelSpecError(f"{where}: the encoder returns non-finite features (NaN or inf) on a batch of "
                             f"{CHECK_BATCH} seeded standard-normal inputs {shape_text}")
    if not out.requires_grad:
        raise ModelSpecError(f"{where}: the encoder's output does not depend on its trainable parameters "
                             "(detached, or computed without them)")


def build_encoder(spec: ModelSpec, input_shape: tuple[int, ...]) -> Encoder:
    """An encoder mapping (N, *input_shape) to (N, encoder.out_features): a built-in, or a
    plugin (:func:`load_encoder_factory`) checked by :func:`check_encoder`. An input shape
    an arch cannot take is a :class:`~edgepfl.errors.ModelSpecError`."""
    if is_plugin_arch(spec.arch):
        return _plugin_encoder(spec, input_shape)
    if spec.arch == "identity":
        return IdentityEncoder(math.prod(input_shape))
    if spec.arch == "mlp":
        return MLPEncoder(math.prod(input_shape), spec.feature_dim, norm=spec.norm)
    if spec.arch == "cnn1d":
        if len(input_shape) != 2:
            raise ModelSpecError(f"model.arch cnn1d takes series C x T, and the inputs are "
                                 f"{'x'.join(map(str, input_shape))}: use cnn for images, mlp for vectors")
        return Conv1dEncoder(input_shape[0], spec.feature_dim, spec.norm)
    if len(input_shape) != 3:
        raise ModelSpecError(f"model.arch {spec.arch} takes images C x H x W, and the inputs are "
                             f"{'x'.join(map(str, input_shape))}: use cnn1d for series C x T, mlp for vectors")
    c, h, w = input_shape
    if spec.arch == "cnn":
        return SmallCNN(c, min(h, w), spec.feature_dim, spec.norm)
    if spec.arch == "fedpac_cnn":  # JianXu95/FedPAC, models/cnn.py, CNN_FMNIST
        return SmallCNN(c, min(h, w), spec.feature_dim, spec.norm, widths=(16, 32), second_padding=1, leaky=True)
    return TorchvisionEncoder(spec.arch, c, spec.weights)


class SplitModel(nn.Module):
    """``encoder`` (x -> features) followed by a ``head`` (features -> logits).

    :meth:`build` makes the default model, a linear head on the encoder. A method whose
    model has more parts (DualFed, RepPer, FedRoD, FedPick) extends this class: the
    encoder and the head keep these names, and so the ``state_dict`` keys ``encoder.*``
    and ``head.*`` (docs/MODELS.md), and its own parts are registered after them.
    """

    def __init__(self, encoder: nn.Module, head: nn.Module):
        super().__init__()
        self.encoder = encoder
        self.head = head

    @classmethod
    def build(cls, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> SplitModel:
        encoder = build_encoder(spec, input_shape)
        return cls(encoder, nn.Linear(encoder.out_features, num_classes))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def model_as(model: nn.Module, cls: type[ModelT]) -> ModelT:
    """``model``, typed as the ``cls`` that a method's ``build_model`` makes.

    The method interface passes models as ``nn.Module``; a method that uses its own
    parts (a personal head, an extractor) narrows with this. A model some other
    ``build_model`` made is a TypeError naming both classes, not an AttributeError
    deep inside training.
    """
    if not isinstance(model, cls):
        raise TypeError(f"expected the {cls.__name__} this method builds, got a {type(model).__name__}")
    return model


__all__ = [
    "BUILTIN_ARCHS", "CHECK_BATCH", "ENTRY_POINT_GROUP", "TORCHVISION_ARCHS", "Conv1dEncoder", "ConvTrunk", "Encoder",
    "IdentityEncoder", "MLPEncoder", "PluginEncoder", "SmallCNN", "SplitModel", "TorchvisionEncoder",
    "build_encoder", "check_encoder", "installed_plugin_archs", "is_import_path", "is_plugin_arch",
    "load_encoder_factory", "model_as",
]
