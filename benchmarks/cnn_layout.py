"""What channels-last activations save on the CPU (docs/BENCHMARKS.md, "Channels-last activations").

Times one SGD training step (forward, cross-entropy, backward, step) and one evaluation
forward of each 28x28 conv encoder, run two ways on the same module and the same batch:
``default`` calls the trunk as a plain ``nn.Sequential`` (activations in the default
NCHW layout, as before ``ConvTrunk``), ``channels_last`` calls ``ConvTrunk`` itself. The
two are interleaved, repeat by repeat, so load from other processes falls on both alike.
Medians of ``--repeats`` repeats of ``--iterations`` steps; CPU time
(``time.process_time``) beside wall time, one torch thread unless ``--threads``.

    OMP_NUM_THREADS=1 python benchmarks/cnn_layout.py --out benchmarks/results/cnn_layout
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from edgepfl.methods.fedrir import GlobalExtractor
from edgepfl.models import SmallCNN

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results


def encoders() -> dict[str, nn.Module]:
    """The conv encoders whose trunk is a ``ConvTrunk``, at FMNIST's 1x28x28."""
    return {
        "cnn (SmallCNN 32/64)": SmallCNN(1, 28),
        "fedpac_cnn (16/32, FedPAC's code)": SmallCNN(1, 28, widths=(16, 32), second_padding=1, leaky=True),
        "FedRIR extractor (32/64)": GlobalExtractor((1, 28, 28), 128),
    }


def forward_with(encoder: nn.Module, layout: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The encoder's forward with its trunk run in ``layout``."""
    if layout == "channels_last":
        return encoder
    return lambda x: encoder.fc(nn.Sequential.forward(encoder.conv, x))


def step_costs(encoder: nn.Module, batch: int, iterations: int) -> dict[str, Callable[[], None]]:
    """``(phase, layout)`` -> one timed call: a training step or an evaluation forward."""
    head = nn.Linear(encoder.out_features, 10)
    opt = torch.optim.SGD(list(encoder.parameters()) + list(head.parameters()), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    calls = {}
    for layout in ("default", "channels_last"):
        fwd = forward_with(encoder, layout)

        def train(fwd=fwd) -> None:
            encoder.train()
            for _ in range(iterations):
                opt.zero_grad()
                nn.functional.cross_entropy(head(fwd(x)), y).backward()
                opt.step()

        def evaluate(fwd=fwd) -> None:
            encoder.eval()
            with torch.no_grad():
                for _ in range(iterations):
                    head(fwd(x))

        calls[f"train/{layout}"] = train
        calls[f"eval/{layout}"] = evaluate
    return calls


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=50, help="the benchmark settings' batch size")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/cnn_layout")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows = []
    for name, encoder in encoders().items():
        calls = step_costs(encoder, args.batch, args.iterations)
        for fn in calls.values():  # warm-up: allocator, oneDNN primitive caches
            fn()
        wall: dict[str, list[float]] = {k: [] for k in calls}
        cpu: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(args.repeats):
            for key, fn in calls.items():  # interleaved: every repeat times every path once
                w0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall[key].append((time.perf_counter() - w0) / args.iterations * 1e3)
                cpu[key].append((time.process_time() - c0) / args.iterations * 1e3)
        for phase in ("train", "eval"):
            med = {layout: (statistics.median(wall[f"{phase}/{layout}"]), statistics.median(cpu[f"{phase}/{layout}"]))
                   for layout in ("default", "channels_last")}
            rows.append({"encoder": name, "phase": phase,
                         "default_wall_ms": round(med["default"][0], 3), "default_cpu_ms": round(med["default"][1], 3),
                         "channels_last_wall_ms": round(med["channels_last"][0], 3),
                         "channels_last_cpu_ms": round(med["channels_last"][1], 3),
                         "cpu_ratio": round(med["default"][1] / med["channels_last"][1], 2)})
    result = {
        "rows": rows, "batch": args.batch, "iterations": args.iterations, "repeats": args.repeats,
        "torch_threads": args.threads, "torch": torch.__version__, "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "command": f"OMP_NUM_THREADS={args.threads} python benchmarks/cnn_layout.py --batch {args.batch} "
                   f"--iterations {args.iterations} --repeats {args.repeats} --threads {args.threads} --out {args.out}",
    }
    write_results(result, args.out, markdown)
    return result


def markdown(result: dict) -> str:
    lines = [f"Batch {result['batch']}, {result['torch_threads']} torch thread(s), torch {result['torch']} on "
             f"{result['machine']}; medians of {result['repeats']} interleaved repeats of {result['iterations']} calls.",
             "", "| encoder | phase | default layout: CPU ms (wall) | channels-last: CPU ms (wall) | CPU ratio |",
             "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['encoder']} | {r['phase']} | {r['default_cpu_ms']:.2f} ({r['default_wall_ms']:.2f}) | "
                     f"{r['channels_last_cpu_ms']:.2f} ({r['channels_last_wall_ms']:.2f}) | {r['cpu_ratio']:.2f}x |")
    lines += ["", f"`{result['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
