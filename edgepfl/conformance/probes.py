"""Evaluate tasks whose right answer depends on what the agent computes.

An agent can answer every task on time, with well-formed frames, and still compute the
wrong thing: inputs scaled by 1/255 and nothing more, its own data file's normalization
instead of the task's, or its local label numbers taken for the run's. Nothing in a frame
shows that; the accuracy does. So the kit trains, itself, a payload that classifies every
sample of the agent's data correctly under a normalization of its choosing (not the data
file's), and sends it in an ``evaluate`` task:

* ``task.preprocessing``: the task says that normalization; an agent that preprocesses as
  ``run.data`` says scores about 100 % on any held-out split, one that does not scores
  near chance (:func:`discrimination` measures both on the kit's own model);
* ``task.class_order``: the same payload with the run's class names in another order and
  the head's rows permuted to match: an agent that maps its local labels onto the run's
  order (PROTOCOL §5, Labels) scores the same, one that takes its local numbers for the
  run's scores near 0 (the permutation moves every class).

The same two models go out again as train tasks (``train.preprocessing``,
``train.class_order``: :func:`training_probe`, :func:`variance_ratio`), for an agent that
computes right only where it evaluates; and a head agent gets a release whose encoder keeps
nothing of wrongly preprocessed inputs (``head.preprocessing``: :func:`threshold_encoder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepfl.protocol import Normalization, RunSpec

#: the normalization the probes' tasks announce: 15 times narrower than the data file's (std ~0.3),
#: so that neither x / 255 alone nor the file's own normalization feeds the model what it was trained on
PROBE_NORMALIZATION = Normalization(mean=[0.5], std=[0.02])
#: run index i is local class PERMUTATION[i]: every class moves (a derangement of 4)
PERMUTATION = (1, 2, 3, 0)
#: an answer's accuracy at or above this passes (the kit's model scores 100 % on every sample)
MIN_ACCURACY = 0.9
#: probe training: full-batch Adam steps on the whole data set
_STEPS, _LR = 150, 0.01
#: the training probes' epochs: each moves a BatchNorm running statistic (momentum 0.1) 10 % of the
#: way per batch, so after two epochs of the kit's data (5 batches each) about 0.35 of the model's
#: statistic is left when the agent trained on other inputs than the task describes
TRAIN_EPOCHS = 2
#: ``train.preprocessing`` passes when the trained first BatchNorm running variance over the model's
#: is in this range: a right trainer measured 0.95-1.0, x / 255 alone and the file's normalization 0.35
VARIANCE_RATIO = (0.7, 1.43)


@dataclass(frozen=True)
class Probe:
    """An evaluate task's run spec and payload, and the accuracy an agent must reach."""

    run: RunSpec
    payload: dict[str, np.ndarray]


