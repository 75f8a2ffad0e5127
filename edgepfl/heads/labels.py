"""What a head's labels mean: the label space a head is fitted in, and its class names.

A head predicts integer labels. What label ``i`` *means* depends on where the head was
fitted: on the federation's classes (label ``i`` is the run spec's ``class_names[i]``)
or on a device's own classes (an image folder's sorted sub-folders: label ``i`` is that
folder's ``i``-th name). Mapping one through the other's names gives wrong answers
(a Sandal printed as "Dress"), so every head records the names of its own labels and
nobody guesses them. :class:`LabelSpace` is that fact, :func:`label_space_for` the one
rule for choosing it, and a head's ONNX file (``edgepfl.export.heads``) stores it.
A trainer has no such freedom: its model's outputs are the run's classes, so
:func:`run_label_index` maps its data onto the run's numbering or says why it cannot
(docs/PROTOCOL.md §5, Labels).

Torch- and scikit-learn-free: the head tier imports this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["FEDERATION", "LOCAL", "LabelMismatch", "LabelSpace", "label_space_for", "placeholder_names",
           "run_label_index"]

FEDERATION: Literal["federation"] = "federation"
LOCAL: Literal["local"] = "local"


@dataclass(frozen=True)
class LabelSpace:
    """Label ``i`` means ``names[i]``; ``kind`` says whose numbering it is.

    ``federation``: the federation's class indices (the run spec's ``class_names``), so a
    head fitted on a device can be compared with, and swapped for, one fitted offline.
    ``local``: a new task's own classes, numbered in the order of ``names``.
    """

    names: tuple[str, ...]
    kind: Literal["federation", "local"]

    def column_names(self, classes: Sequence[int] | np.ndarray) -> list[str]:
        """Names of a head's probability columns, given its ``classes_`` (labels, in column order)."""
        out = []
        for c in np.asarray(classes).tolist():
            if not isinstance(c, int) or not 0 <= c < len(self.names):
                raise ValueError(f"head label {c!r} has no name among the {len(self.names)} classes {list(self.names)}")
            out.append(self.names[c])
        return out


def label_space_for(local_names: Sequence[str], federation_names: Sequence[str]) -> tuple[LabelSpace, np.ndarray]:
    """The label space a device's data is fitted in, and its labels' translation into it.

    Returns ``(space, index)`` where ``index[local_label]`` is that label in ``space``.
    When every local class name is one of the federation's, the data joins the
    federation's numbering (whatever order its folders sort in); otherwise it is a new
    task numbered by its own names. Unnamed local data (no names, or the placeholders
    ``"0"`` .. ``"K-1"`` of a dataset without names) is taken as the federation's
    numbering, as a pooled dataset's partition is.
    """
    fed = [str(n) for n in federation_names]
    local = [str(n) for n in local_names]
    if fed and (not local or (placeholder_names(local) and len(local) <= len(fed))):
        return LabelSpace(tuple(fed), FEDERATION), np.arange(len(local) or len(fed), dtype=np.int64)
    if fed and set(local) <= set(fed):
        return LabelSpace(tuple(fed), FEDERATION), np.array([fed.index(n) for n in local], dtype=np.int64)
    return LabelSpace(tuple(local), LOCAL), np.arange(len(local), dtype=np.int64)


def placeholder_names(names: Sequence[str]) -> bool:
    """Whether ``names`` are the placeholders ``"0"`` .. ``"K-1"`` that data without class names gets."""
    return [str(n) for n in names] == [str(i) for i in range(len(names))]


class LabelMismatch(ValueError):
    """Local data whose classes are not the run's; the message names the names that differ."""


def run_label_index(local_names: Sequence[str], run_names: Sequence[str]) -> np.ndarray | None:
    """How a trainer's local labels become the run's: ``index[local_label]`` is that label
    in the run's numbering, or None when the local labels are the run's already (the same
    names in the same order, or either side without names: placeholders or none).

    Raises :class:`LabelMismatch` when both sides name their classes and the names are
    not the same set: no numbering of the local data trains the run's model.
    """
    local, run = [str(n) for n in local_names], [str(n) for n in run_names]
    if not local or not run or placeholder_names(local) or placeholder_names(run) or local == run:
        return None
    if sorted(local) != sorted(run):
        missing, extra = sorted(set(run) - set(local)), sorted(set(local) - set(run))
        differ = [f"lacks {missing}" if missing else "", f"has {extra}, which the run does not" if extra else ""]
        why = ("the local data " + " and ".join(d for d in differ if d) if missing or extra
               else f"a class is named twice (local {local}, run {run})")
        raise LabelMismatch(f"class names differ from the run's: {why}")
    _, index = label_space_for(local, run)
    return index
