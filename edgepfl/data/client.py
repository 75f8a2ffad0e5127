"""A client's local data: numpy arrays (torch-free) and their torch view for training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ClientData:
    """One client's train / held-out split, images normalized float32 (N, C, H, W)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    domain: str | None = None
    #: how raw inputs were normalized: {"mean": [...], "std": [...]} per channel;
    #: stored in export manifests so devices preprocess identically
    normalization: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("x_train", "x_test"):
            arr = getattr(self, name)
            if arr.dtype != np.float32 or arr.ndim != 4:
                raise ValueError(f"{name} must be float32 (N, C, H, W), got {arr.dtype}{arr.shape}")
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError("inputs and labels differ in length")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        c, h, w = self.x_train.shape[1:]
        return int(c), int(h), int(w)

    @property
    def num_train(self) -> int:
        return len(self.y_train)

    @property
    def num_test(self) -> int:
        return len(self.y_test)

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.y_train, minlength=self.num_classes)

    def to_torch(self, device: Any = "cpu") -> ClientTensors:
        import torch

        def t(a, dtype):
            return torch.as_tensor(a, dtype=dtype, device=device)

        return ClientTensors(
            x_train=t(self.x_train, torch.float32),
            y_train=t(self.y_train, torch.long),
            x_test=t(self.x_test, torch.float32),
            y_test=t(self.y_test, torch.long),
            num_classes=self.num_classes,
        )


@dataclass
class ClientTensors:
    """The torch view of :class:`ClientData`, already on the training device."""

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    num_classes: int

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def class_counts(self):
        import torch

        return torch.bincount(self.y_train, minlength=self.num_classes)
