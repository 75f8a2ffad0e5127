"""A small 1-D CNN for sensor windows (channels x samples); no edgepfl import, only torch."""

from __future__ import annotations

import torch
from torch import nn


class WindowCNN(nn.Module):
    """conv5-[BN]-ReLU -> conv3-[BN]-ReLU -> mean over time -> Linear: (N, C, T) -> (N, feature_dim)."""

    def __init__(self, channels: int, feature_dim: int, batchnorm: bool):
        super().__init__()

        def norm(width: int) -> nn.Module:
            return nn.BatchNorm1d(width) if batchnorm else nn.Identity()

        self.body = nn.Sequential(nn.Conv1d(channels, 16, 5, padding=2), norm(16), nn.ReLU(),
                                  nn.Conv1d(16, 16, 3, padding=1), norm(16), nn.ReLU())
        self.out = nn.Linear(16, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x).mean(dim=-1))


def build(input_shape: tuple[int, ...], feature_dim: int, norm: str) -> nn.Module:
    """The encoder edgepfl builds for ``model.arch: toy-cnn1d``: inputs (C, T), BatchNorm where ``norm`` is "batch"."""
    channels, _ = input_shape
    return WindowCNN(channels, feature_dim, batchnorm=norm == "batch")
