"""Bytes of one uplink update under each codec against float32 (edgepfl/codecs.py).

The default model (SmallCNN, BatchNorm, feature 128, a linear head; 1x28x28 inputs, 10
classes) takes ``--steps`` SGD steps on seeded random images from its initial state;
that change is encoded under each codec and block size, for the shared state of FedAvg
(the whole model) and FedRep (the encoder). Two ratios against float32:

* **codec**: the codec's arrays and its header's JSON (:meth:`Encoded.sizes`) over the
  same tensors' bytes uncompressed;
* **frame**: an unsigned ``update`` frame carrying the codec's arrays, plus the codec
  header's JSON that protocol 1.6 will carry in its meta, over the ``update`` frame of
  today's float32 tensors (envelope and manifest included on both sides).

q8 and q4 sizes depend on the tensors' shapes alone; top-k's index (a bitmap or gap
varints, whichever is smaller) depends on where the largest changes are, so it is also
shown against the 4 bytes per kept value that uint32 positions would take.

    python benchmarks/codec_bytes.py --out benchmarks/results/codec_bytes
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch

from edgepfl.codecs import CodecSpec, encode
from edgepfl.models import SplitModel
from edgepfl.protocol import MessageType, UpdateMeta
from edgepfl.protocol import encode as encode_frame
from edgepfl.specs import ModelSpec

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results

CODECS = (("q8", 256), ("q8", 64), ("q8", 1024), ("q4", 256), ("q4", 64), ("q4", 1024), ("topk+q8", 256),
          ("topk+q4", 256))


def trained_change(steps: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(reference, update): the default CNN before and after ``steps`` SGD steps."""
    torch.manual_seed(seed)
    model = SplitModel.build(ModelSpec(), (1, 28, 28), 10)
    reference = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return reference, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def frame_bytes(tensors: dict[str, np.ndarray]) -> int:
    meta = UpdateMeta(task_id="a" * 32, kind="train", num_train=600, num_test=200, eval_correct=150)
    # a fixed creation time: the header's timestamp would otherwise vary the length by a byte
    return len(encode_frame(MessageType.UPDATE, federation="bench", sender="agent-00", round=7, meta=meta,
                            tensors=tensors, created=1_790_000_000.0))


def measure(reference: dict[str, np.ndarray], update: dict[str, np.ndarray], keep: float) -> list[dict]:
    float32_frame = frame_bytes(update)
    rows = []
    for name, block in CODECS:
        encoded = encode(update, reference, CodecSpec.from_name(name, block=block, keep=keep),
                         np.random.default_rng(0))
        sizes = encoded.sizes()
        row = {"codec": name, "block": block, "codec_bytes": sizes.encoded, "float32_bytes": sizes.uncompressed,
               "codec_ratio": sizes.encoded / sizes.uncompressed,
               "frame_bytes": frame_bytes(encoded.arrays()) + sizes.header, "float32_frame_bytes": float32_frame}
        row["frame_ratio"] = row["frame_bytes"] / float32_frame
        if encoded.header.tensors and encoded.header.tensors[0].kept is not None:
            kept = sum(t.kept or 0 for t in encoded.header.tensors)
            row["index_bytes"] = int(encoded.index.nbytes)
            row["uint32_index_bytes"] = 4 * kept
            row["index_forms"] = sorted({t.index or "" for t in encoded.header.tensors})
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Uplink bytes per codec\n\nSmallCNN (feature 128) + linear head, 1x28x28, 10 classes; "
             f"{result['steps']} SGD steps on seeded random images; top-k keeps {result['keep']:.0%} of each tensor. "
             f"numpy {result['numpy']}, torch {result['torch']}.\n"]
    for part, rows in result["parts"].items():
        lines += [f"\n## {part}\n", "| codec | block | codec bytes | float32 bytes | codec ratio | frame bytes | "
                  "float32 frame | frame ratio | index bytes (uint32 would be) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            index = f"{r['index_bytes']} {'/'.join(r['index_forms'])} ({r['uint32_index_bytes']})" \
                if "index_bytes" in r else ""
            lines.append(f"| {r['codec']} | {r['block']} | {r['codec_bytes']:,} | {r['float32_bytes']:,} | "
                         f"{r['codec_ratio']:.4f} | {r['frame_bytes']:,} | {r['float32_frame_bytes']:,} | "
                         f"{r['frame_ratio']:.4f} | {index} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/codec_bytes")
    args = parser.parse_args()
    reference, update = trained_change(args.steps, args.seed)
    encoder = [k for k in reference if k.startswith("encoder.")]
    parts = {
        "FedAvg: the whole model shared": measure(reference, update, args.keep),
        "FedRep: the encoder shared": measure({k: reference[k] for k in encoder}, {k: update[k] for k in encoder},
                                             args.keep),
    }
    write_results({"steps": args.steps, "keep": args.keep, "seed": args.seed, "numpy": np.__version__,
                   "torch": torch.__version__, "python": platform.python_version(), "parts": parts},
                  args.out, markdown)


if __name__ == "__main__":
    main()
