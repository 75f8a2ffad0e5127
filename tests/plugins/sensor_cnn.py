"""A user's own encoder, as a user writes it: a plain module outside the package, no edgepfl import.

``model.arch: sensor_cnn:build`` with this folder on the Python path builds :func:`build`: a
1-D CNN for sensor windows (channels x samples). The other callables are the mistakes the
run's check must name, one each (tests/unit/models/test_plugin_encoders.py).
"""

from __future__ import annotations

import torch
from torch import nn


class SensorCNN(nn.Module):
    """conv7-[BN]-ReLU -> conv5-[BN]-ReLU -> max over time -> Linear: (N, C, T) -> (N, feature_dim)."""

    def __init__(self, channels: int, feature_dim: int, batchnorm: bool):
        super().__init__()

        def norm(width: int) -> nn.Module:
            return nn.BatchNorm1d(width) if batchnorm else nn.Identity()

        self.body = nn.Sequential(nn.Conv1d(channels, 24, 7, padding=3), norm(24), nn.ReLU(),
                                  nn.Conv1d(24, 32, 5, padding=2), norm(32), nn.ReLU())
        self.out = nn.Linear(32, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x).amax(dim=-1))


def build(input_shape: tuple[int, ...], feature_dim: int, norm: str) -> nn.Module:
    """The encoder for inputs (C, T), with BatchNorm where ``norm`` is "batch"."""
    channels, _ = input_shape
    return SensorCNN(channels, feature_dim, batchnorm=norm == "batch")


# ----------------------------------------------------------------------- mistakes


class _Fixed(nn.Module):
    """A linear map on the flattened input, followed by ``then``."""

    def __init__(self, in_features: int, out_features: int, then=lambda y: y):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.linear(x.flatten(1)))


def wrong_width(input_shape, feature_dim, norm):
    """Ignores feature_dim."""
    return _Fixed(int(torch.tensor(input_shape).prod()), 7)


def nan_output(input_shape, feature_dim, norm):
    """Divides by zero."""
    return _Fixed(int(torch.tensor(input_shape).prod()), feature_dim, then=lambda y: y / torch.zeros_like(y))


def int_output(input_shape, feature_dim, norm):
    """Rounds its features to integers."""
    return _Fixed(int(torch.tensor(input_shape).prod()), feature_dim, then=lambda y: y.long())


def always_batchnorm(input_shape, feature_dim, norm):
    """Has BatchNorm whatever ``norm`` says."""
    return build(input_shape, feature_dim, "batch")


def not_a_module(input_shape, feature_dim, norm):
    """Returns a function."""
    return lambda x: x


def fails_to_build(input_shape, feature_dim, norm):
    """Expects images."""
    channels, height, width = input_shape
    return _Fixed(channels * height * width, feature_dim)


class _Unregistered(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.layers = [nn.Linear(in_features, out_features)]  # a plain list: not registered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x.flatten(1))


def unregistered_layers(input_shape, feature_dim, norm):
    """Keeps its layer in a plain list."""
    return _Unregistered(int(torch.tensor(input_shape).prod()), feature_dim)


class _Unexportable(nn.Module):
    """Trains and runs in torch; its FFT has no ONNX export at the exporter's opset."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.fft.fft(x).abs().flatten(1))


def unexportable(input_shape, feature_dim, norm):
    """Uses an op that torch cannot export to ONNX."""
    return _Unexportable(int(torch.tensor(input_shape).prod()), feature_dim)


not_callable = 3


def tiny_mlp(input_shape: tuple[int, ...], feature_dim: int, norm: str) -> nn.Module:
    """Any input, flattened: Linear-ReLU-Linear (for runs on small images)."""
    size = int(torch.tensor(input_shape).prod())
    return nn.Sequential(nn.Flatten(), nn.Linear(size, 32), nn.ReLU(), nn.Linear(32, feature_dim))
