"""A client's local data: numpy arrays (torch-free) and their torch view for training."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..protocol.run import INPUT_DIMS, InputKind, kind_of_shape


@dataclass
class ClientData:
    """One client's train / held-out split, normalized float32 (N, *input_shape): images
    (N, C, H, W), series (N, C, T) or vectors (N, D)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    domain: str | None = None
    #: how raw inputs were normalized: {"mean": [...], "std": [...]} per channel (images in
    #: [0, 1] units, series and vectors in raw units); stored in export manifests so devices
    #: preprocess identically
    normalization: dict[str, Any] = field(default_factory=dict)
    #: a series' channels or a vector's features by name, in input order (None: unnamed)
    channel_names: list[str] | None = None

    def __post_init__(self) -> None:
        for name in ("x_train", "x_test"):
            arr = getattr(self, name)
            if arr.dtype != np.float32 or arr.ndim - 1 not in INPUT_DIMS.values():
                raise ValueError(f"{name} must be float32 (N, C, H, W), (N, C, T) or (N, D), got {arr.dtype}{arr.shape}")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(f"x_train samples are {self.x_train.shape[1:]}, x_test's {self.x_test.shape[1:]}")
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError("inputs and labels differ in length")

    def reordered(self, order: np.ndarray) -> ClientData:
        """The same data with its channels (axis 1) taken in ``order`` (from
        :func:`edgepfl.data.preprocess.channel_order`): inputs, per-channel statistics and names."""
        stats = {k: [v[i] for i in order] if k in ("mean", "std") else v for k, v in self.normalization.items()}
        names = None if self.channel_names is None else [self.channel_names[i] for i in order]
        return replace(self, x_train=np.ascontiguousarray(self.x_train[:, order]),
                       x_test=np.ascontiguousarray(self.x_test[:, order]), normalization=stats, channel_names=names)

    def paged(self, directory: str | Path) -> ClientData:
        """The same data with its inputs in ``directory`` (``x_train.npy``, ``x_test.npy``) read
        through memory maps: pages of a file, which the kernel reads in as they are used and
        may drop again, instead of the process's own memory. A head agent reads its samples
        only while it installs a release, and its fit child runs beside it on a device capped
        at 150 MB (docs/BENCHMARKS.md, "A whole head device in 150 MB"). The files are a
        cache of what was loaded, written anew each time (an old file is unlinked first, so a
        map of it stays valid)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        maps = {}
        for name in ("x_train", "x_test"):
            path = directory / f"{name}.npy"
            path.unlink(missing_ok=True)
            with open(path, "wb") as fh:
                np.save(fh, np.ascontiguousarray(getattr(self, name)), allow_pickle=False)
                fh.flush()
                # on disk now: clean pages, which the kernel may drop under a memory cap; dirty
                # ones it must write first, and under a busy disk a cap met them as an OOM kill
                os.fsync(fh.fileno())
            maps[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        return replace(self, **maps)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape: (C, H, W), (C, T) or (D,)."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def input_kind(self) -> InputKind:
        """What one sample is (``image``, ``series`` or ``vector``), from its shape."""
        return kind_of_shape(self.input_shape)

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
