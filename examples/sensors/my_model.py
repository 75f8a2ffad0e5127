"""My own encoder for 6-channel sensor windows: a small 1-D CNN in plain PyTorch.

edgepfl builds it from the federation config's ``model.arch: my_model:build`` (this file's
folder on PYTHONPATH) and wraps it with the method's head; it needs no edgepfl import.
The contract (docs/MODELS.md, "Your own encoder"): ``build(input_shape, feature_dim, norm)``
returns an ``nn.Module`` mapping float32 (N, C, T) to float32 (N, feature_dim), with
BatchNorm only where ``norm`` is "batch".
"""

from __future__ import annotations

import torch
from torch import nn


class WindowCNN(nn.Module):
    """Two strided convolutions over time, then the mean and the max of each feature map over time."""

    def __init__(self, channels: int, feature_dim: int, batchnorm: bool):
        super().__init__()

        def norm(width: int) -> nn.Module:
            return nn.BatchNorm1d(width) if batchnorm else nn.Identity()

        self.body = nn.Sequential(
            nn.Conv1d(channels, 32, kernel_size=7, stride=2, padding=3), norm(32), nn.ReLU(),
            nn.Conv1d(32, 32, kernel_size=5, stride=2, padding=2), norm(32), nn.ReLU(),
        )
        # mean and max over time: a standing wrist and a running one differ in both
        self.out = nn.Linear(64, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.out(torch.cat([h.mean(dim=-1), h.amax(dim=-1)], dim=1))


def build(input_shape: tuple[int, ...], feature_dim: int, norm: str) -> nn.Module:
    """The encoder for windows of ``input_shape`` (channels, samples)."""
    channels, _samples = input_shape
    return WindowCNN(channels, feature_dim, batchnorm=norm == "batch")
