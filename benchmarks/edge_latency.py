"""Latency per sample: fused ONNX encoder+head (onnxruntime) vs the same model in PyTorch eager.

For each encoder (the small CNN on 1x28x28 Fashion-MNIST inputs; MobileNetV3-Small,
random init, on 3x64x64) this script

1. builds the encoder with :func:`edgepfl.models.build_encoder`, in eval mode;
2. exports it with :func:`edgepfl.export.onnx_export.encoder_to_onnx` (the exporter ``edgepfl
   export`` uses), fits an ``lr`` head (:class:`edgepfl.heads.LRHead`) on its features
   of real images, exports the head (export/sklearn_graphs.py) and fuses both with :func:`edgepfl.export.heads.fuse`;
3. builds the *same* computation in torch: encoder -> L2 normalize -> Linear with the
   head's ``coef_`` / ``intercept_`` -> softmax, and checks both agree (max abs diff of
   the probabilities is recorded);
4. times, at batch 1 and batch 32: torch eager (``torch.no_grad``, eval) with 1 thread
   and with torch's default thread count, and onnxruntime on the fused graph with
   ``intra_op_num_threads=1`` and with its default. Configurations are interleaved
   within each repeat so that load from other processes hits all of them alike;
   the reported figure is the median over repeats of the mean time per call in that
   repeat, divided by the batch size.

Usage::

    OMP_NUM_THREADS unset; .venv/bin/python benchmarks/edge_latency.py --repeats 15

Writes ``benchmarks/results/edge_latency.json`` and ``edge_latency.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: `python benchmarks/<script>.py`
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _inputs(arch: str, n: int) -> tuple[np.ndarray, tuple[int, int, int], str]:
    """Real images for the encoder: FMNIST for the CNN; FMNIST resized to 3x64x64 for MobileNet."""
    from edgepfl.config import DataSpec
    from edgepfl.data import load_client_data

    data = load_client_data(DataSpec(dataset="fmnist", num_clients=10, seed=0), 0)
    x = data.x_train[:n].astype(np.float32)
    if arch == "cnn":
        return np.ascontiguousarray(x), (1, 28, 28), "Fashion-MNIST client 0 (1x28x28)"
    import torch
    import torch.nn.functional as F

    up = F.interpolate(torch.from_numpy(x), size=(64, 64), mode="bilinear", align_corners=False)
    return np.ascontiguousarray(up.repeat(1, 3, 1, 1).numpy()), (3, 64, 64), "Fashion-MNIST client 0 resized to 3x64x64"


def build(arch: str, tmp: Path, fit_samples: int = 512):
    """(torch model, fused ONNX path, labels, inputs, description) for one encoder."""
    import torch
    from torch import nn

    from edgepfl.config import DataSpec, ModelSpec
    from edgepfl.data import load_client_data
    from edgepfl.export.heads import fuse, head_to_onnx
    from edgepfl.export.onnx_export import encoder_to_onnx
    from edgepfl.heads import LRHead
    from edgepfl.models import build_encoder

    torch.manual_seed(0)
    x, shape, desc = _inputs(arch, fit_samples)
    y = load_client_data(DataSpec(dataset="fmnist", num_clients=10, seed=0), 0).y_train[:fit_samples]
    encoder = build_encoder(ModelSpec(arch=arch), shape).eval()
    for p in encoder.parameters():
        p.requires_grad_(False)
    enc_path = tmp / f"{arch}-encoder.onnx"
    enc_path.write_bytes(encoder_to_onnx(encoder, shape))
    with torch.no_grad():
        feats = encoder(torch.from_numpy(x)).numpy()
    head = LRHead().fit(feats, y)
    head_path = tmp / f"{arch}-head.onnx"
    head_to_onnx(head, feats.shape[1], head_path)
    fused_path = tmp / f"{arch}-fused.onnx"
    fuse(enc_path, head_path, fused_path)

    clf = head.pipeline_.named_steps["clf"]
    linear = nn.Linear(feats.shape[1], len(clf.classes_))
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(clf.coef_.astype(np.float32)))
        linear.bias.copy_(torch.from_numpy(clf.intercept_.astype(np.float32)))

    class EncoderHead(nn.Module):
        """encoder -> L2 normalize -> linear -> softmax: the LR head pipeline in torch."""

        def __init__(self):
            super().__init__()
            self.encoder, self.linear = encoder, linear

        def forward(self, inp):
            f = nn.functional.normalize(self.encoder(inp), dim=1)
            return torch.softmax(self.linear(f), dim=1)

    model = EncoderHead().eval()
    params = sum(p.numel() for p in encoder.parameters())
    return model, fused_path, x, desc, params, shape, feats.shape[1]


def _time(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def bench(arch: str, tmp: Path, repeats: int, budget_s: float) -> dict:
    import torch

    from edgepfl.export.heads import make_session

    model, fused_path, x, desc, params, shape, feature_dim = build(arch, tmp)
    default_threads = torch.get_num_threads()
    sessions = {"ort_1thread": make_session(fused_path, 1), "ort_default": make_session(fused_path, None)}

    # parity of the two implementations on the same inputs
    with torch.no_grad():
        ref = model(torch.from_numpy(x[:64])).numpy()
    got = sessions["ort_1thread"].run(["probabilities"], {"input": x[:64]})[0]
    parity = float(np.abs(ref - got).max())

    out: dict = {"arch": arch, "input_shape": list(shape), "inputs": desc, "encoder_params": params,
                 "feature_dim": feature_dim, "head": "lr (L2 normalize + logistic regression)",
                 "parity_max_abs_probabilities": parity, "torch_default_threads": default_threads, "batches": {}}
    for batch in (1, 32):
        xb = np.ascontiguousarray(x[:batch])
        tb = torch.from_numpy(xb)

        def torch_call(tb=tb):
            with torch.no_grad():
                model(tb)

        configs = {
            "torch_1thread": (1, torch_call),
            "torch_default": (default_threads, torch_call),
            "ort_1thread": (None, lambda s=sessions["ort_1thread"], xb=xb: s.run(["probabilities"], {"input": xb})),
            "ort_default": (None, lambda s=sessions["ort_default"], xb=xb: s.run(["probabilities"], {"input": xb})),
        }
        # calibrate iterations so one timing block takes about budget_s / (repeats * configs)
        iters = {}
        for name, (threads, fn) in configs.items():
            if threads:
                torch.set_num_threads(threads)
            for _ in range(3):
                fn()
            once = _time(fn, 3)
            iters[name] = max(3, int(budget_s / (repeats * len(configs)) / max(once, 1e-6)))
        samples: dict[str, list[float]] = {k: [] for k in configs}
        load_before = _loadavg()
        for r in range(repeats):
            names = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in names:
                threads, fn = configs[name]
                if threads:
                    torch.set_num_threads(threads)
                samples[name].append(_time(fn, iters[name]))
        torch.set_num_threads(default_threads)
        row = {"iterations_per_repeat": iters, "loadavg_before": load_before, "loadavg_after": _loadavg()}
        for name, vals in samples.items():
            row[name] = {
                "per_sample_ms_median": 1e3 * statistics.median(vals) / batch,
                "per_sample_ms_min": 1e3 * min(vals) / batch,
                "per_sample_ms_max": 1e3 * max(vals) / batch,
            }
        med = {k: row[k]["per_sample_ms_median"] for k in configs}
        row["speedup"] = {
            "ort_1thread_vs_torch_1thread": med["torch_1thread"] / med["ort_1thread"],
            "ort_default_vs_torch_default": med["torch_default"] / med["ort_default"],
            "best_ort_vs_best_torch": min(med["torch_1thread"], med["torch_default"])
            / min(med["ort_1thread"], med["ort_default"]),
        }
        out["batches"][str(batch)] = row
    return out


def markdown(result: dict) -> str:
    lines = [
        "# Edge latency: fused ONNX encoder+head vs PyTorch eager",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}; torch {result['torch']}, onnxruntime {result['onnxruntime']}. "
        f"{result['repeats']} interleaved repeats, medians reported; load average "
        f"{result['loadavg_start']} at start, {result['loadavg_end']} at end (shared machine).",
        "",
        "| encoder | batch | torch 1 thr | torch default | ORT 1 thr | ORT default | ORT/torch speed-up (1 thr) "
        "| (default) | parity |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for enc in result["encoders"]:
        for batch, row in enc["batches"].items():
            ms = {k: row[k]["per_sample_ms_median"] for k in ("torch_1thread", "torch_default", "ort_1thread", "ort_default")}
            lines.append(
                f"| {enc['arch']} {'x'.join(map(str, enc['input_shape']))} | {batch} | {ms['torch_1thread']:.4f} ms "
                f"| {ms['torch_default']:.4f} ms | {ms['ort_1thread']:.4f} ms | {ms['ort_default']:.4f} ms "
                f"| {row['speedup']['ort_1thread_vs_torch_1thread']:.2f}x "
                f"| {row['speedup']['ort_default_vs_torch_default']:.2f}x | {enc['parity_max_abs_probabilities']:.1e} |"
            )
    lines += ["", "Times are per sample (time per call / batch size). `default` = the library's own thread count "
              f"(torch: {result['encoders'][0]['torch_default_threads']}; onnxruntime: its default)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=20.0, help="timing seconds per encoder and batch size")
    parser.add_argument("--arch", action="append", default=None, help="cnn, mobilenet_v3_small (default both)")
    parser.add_argument("--out", default=str(RESULTS / "edge_latency"))
    ns = parser.parse_args()
    import onnxruntime
    import torch

    archs = ns.arch or ["cnn", "mobilenet_v3_small"]
    result = {
        "command": "python benchmarks/edge_latency.py " + " ".join(
            [f"--repeats {ns.repeats}", f"--budget-s {ns.budget_s}"] + [f"--arch {a}" for a in (ns.arch or [])]
            + ([f"--out {os.path.relpath(ns.out, ROOT)}"] if Path(ns.out).resolve() != (RESULTS / "edge_latency").resolve()
               else [])),
        "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs (shared with other work)",
        "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "repeats": ns.repeats, "loadavg_start": _loadavg(),
        "encoders": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            result["encoders"].append(bench(arch, Path(tmp), ns.repeats, ns.budget_s))
            print(json.dumps(result["encoders"][-1]["batches"], indent=1))
    result["loadavg_end"] = _loadavg()
    write_results(result, ns.out, markdown)


if __name__ == "__main__":
    main()
