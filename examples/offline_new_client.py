"""Walk-through: a new client fits its personal head offline on an exported encoder.

    python examples/offline_new_client.py                 # DualFed on digits, ~1 minute on a laptop CPU
    python examples/offline_new_client.py --method fedavg --head lr

1. trains a small federation in-process (4 clients of scikit-learn's digits, each
   capped at 150 training images, so most of the pool is never seen in training);
2. ``edgepfl export``: frozen encoder -> ``encoder.onnx`` + ``manifest.json`` (+ the
   federation's global heads, + an int8 variant);
3. writes a *new* client's images (pool images no training client ever saw) as an
   image folder, as a device owner would hand them over;
4. ``edgepfl fit-head`` for an SVM head (sklearn only: what a Raspberry Pi can do) and
   for the method's own head when it has one (DualFed / FedPick: needs torch);
5. ``edgepfl predict`` on a few images, and a fused encoder+head ONNX for the device.

Every step calls the same ``edgepfl`` CLI a user would type; the commands are printed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cli(*args: str) -> None:
    from edgepfl.cli import main

    print(f"\n$ edgepfl {shlex.join(args)}", flush=True)
    rc = main(list(args))
    if rc:
        raise SystemExit(f"edgepfl {args[0]} failed with exit code {rc}")


def unseen_images(spec, trained_clients: int):
    """Pool images that are in no training client's train split: the new client."""
    from edgepfl.data import client_indices, load_pool

    pool = load_pool(spec)
    seen = np.concatenate([client_indices(spec, i)[0] for i in range(trained_clients)])
    rest = np.setdiff1d(np.arange(len(pool)), seen)
    rng = np.random.default_rng(1)
    pick = np.sort(rng.choice(rest, size=min(400, len(rest)), replace=False))
    return pool.pixels[pick], pool.y[pick], list(pool.class_names)


def write_image_folder(root: Path, pixels, labels, class_names) -> None:
    from PIL import Image

    for i, (img, y) in enumerate(zip(pixels, labels)):
        d = root / class_names[int(y)]
        d.mkdir(parents=True, exist_ok=True)
        # the pool keeps digits as floats in [0, 1]; a device stores ordinary 8-bit grayscale PNGs
        a = img[0] if img.dtype == np.uint8 else np.round(img[0] * 255).astype(np.uint8)
        Image.fromarray(a).save(d / f"img{i:04d}.png")


def main() -> int:
    from edgepfl.heads import GENERIC_HEAD_KINDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="dualfed")
    parser.add_argument("--head", default="svm", choices=GENERIC_HEAD_KINDS, help="the generic head to fit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="runs/offline-new-client")
    ns = parser.parse_args()

    from edgepfl.config import DataSpec, MethodSpec, ModelSpec, RunConfig, TrainConfig
    from edgepfl.coordinator.simulate import simulate
    from edgepfl.edge_agent.tiers import local_trainers
    from edgepfl.protocol import read_manifest

    out = Path(ns.out)
    agents = 4
    config = RunConfig(
        federation="offline-demo",
        method=MethodSpec(name=ns.method),
        model=ModelSpec(arch="mlp", feature_dim=64),
        train=TrainConfig(epochs=2, batch_size=32, lr=0.05),
        data=DataSpec(dataset="digits", num_clients=agents, samples_per_client=200, seed=0),
        rounds=ns.rounds,
        min_agents=agents,
        device="cpu",
    )
    print(f"1. training {ns.method} for {ns.rounds} rounds on {agents} in-process clients -> {out / 'run'}")
    simulate(config, agents, out / "run", in_process=local_trainers, progress=False)

    release = out / "release"
    cli("export", "--run", str(out / "run"), "--out", str(release), "--quantize", "int8")
    manifest = read_manifest(release / "manifest.json")
    global_heads = list(manifest.global_heads.tensors) if manifest.global_heads else []
    print(f"   release {manifest.release_id}: {manifest.feature_dim} features, heads {manifest.head_kinds}, "
          f"global heads {global_heads}")

    photos = out / "new-client-photos"
    pixels, labels, names = unseen_images(config.data, agents)
    write_image_folder(photos, pixels, labels, names)
    print(f"\n3. new client: {len(labels)} images never seen in training, written to {photos}/<class>/*.png")

    encoder = str(release / "encoder.onnx")
    heads = [ns.head] + [k for k in manifest.head_kinds if k not in GENERIC_HEAD_KINDS]  # and the method's own
    for kind in heads:
        cli("fit-head", "--encoder", encoder, "--data", str(photos), "--head", kind,
            "--out", str(out / f"head-{kind}.onnx"), "--fused", str(out / f"device-{kind}.onnx"))

    some = sorted((photos / names[3]).glob("*.png"))[:3]
    cli("predict", "--encoder", encoder, "--head", str(out / f"head-{heads[0]}.onnx"), *map(str, some), "--top", "2")
    print(f"\nFor the device: copy {out / f'device-{heads[0]}.onnx'} (one ONNX graph, input 'input' -> 'label', "
          f"'probabilities'), or encoder.onnx + head-{heads[0]}.onnx and run 'edgepfl predict'.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
