"""What end-to-end signatures cost per message and per round (docs/BENCHMARKS.md, "Signing cost").

Measures, for a 1 MB update frame and a small status frame: encoding unsigned vs signed,
decoding vs decoding and verifying, and the signature work alone (sign / verify of the
prefix + header). Wall time and CPU time (``time.process_time``) per message, medians
of ``--repeats`` runs of ``--iterations`` messages each. The per-round share uses the
recorded MQTT round of docs/BENCHMARKS.md (FedAvg CNN, 8 agents: 2.34 CPU-s per round,
``round_overhead_interleaved``), in which a signed round adds 8 task signatures and 8
update verifications at the coordinator and one verification and one signature per agent.

    python benchmarks/signing_cost.py --out benchmarks/results/signing_cost
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgepfl.protocol import MessageType, StatusMeta, UpdateMeta, decode, encode
from edgepfl.protocol.signing import Signer, verify

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results

ROUND_CPU_S = 2.34  # docs/BENCHMARKS.md, round_overhead_interleaved, MQTT repeat 0: CPU-s per round, 8 agents
ROUND_AGENTS = 8


def measure(fn: Callable[[], object], iterations: int, repeats: int) -> dict:
    """Median wall and CPU microseconds per call."""
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iterations):
            fn()
        walls.append((time.perf_counter() - w0) / iterations * 1e6)
        cpus.append((time.process_time() - c0) / iterations * 1e6)
    return {"wall_us": round(statistics.median(walls), 2), "cpu_us": round(statistics.median(cpus), 2)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/signing_cost")
    args = p.parse_args(argv)

    signer = Signer.from_private(Ed25519PrivateKey.generate())
    payload = {"encoder.w": np.random.default_rng(0).standard_normal(2**18).astype(np.float32)}  # 1 MiB
    update = UpdateMeta(task_id="a" * 32, kind="train", num_train=600, num_test=200, eval_correct=150)
    status = StatusMeta(state="online", num_train=600, num_test=200, session="b" * 32)

    def frame(meta, tensors, signed):
        kind = MessageType.UPDATE if isinstance(meta, UpdateMeta) else MessageType.STATUS
        return encode(kind, federation="bench", sender="agent-00", round=0, meta=meta, tensors=tensors,
                      signer=signer if signed else None)

    cases = {}
    for name, meta, tensors in (("update_1MiB", update, payload), ("status", status, None)):
        signed_frame = frame(meta, tensors, True)
        message = decode(signed_frame)
        it = args.iterations if tensors is None else max(10, args.iterations // 10)
        cases[name] = {
            "frame_bytes": len(signed_frame),
            "encode_unsigned": measure(lambda m=meta, t=tensors: frame(m, t, False), it, args.repeats),
            "encode_signed": measure(lambda m=meta, t=tensors: frame(m, t, True), it, args.repeats),
            "decode": measure(lambda f=signed_frame: decode(f), it, args.repeats),
            "decode_and_verify": measure(lambda f=signed_frame: verify(decode(f), signer.public), it, args.repeats),
            "sign_only": measure(lambda m=message: signer.sign(m.signed_part), args.iterations, args.repeats),
            "verify_only": measure(lambda m=message: verify(m, signer.public), args.iterations, args.repeats),
        }
    per_round_cpu_us = 2 * ROUND_AGENTS * (cases["update_1MiB"]["sign_only"]["cpu_us"]
                                           + cases["update_1MiB"]["verify_only"]["cpu_us"])
    result = {
        "command": "python benchmarks/signing_cost.py " + " ".join(argv or []),
        "machine": f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}".strip(),
        "iterations": args.iterations, "repeats": args.repeats,
        "cases": cases,
        "round": {"agents": ROUND_AGENTS, "recorded_round_cpu_s": ROUND_CPU_S,
                  "signatures_per_round": 2 * ROUND_AGENTS, "verifications_per_round": 2 * ROUND_AGENTS,
                  "added_cpu_ms": round(per_round_cpu_us / 1000, 3),
                  "share_of_round_cpu": round(per_round_cpu_us / 1e6 / ROUND_CPU_S, 5)},
    }
    write_results(result, args.out, markdown)
    return result


def markdown(result: dict) -> str:
    rows = ["| message | frame bytes | step | wall µs | CPU µs |", "| --- | --- | --- | --- | --- |"]
    for name, case in result["cases"].items():
        for step in ("encode_unsigned", "encode_signed", "decode", "decode_and_verify", "sign_only", "verify_only"):
            rows.append(f"| {name} | {case['frame_bytes']:,} | {step} | {case[step]['wall_us']:.1f} | "
                        f"{case[step]['cpu_us']:.1f} |")
    r = result["round"]
    rows.append("")
    rows.append(f"Per round of {r['agents']} agents: {r['signatures_per_round']} signatures and "
                f"{r['verifications_per_round']} verifications = {r['added_cpu_ms']:.2f} ms CPU, "
                f"{100 * r['share_of_round_cpu']:.2f} % of the recorded {r['recorded_round_cpu_s']} CPU-s round.")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
