"""Export a run's frozen encoder to ONNX, with a manifest a device can verify and follow.

:func:`export_run` reads ``<run>/checkpoint`` (any method), rebuilds the model, loads
the federation's shared parameters and writes to ``out_dir``:

* ``encoder.onnx`` — the method's :meth:`~edgepfl.methods.Method.encoder_module` in
  eval mode: input ``input`` float32 ``(N, C, H, W)`` (dynamic batch), output
  ``features`` float32 ``(N, feature_dim)``;
* ``global_heads.safetensors`` — the shared parameters outside the encoder (FedAvg's
  classifier, DualFed's ``h_s``, FedPick's ``C_g``): what a new client takes from the
  federation for a DualFed / FedPick head; absent when the method shares no head;
* optional quantized variants (``encoder.int8.onnx``, ``encoder.fp16.onnx``);
* ``manifest.json`` (written last) — a :class:`~edgepfl.protocol.manifest.ReleaseManifest`:
  the run spec (method, model, input shape, classes, preprocessing), round, tensor
  names and dtype, feature dimension, opset, sha256 of every file, head kinds, the
  BatchNorm statistics' origin, the torch/onnxruntime parity measured at export,
  version, time.

BatchNorm statistics that a method keeps personal (DualFed's running mean / var,
FedPick's and FedBN's whole BN layers) are not in the checkpoint. A frozen encoder
needs *some* statistics, so they are re-estimated on calibration images (by default
the training images of the run's own clients, read through the run's data config) and
the manifest says so; without data they stay at their initial values, logged.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from edgepfl import __version__
from edgepfl.atomic import make_dirs, write_bytes, write_json, write_tensors
from edgepfl.methods.training import recalibrate_batchnorm
from edgepfl.protocol.manifest import (
    BatchNormOrigin,
    FileEntry,
    GlobalHeadsEntry,
    ReleaseManifest,
    read_manifest,
)
from edgepfl.state import CheckpointMeta

from .heads import OPSET, make_session

log = logging.getLogger(__name__)

INPUT_NAME = "input"
OUTPUT_NAME = "features"
ENCODER_FILE = "encoder.onnx"
GLOBAL_HEADS_FILE = "global_heads.safetensors"
MANIFEST_FILE = "manifest.json"
#: torch vs onnxruntime tolerance; an export above it is an error, not a warning
PARITY_TOLERANCE = 1e-4
CALIBRATION_SAMPLES = 1024


class ExportError(RuntimeError):
    """The run cannot be exported, or the exported graph disagrees with torch."""


@dataclass
class LoadedRun:
    """A run's model rebuilt from its checkpoint, with the shared parameters loaded."""

    method: Any
    model: Any
    state: Any
    meta: CheckpointMeta


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


def build_from_meta(meta: CheckpointMeta):
    """(method, model) for a checkpoint's meta: the model as the coordinator built it."""
    from edgepfl.methods import create_method

    run = meta.run
    method = create_method(run.method.name, run.method.options)
    model = method.build_model(run.model, run.data.input_shape, run.data.num_classes)
    return method, model


def load_run(run_dir: str | Path) -> LoadedRun:
    """Rebuild the model of ``run_dir`` (its ``checkpoint/``) with the federation's shared params."""
    from edgepfl.methods.base import load_tensors
    from edgepfl.state import load_checkpoint

    run_dir = Path(run_dir)
    ckpt = run_dir / "checkpoint" if (run_dir / "checkpoint").is_dir() else run_dir
    loaded = load_checkpoint(ckpt)
    if loaded is None:
        raise ExportError(f"no checkpoint in {ckpt} (expected state.json and the tensor file it names)")
    state, meta = loaded
    method, model = build_from_meta(meta)
    load_tensors(model, state.shared_params())
    model.eval()
    return LoadedRun(method, model, state, meta)