def read_data(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(raw uint8 images N×C×H×W, labels, class names) of the kit's data file."""
    with np.load(path) as data:
        return data["x"], data["y"].astype(np.int64), [str(n) for n in data["class_names"]]


def preprocess(pixels: np.ndarray, normalization: Normalization, pixel_scale: float = 1 / 255) -> np.ndarray:
    """``(p · pixel_scale − mean[c]) / std[c]`` per channel, float32 (PROTOCOL §5, Preprocessing)."""
    mean = np.asarray(normalization.mean, np.float64).reshape(1, -1, 1, 1)
    std = np.asarray(normalization.std, np.float64).reshape(1, -1, 1, 1)
    return ((pixels.astype(np.float64) * pixel_scale - mean) / std).astype(np.float32)


def build_probes(run: RunSpec, data_path: Path) -> tuple[Probe, Probe]:
    """(the preprocessing probe, the class-order probe) for ``run``'s method and model."""
    from edgepfl._torch import torch
    from edgepfl.methods import create_method
    from edgepfl.methods.base import load_tensors

    pixels, labels, names = read_data(data_path)
    probe_run = under_probe_normalization(run)
    torch.manual_seed(1)
    method = create_method(run.method.name, run.method.options)
    model = method.build_model(run.model, run.data.input_shape, run.data.num_classes)
    shared = set(method.payload_for(method.init_server(model), "probe"))
    x = torch.from_numpy(preprocess(pixels, PROBE_NORMALIZATION, run.data.pixel_scale))
    y = torch.from_numpy(labels)
    optimizer = torch.optim.Adam(model.parameters(), lr=_LR)
    model.train()
    for _ in range(_STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(method.logits(model, x), y).backward()
        optimizer.step()
    model.eval()
    payload = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items() if k in shared}
    load_tensors(model, payload)
    with torch.no_grad():
        scored = float((method.logits(model, x).argmax(1) == y).float().mean())
    if scored < 1.0:
        raise RuntimeError(f"the kit's probe model scores {scored:.2%} on the data it was trained on, not 100 %")
    plain = Probe(probe_run, payload)
    return plain, permuted(plain, names)


def permuted(probe: Probe, names: list[str]) -> Probe:
    """``probe`` with the run's class names in :data:`PERMUTATION` order and every tensor
    indexed by class (first axis of length ``num_classes`` under ``head.``) permuted alike:
    output i of the new model is output PERMUTATION[i] of the old, the class now named i."""
    classes = probe.run.data.num_classes
    order = list(PERMUTATION)
    run = probe.run.model_copy(update={"data": probe.run.data.model_copy(
        update={"class_names": [names[j] for j in order]})})
    payload = {k: (v[order].copy() if k.startswith("head.") and v.ndim >= 1 and v.shape[0] == classes else v)
               for k, v in probe.payload.items()}
    return Probe(run, payload)


#: the head probe's encoder passes a pixel on only where the preprocessed input exceeds this: under
#: PROBE_NORMALIZATION a pixel brighter than 0.54 of full scale does; x / 255 alone (at most 1) and the
#: data file's normalization (at most about 1.6) never do, so every feature is 0 and a fitted head
#: scores the share of one class
HEAD_THRESHOLD = 2.0


def under_probe_normalization(run: RunSpec) -> RunSpec:
    """``run`` with its inputs normalized by :data:`PROBE_NORMALIZATION`: every probe's run."""
    return run.model_copy(update={"data": run.data.model_copy(update={"normalization": PROBE_NORMALIZATION})})


def threshold_encoder(tensors: dict[str, np.ndarray]) -> None:
    """Make the ``mlp`` encoder in ``tensors`` (BatchNorm, docs/MODELS.md) a threshold: hidden unit i
    is ``ReLU(x_i − HEAD_THRESHOLD)`` for input i, and feature j the sum of hidden units 2j and
    2j + 1. What a head can learn from its features then depends on the inputs it fed: right
    preprocessing gives the bright pixels of each image (a fitted head separates the kit's four
    shapes), x / 255 or another normalization gives zeros. Needs 2·F ≥ the input size."""
    weight = tensors["encoder.net.1.weight"]
    hidden, inputs = weight.shape
    features = tensors["encoder.net.4.weight"].shape[0]
    if inputs > hidden or inputs > 2 * features:
        raise ValueError(f"a threshold encoder needs at most {min(hidden, 2 * features)} inputs, not {inputs}")
    tensors["encoder.net.1.weight"] = np.eye(hidden, inputs, dtype=weight.dtype)
    tensors["encoder.net.1.bias"] = np.zeros(hidden, weight.dtype)
    tensors["encoder.net.2.weight"] = np.ones(hidden, weight.dtype)
    tensors["encoder.net.2.bias"] = np.zeros(hidden, weight.dtype)
    tensors["encoder.net.2.running_mean"] = np.full(hidden, HEAD_THRESHOLD, weight.dtype)
    tensors["encoder.net.2.running_var"] = np.full(hidden, 1.0 - 1e-5, weight.dtype)  # + eps: a unit scale
    pairs = np.zeros((features, hidden), weight.dtype)
    for i in range(inputs):
        pairs[i // 2, i] = 1.0
    tensors["encoder.net.4.weight"] = pairs
    tensors["encoder.net.4.bias"] = np.zeros(features, weight.dtype)


def training_probe(probe: Probe) -> Probe:
    """``probe`` as a train task: the same model and data, :data:`TRAIN_EPOCHS` epochs."""
    train = probe.run.train.model_copy(update={"epochs": TRAIN_EPOCHS})
    return Probe(probe.run.model_copy(update={"train": train}), probe.payload)


def variance_ratio(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> float | None:
    """The mean running variance of the model's first BatchNorm layer after training over before
    (None when the update does not carry it): what the inputs the trainer fed the layer did to it."""
    key = next((k for k in before if k.endswith("running_var")), None)
    if key is None or key not in after or np.shape(after[key]) != np.shape(before[key]):
        return None
    reference = float(np.mean(before[key], dtype=np.float64))
    return float(np.mean(after[key], dtype=np.float64)) / reference if reference > 0 else None


def accuracy(probe: Probe, pixels: np.ndarray, labels: np.ndarray, names: list[str],
             normalization: Normalization | None = None, map_labels: bool = True) -> float:
    """What an agent holding ``pixels``/``labels`` scores on ``probe``: preprocessed with
    ``normalization`` (default: the task's), labels mapped onto the run's order unless
    ``map_labels`` is false (the break :func:`discrimination` measures)."""
    from edgepfl._torch import torch
    from edgepfl.methods import create_method
    from edgepfl.methods.base import load_tensors

    run = probe.run
    method = create_method(run.method.name, run.method.options)
    model = method.build_model(run.model, run.data.input_shape, run.data.num_classes)
    load_tensors(model, probe.payload)
    model.eval()
    x = preprocess(pixels, normalization or run.data.normalization or PROBE_NORMALIZATION, run.data.pixel_scale)
    if map_labels:
        index = {name: i for i, name in enumerate(run.data.class_names)}
        labels = np.array([index[names[j]] for j in labels], dtype=np.int64)
    with torch.no_grad():
        predicted = method.logits(model, torch.from_numpy(x)).argmax(1).numpy()
    return float((predicted == labels).mean())


def discrimination(run: RunSpec, data_path: Path) -> dict[str, float]:
    """The probes' accuracy for a right agent and for each break they are built to catch."""
    pixels, labels, names = read_data(data_path)
    plain, order = build_probes(run, data_path)
    file_norm = run.data.normalization
    return {
        "right": accuracy(plain, pixels, labels, names),
        "x / 255 only": accuracy(plain, pixels, labels, names, Normalization(mean=[0.0], std=[1.0])),
        "the file's normalization": accuracy(plain, pixels, labels, names, file_norm),
        "class order, mapped": accuracy(order, pixels, labels, names),
        "class order, local numbers": accuracy(order, pixels, labels, names, map_labels=False),
    }
