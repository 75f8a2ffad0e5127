"""Encoders and heads behind one split-model shape: ``encoder`` (x -> features) + heads.

Every method builds on :func:`build_encoder`; the default model is
:class:`SplitModel` (encoder + linear head). Weights for the torchvision
backbones are read only from a local file (``ModelSpec.weights``), never downloaded.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .._torch import nn, torch
from ..errors import ModelSpecError

if TYPE_CHECKING:  # pragma: no cover
    from ..specs import ModelSpec

ModelT = TypeVar("ModelT", bound="nn.Module")


class Encoder(nn.Module):
    """An image encoder: (N, *input_shape) -> (N, ``out_features``)."""

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
    """Flatten -> Linear-ReLU-Linear-ReLU; for tiny inputs such as 8x8 digits."""

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


def build_encoder(spec: ModelSpec, input_shape: tuple[int, ...]) -> Encoder:
    """An encoder mapping (N, *input_shape) to (N, encoder.out_features)."""
    if spec.arch == "identity":
        return IdentityEncoder(math.prod(input_shape))
    c, h, w = input_shape
    if spec.arch == "cnn":
        return SmallCNN(c, min(h, w), spec.feature_dim, spec.norm)
    if spec.arch == "fedpac_cnn":  # JianXu95/FedPAC, models/cnn.py, CNN_FMNIST
        return SmallCNN(c, min(h, w), spec.feature_dim, spec.norm, widths=(16, 32), second_padding=1, leaky=True)
    if spec.arch == "mlp":
        return MLPEncoder(c * h * w, spec.feature_dim, norm=spec.norm)
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
    "TORCHVISION_ARCHS", "ConvTrunk", "Encoder", "IdentityEncoder", "MLPEncoder", "SmallCNN", "SplitModel", "TorchvisionEncoder",
    "build_encoder",
    "model_as",
]