def export_run(run_dir: str | Path, out_dir: str | Path, *, quantize: list[str] | tuple[str, ...] = (),
               calibration: np.ndarray | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """Export ``run_dir``'s encoder (+ global heads) to ``out_dir``; returns the manifest path.

    ``quantize``: variants to add, from ``"int8"`` (onnxruntime dynamic quantization) and
    ``"fp16"``. ``calibration``: normalized images (N, C, H, W) for BatchNorm statistics
    the checkpoint lacks; default: the run's clients' training images. ``progress`` is told
    each step as it begins (``edgepfl export`` prints them).
    """
    if progress is not None:
        progress(f"loading the checkpoint of {run_dir}")
    run = load_run(run_dir)
    return export_loaded(run, out_dir, quantize=quantize, calibration=calibration, progress=progress)


def export_state(state, meta: CheckpointMeta, out_dir: str | Path, *, quantize: list[str] | tuple[str, ...] = (),
                 calibration: np.ndarray | None = None, rebase: Callable[[bytes], bytes] | None = None) -> Path:
    """Like :func:`export_run` from an in-memory server state and checkpoint meta (coordinator
    releases); ``rebase`` as in :func:`export_loaded`."""
    from edgepfl.methods.base import load_tensors

    method, model = build_from_meta(meta)
    load_tensors(model, state.shared_params())
    model.eval()
    return export_loaded(LoadedRun(method, model, state, meta), out_dir, quantize=quantize, calibration=calibration,
                         rebase=rebase)


def export_loaded(run: LoadedRun, out_dir: str | Path, *, quantize: list[str] | tuple[str, ...] = (),
                  calibration: np.ndarray | None = None, rebase: Callable[[bytes], bytes] | None = None,
                  progress: Callable[[str], None] | None = None) -> Path:
    """Write encoder, global heads, variants and manifest for a loaded run.

    ``rebase``: given the exported encoder's bytes (checked against torch first), the bytes to
    release instead — a coordinator's release rebuilt from a delta against the previous
    release (:mod:`edgepfl.release_delta`). The manifest then names and measures those: its
    hash, its id, and ``parity_max_abs`` against the trained encoder, quantization included."""
    import torch

    step = progress or (lambda _: None)
    out_dir = Path(out_dir)
    make_dirs(out_dir)
    meta, method, model = run.meta, run.method, run.model
    encoder = method.encoder_module(model)
    prefix = _module_prefix(model, encoder)
    shared = run.state.shared_params()
    input_shape = meta.run.data.input_shape

    step(f"{meta.run.method.name} round {meta.round}: BatchNorm statistics")
    bn_info = _prepare_batchnorm(encoder, prefix, shared, calibration, meta)
    encoder.eval()
    for p in encoder.parameters():
        p.requires_grad_(False)

    step("tracing the encoder to ONNX")
    onnx_bytes = encoder_to_onnx(encoder, input_shape)
    probe = _probe_inputs(calibration, meta, input_shape)
    samples = {"image": "images", "series": "windows", "vector": "vectors"}[meta.run.data.input_kind]
    step(f"checking onnxruntime against torch on {len(probe)} {samples}")
    with torch.no_grad():
        ref = encoder(torch.from_numpy(probe)).numpy()
    got = make_session(onnx_bytes).run([OUTPUT_NAME], {INPUT_NAME: probe})[0]
    parity = float(np.abs(ref - got).max())
    if parity > PARITY_TOLERANCE:
        raise ExportError(f"onnxruntime disagrees with torch by {parity:.3g} (> {PARITY_TOLERANCE})")
    if rebase is not None:
        # what is released instead (a release delta's rebuilt artifact): its distance from the
        # trained encoder is the figure the manifest carries
        onnx_bytes = rebase(onnx_bytes)
        got = make_session(onnx_bytes).run([OUTPUT_NAME], {INPUT_NAME: probe})[0]
        parity = float(np.abs(ref - got).max())
    write_bytes(out_dir / ENCODER_FILE, onnx_bytes)
    enc_sha = sha256_bytes(onnx_bytes)
    feature_dim = int(ref.shape[1])

    global_heads = {k: v for k, v in shared.items() if not _under(k, prefix)}
    gh_entry = None
    if global_heads:
        write_tensors(out_dir / GLOBAL_HEADS_FILE, global_heads, metadata={"method": meta.run.method.name})
        gh_entry = GlobalHeadsEntry(
            file=GLOBAL_HEADS_FILE,
            sha256=sha256_file(out_dir / GLOBAL_HEADS_FILE),
            tensors={k: list(v.shape) for k, v in sorted(global_heads.items())},
        )
    elif (out_dir / GLOBAL_HEADS_FILE).exists():
        (out_dir / GLOBAL_HEADS_FILE).unlink()  # a stale file from an earlier export must not be picked up

    variants = {}
    if quantize:
        from .quantize import quantize_encoder

        for kind in quantize:
            step(f"quantizing the {kind} variant")
            path = quantize_encoder(out_dir / ENCODER_FILE, kind)
            variants[kind] = FileEntry(file=path.name, sha256=sha256_file(path), bytes=path.stat().st_size)

    manifest = ReleaseManifest(
        release_id=f"{meta.run.method.name}-r{meta.round}-{enc_sha[:12]}",
        round=meta.round,
        run=meta.run,
        input_name=INPUT_NAME,
        output_name=OUTPUT_NAME,
        dtype="float32",
        feature_dim=feature_dim,
        opset=OPSET,
        encoder=FileEntry(file=ENCODER_FILE, sha256=enc_sha, bytes=len(onnx_bytes)),
        global_heads=gh_entry,
        variants=variants,
        head_kinds=list(method.head_kinds),
        batchnorm=bn_info,
        parity_max_abs=parity,
        edgepfl_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    write_json(out_dir / MANIFEST_FILE, manifest.model_dump(mode="json"))
    log.info("exported %s round %d: %s (%d features, %d bytes, parity %.2g)", meta.run.method.name, meta.round,
             out_dir / ENCODER_FILE, feature_dim, len(onnx_bytes), parity)
    return out_dir / MANIFEST_FILE


def encoder_to_onnx(encoder, input_shape: tuple[int, ...]) -> bytes:
    """Serialize an eval-mode encoder with a dynamic batch axis; checked with onnx.checker."""
    import onnx
    import torch

    dummy = torch.zeros(2, *input_shape)
    buf = io.BytesIO()
    # torch.onnx.export's hints say f is a path (str | PathLike), but the TorchScript exporter
    # (dynamo=False) writes to a buffer too, as export/heads.py's _torch_graph relies on
    # (the reason is spelled out there); tests/unit/export/test_export.py exercises this call.
    target = cast(Any, buf)
    # The TorchScript exporter: deterministic, fast, and emits exactly the opset asked for,
    # which the heads (export/sklearn_graphs.py) target too so encoder and head graphs can be fused.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                encoder, (dummy,), target, dynamo=False, opset_version=OPSET,
                input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            )
    except torch.onnx.errors.UnsupportedOperatorError as exc:
        # the exporter's message names the op, then dumps the whole traced graph: keep the name
        op = re.search(r"operator '([^']+)'", str(exc))
        raise ExportError(f"{_encoder_name(encoder)} cannot be exported to ONNX: it uses "
                          f"{op.group(1) if op else 'an operator'}, which has no ONNX export at opset {OPSET}; "
                          "write that step with other operators") from None
    except torch.onnx.errors.OnnxExporterError as exc:
        raise ExportError(f"{_encoder_name(encoder)} cannot be exported to ONNX: {str(exc).strip().splitlines()[0]}") \
            from None
    model = onnx.load_from_string(buf.getvalue())
    onnx.checker.check_model(model, full_check=True)
    return buf.getvalue()


def read_release(out_dir: str | Path) -> tuple[ReleaseManifest, bytes]:
    """(manifest, encoder bytes) of an export directory, the bytes checked against the manifest."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir / MANIFEST_FILE)
    data = (out_dir / manifest.encoder.file).read_bytes()
    if sha256_bytes(data) != manifest.encoder.sha256:
        raise ExportError(f"{out_dir / manifest.encoder.file} does not match its manifest sha256")
    return manifest, data


def read_global_heads(out_dir: str | Path, manifest: ReleaseManifest) -> bytes | None:
    """The bytes of the release's global heads file (None when the manifest names none),
    checked against the manifest's sha256."""
    if manifest.global_heads is None:
        return None
    path = Path(out_dir) / manifest.global_heads.file
    data = path.read_bytes()
    if sha256_bytes(data) != manifest.global_heads.sha256:
        raise ExportError(f"{path} does not match its manifest sha256")
    return data


# --------------------------------------------------------------------------- helpers
def _encoder_name(encoder) -> str:
    """How an export error names the encoder: a plugin by its ``model.arch``."""
    arch = getattr(encoder, "arch", None)
    return f"the encoder of model.arch {arch}" if isinstance(arch, str) else f"the encoder ({type(encoder).__name__})"


def _module_prefix(model, module) -> str:
    for name, mod in model.named_modules():
        if mod is module:
            return name
    raise ExportError("the method's encoder_module is not a submodule of its model")


def _under(key: str, prefix: str) -> bool:
    return prefix == "" or key.startswith(prefix + ".")


def _prepare_batchnorm(encoder, prefix: str, shared: dict[str, np.ndarray], calibration,
                       meta: CheckpointMeta) -> BatchNormOrigin:
    """Re-estimate BatchNorm running statistics the federation does not hold; describe what was done."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    def full(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    missing = [(n, m) for n, m in encoder.named_modules()
               if isinstance(m, _BatchNorm) and m.track_running_stats and full(n + ".running_mean") not in shared]
    not_federated = sorted(k for k in (full(k) for k in encoder.state_dict())
                           if k not in shared and not k.endswith("num_batches_tracked"))
    layers = sum(isinstance(m, _BatchNorm) for m in encoder.modules())
    if not missing:
        return BatchNormOrigin(layers=layers, statistics="federated" if layers else "none",
                               encoder_keys_not_federated=not_federated)
    x = calibration if calibration is not None else _calibration_from_run(meta)
    if x is None or len(x) < 2:
        log.warning("%d BatchNorm layers keep personal statistics and no calibration data was found: "
                    "the exported encoder uses their initial statistics", len(missing))
        return BatchNormOrigin(layers=layers, statistics="initial", encoder_keys_not_federated=not_federated)
    x = np.ascontiguousarray(x[:CALIBRATION_SAMPLES], dtype=np.float32)
    recalibrate_batchnorm(encoder, encoder, torch.from_numpy(x), layers=[bn for _, bn in missing])
    encoder.eval()
    log.info("re-estimated %d personal BatchNorm layers on %d calibration images", len(missing), len(x))
    return BatchNormOrigin(layers=layers, statistics="calibrated", calibration_samples=int(len(x)),
                           encoder_keys_not_federated=not_federated)


def _calibration_from_run(meta: CheckpointMeta) -> np.ndarray | None:
    """Training images of the run's clients (up to CALIBRATION_SAMPLES), via its data config."""
    spec = meta.data_spec
    if spec is None:
        log.warning("the checkpoint names no data config to calibrate from")
        return None
    try:
        from edgepfl.data import load_client_data

        parts, n = [], 0
        for i in range(spec.num_clients):
            x = load_client_data(spec, i).x_train
            parts.append(x)
            n += len(x)
            if n >= CALIBRATION_SAMPLES:
                break
        return np.concatenate(parts)[:CALIBRATION_SAMPLES] if parts else None
    except Exception as exc:  # missing dataset: fall back to initial statistics (logged)
        log.warning("no calibration data from the run's data config: %s", exc)
        return None


def _probe_inputs(calibration, meta, input_shape) -> np.ndarray:
    if calibration is not None and len(calibration):
        return np.ascontiguousarray(calibration[:64], dtype=np.float32)
    return np.random.default_rng(0).normal(size=(16, *input_shape)).astype(np.float32)


__all__ = [
    "ENCODER_FILE", "GLOBAL_HEADS_FILE", "MANIFEST_FILE", "ExportError", "LoadedRun", "build_from_meta",
    "encoder_to_onnx", "export_loaded", "export_run", "export_state", "load_run", "read_release", "sha256_bytes",
    "sha256_file",
]
