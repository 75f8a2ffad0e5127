"""A trainer agent for edgepfl federations, written from the documents alone.

It imports nothing of edgepfl: everything it does is specified in

* docs/PROTOCOL.md — topics (§2), the frame (§3, §4), message metas (§5; validated
  with the JSON Schemas of docs/schemas/), tensors (§6), validation (§7), chunking
  (§8), idempotent re-answers (§9), the agent life cycle (§10), presence and the roll
  call (§11); the codec follows the reference codec of §14;
* docs/MODELS.md — the networks, tensor by tensor (`cnn` and `mlp` encoders, the linear
  head) and which tensors each method shares;
* docs/METHODS.md — the local updates (Baselines: `fedavg`, `fedper`, `fedrep`).

It is a test fixture and an example for device makers: one file, readable top to
bottom. Its local data is an ``.npz`` of raw 8-bit images (``x_train``, ``x_test``:
uint8 N×C×H×W), integer labels (``y_train``, ``y_test``), ``num_classes`` and
``class_names`` (label j is ``class_names[j]``; mapped onto a run's class order, §5
Labels; "0", "1", … when absent); or, with
``--test-fraction F``, pooled ``x`` and ``y`` (the conformance kit's data, docs/CONFORMANCE.md),
split per class in file order: the last round(F · n) of a class's n samples are held out.

    python agent.py --broker mqtt://127.0.0.1:1883 --federation demo --agent-id dev-7 \
        --data client.npz --schemas docs/schemas --state-dir /var/lib/dev-7
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import queue
import signal
import struct
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import jsonschema
import numpy as np
import paho.mqtt.client as mqtt
import torch
import torch.nn.functional as F
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from torch import nn

log = logging.getLogger("foreign-agent")

PROTOCOL_VERSION = "1.1"
MAGIC = b"EPF1"
MAX_HEADER = 4 * 2**20                 # §3
CHUNK_HEADROOM = 2048                  # §8: step = M - 2048
CHUNK_SLACK = 64 * 1024                # §8: chunks accepted up to max(own M, announced M) + 64 KiB
PARTIALS_PER_TOPIC = 4                 # §8
PARTIAL_TIMEOUT_S = 300.0              # §8
ANSWERS_KEPT = 4                       # §9
DEFAULT_M = 1_000_000                  # §8, §15
DEFAULT_MAX_PAYLOAD = 256 * 2**20      # §15


class Rejected(ValueError):
    """A frame dropped by a check of PROTOCOL §7; ``reason`` is the section's tag."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# ----------------------------------------------------------------------------- codec (§3, §4, §6, §7)

class Codec:
    """Frames in and out, every check of PROTOCOL §7 (1–9) on the way in.

    The headers and metas are validated with the JSON Schemas in docs/schemas (§5)."""

    def __init__(self, schemas: Path):
        self._validators = {p.stem: jsonschema.Draft202012Validator(json.loads(p.read_text()))
                            for p in Path(schemas).glob("*.json")}

    def check(self, schema: str, document: dict) -> None:
        """Raise ``Rejected('malformed')`` unless ``document`` satisfies docs/schemas/<schema>.json."""
        error = jsonschema.exceptions.best_match(self._validators[schema].iter_errors(document))
        if error is not None:
            where = "/".join(map(str, error.absolute_path)) or "(top)"
            raise Rejected("malformed", f"{schema}: {where}: {error.message}")

    def encode(self, mtype: str, federation: str, sender: str, round: int, meta: dict,
               tensors: dict[str, np.ndarray] | None = None) -> bytes:
        self.check(f"meta-{mtype}", meta)  # never send what a strict receiver would reject
        tensors = {k: np.ascontiguousarray(v) for k, v in (tensors or {}).items()}
        body = st_save(tensors) if tensors else b""
        header = {
            "schema_version": 1, "type": mtype, "federation": federation, "sender": sender,
            "round": round, "message_id": uuid.uuid4().hex, "created": time.time(),
            "body_sha256": hashlib.sha256(body).hexdigest(), "body_bytes": len(body),
            "tensors": [{"name": k, "dtype": v.dtype.name, "shape": list(v.shape)} for k, v in tensors.items()],
            "meta": meta,
        }
        head = json.dumps(header).encode()
        return MAGIC + struct.pack(">I", len(head)) + head + body

    def decode(self, frame: bytes, max_bytes: int) -> tuple[dict, dict[str, np.ndarray]]:
        """(header, tensors) of an unsigned frame; raises :class:`Rejected`."""
        if len(frame) > max_bytes:
            raise Rejected("oversized", f"{len(frame)} bytes > {max_bytes}")
        if len(frame) < 8 or frame[:4] != MAGIC:
            raise Rejected("malformed", "not an edgepfl frame")
        (n,) = struct.unpack(">I", frame[4:8])
        if n > MAX_HEADER or 8 + n > len(frame):
            raise Rejected("malformed", "header length out of range")
        try:
            header = json.loads(frame[8:8 + n])
        except ValueError as exc:
            raise Rejected("malformed", f"header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise Rejected("malformed", "header is not a JSON object")
        self.check("header", header)
        if "signer" in header:  # this agent pins no coordinator key (§3a): signed frames are not for it
            raise Rejected("malformed", "signed frames are not supported by this agent")
        body = frame[8 + n:]
        if header["body_bytes"] != len(body):
            raise Rejected("malformed", "body length")
        if hashlib.sha256(body).hexdigest() != header["body_sha256"]:
            raise Rejected("corrupt", "body sha256 mismatch")
        self.check(f"meta-{header['type']}", header.get("meta", {}))
        manifest = {t["name"]: (t["dtype"], list(t["shape"])) for t in header.get("tensors", [])}
        if bool(body) != bool(manifest):
            raise Rejected("malformed", "the body must be empty exactly when the manifest is")
        try:
            tensors = st_load(body) if body else {}
        except Exception as exc:  # safetensors raises its own error type for a bad blob
            raise Rejected("malformed", f"body is not safetensors: {exc}") from None
        if {k: (v.dtype.name, list(v.shape)) for k, v in tensors.items()} != manifest:
            raise Rejected("malformed", "tensors differ from the manifest")
        if header["type"] != "chunk":
            for name, arr in tensors.items():
                if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                    raise Rejected("non_finite", name)
        return header, tensors


# ----------------------------------------------------------------------------- chunking (§8)

def split_frame(codec: Codec, frame: bytes, max_message: int, federation: str, sender: str,
                round: int) -> list[bytes]:
    """``frame`` itself when it fits one MQTT message of ``max_message`` bytes, else its chunks."""
    if len(frame) <= max_message:
        return [frame]
    step = max_message - CHUNK_HEADROOM
    count = math.ceil(len(frame) / step)
    parent, total = uuid.uuid4().hex, hashlib.sha256(frame).hexdigest()
    return [codec.encode("chunk", federation, sender, round,
                         {"parent_id": parent, "index": i, "count": count, "total_bytes": len(frame),
                          "total_sha256": total},
                         {"data": np.frombuffer(frame[i * step:(i + 1) * step], np.uint8)})
            for i in range(count)]


class Reassembler:
    """Partial frames per (topic, parent_id): any order, duplicates overwrite, at most
    ``PARTIALS_PER_TOPIC`` per topic (the least recently progressed is evicted), dropped
    after ``PARTIAL_TIMEOUT_S`` without a chunk."""

    def __init__(self, max_payload: int):
        self.max_payload = max_payload
        self._partials: dict[tuple[str, str], dict] = {}

    def add(self, topic: str, meta: dict, tensors: dict[str, np.ndarray]) -> bytes | None:
        """The whole frame once its last chunk arrived, else None; raises :class:`Rejected`."""
        data = tensors.get("data")
        if set(tensors) != {"data"} or data is None or data.dtype != np.uint8 or data.ndim != 1:
            raise Rejected("malformed", "a chunk carries exactly one 1-D uint8 tensor named 'data'")
        if meta["index"] >= meta["count"]:
            raise Rejected("malformed", "chunk index out of range")
        now = time.monotonic()
        for key in [k for k, p in self._partials.items() if now - p["seen"] > PARTIAL_TIMEOUT_S]:
            del self._partials[key]
        if meta["total_bytes"] > self.max_payload:
            raise Rejected("oversized", f"chunked frame of {meta['total_bytes']} bytes")
        key = (topic, meta["parent_id"])
        shape = (meta["count"], meta["total_bytes"], meta["total_sha256"])
        partial = self._partials.get(key)
        if partial is None:
            mine = sorted((k for k in self._partials if k[0] == topic), key=lambda k: self._partials[k]["seen"])
            for old in mine[:max(0, len(mine) - PARTIALS_PER_TOPIC + 1)]:
                log.warning("evicted a partial frame on %s", topic)
                del self._partials[old]
            partial = self._partials[key] = {"shape": shape, "slices": {}, "seen": now}
        elif partial["shape"] != shape:
            raise Rejected("malformed", "chunks of one frame disagree on count, total_bytes or total_sha256")
        partial["slices"][meta["index"]] = data.tobytes()
        partial["seen"] = now
        if len(partial["slices"]) < meta["count"]:
            return None
        del self._partials[key]
        frame = b"".join(partial["slices"][i] for i in range(meta["count"]))
        if len(frame) != meta["total_bytes"] or hashlib.sha256(frame).hexdigest() != meta["total_sha256"]:
            raise Rejected("corrupt", "reassembled frame does not match total_bytes / total_sha256")
        return frame


# ----------------------------------------------------------------------------- the model (MODELS.md)

def seed_for(*parts: object) -> int:
    """PROTOCOL §5: the parts joined with "/", SHA-256, the first 4 bytes big-endian, top bit cleared."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big") & 0x7FFFFFFF


class CNNEncoder(nn.Module):
    """MODELS.md `cnn`: Conv5(C→32) [BN] ReLU MaxPool2 → Conv5(32→64) [BN] ReLU MaxPool2 →
    Flatten → Linear(64·S·S → F) ReLU, in `encoder.conv` and `encoder.fc`."""

    def __init__(self, channels: int, side: int, feature_dim: int, batchnorm: bool):
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout in ((channels, 32), (32, 64)):
            layers.append(nn.Conv2d(cin, cout, 5))
            if batchnorm:
                layers.append(nn.BatchNorm2d(cout))
            layers += [nn.ReLU(), nn.MaxPool2d(2)]
        self.conv = nn.Sequential(*layers, nn.Flatten())
        s = ((side - 4) // 2 - 4) // 2
        self.fc = nn.Sequential(nn.Linear(64 * s * s, feature_dim), nn.ReLU())

    def forward(self, x):
        return self.fc(self.conv(x))


class MLPEncoder(nn.Module):
    """MODELS.md `mlp`: Flatten → Linear(C·H·W → 256) [BN] ReLU → Linear(256 → F) ReLU, in `encoder.net`."""

    def __init__(self, inputs: int, feature_dim: int, batchnorm: bool):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(inputs, 256)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(256))
        layers += [nn.ReLU(), nn.Linear(256, feature_dim), nn.ReLU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Classifier(nn.Module):
    """Encoder + linear head: the model of `fedavg`, `fedper` and `fedrep` (MODELS.md, Methods)."""

    def __init__(self, run: dict):
        super().__init__()
        c, h, w = run["data"]["input_shape"]
        m = run["model"]
        batchnorm = m["norm"] == "batch"
        if m["arch"] == "cnn":
            if h != w or h < 16:
                raise ValueError(f"the cnn encoder needs square inputs of side ≥ 16, not {h}×{w}")
            self.encoder: nn.Module = CNNEncoder(c, h, m["feature_dim"], batchnorm)
        elif m["arch"] == "mlp":
            self.encoder = MLPEncoder(c * h * w, m["feature_dim"], batchnorm)
        else:
            raise ValueError(f"arch {m['arch']!r} is not implemented by this agent")
        self.head = nn.Linear(m["feature_dim"], run["data"]["num_classes"])

    def forward(self, x):
        return self.head(self.encoder(x))


# ----------------------------------------------------------------------------- methods (METHODS.md, Baselines)

#: method -> (module prefixes whose tensors are shared, MODELS.md's encoder policy `shared`)
SHARED_PARTS = {"fedavg": ("encoder", "head"), "fedper": ("encoder",), "fedrep": ("encoder",)}
#: method -> its options and their defaults (METHODS.md)
OPTIONS = {"fedavg": {}, "fedper": {}, "fedrep": {"head_epochs": 4, "body_epochs": None}}


def shared_keys(method: str, model: nn.Module) -> list[str]:
    """The `state_dict` keys that travel: those of the shared parts, never `num_batches_tracked`."""
    parts = SHARED_PARTS[method]
    return [k for k in model.state_dict() if k.split(".")[0] in parts and not k.endswith("num_batches_tracked")]


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def make_optimizer(params, train: dict):
    """`run.train`'s optimizer, fresh for every phase."""
    if train["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=train["lr"], weight_decay=train["weight_decay"])
    return torch.optim.SGD(params, lr=train["lr"], momentum=train["momentum"], weight_decay=train["weight_decay"])


def fit(model, x, y, loss_fn, params, epochs: int, train: dict, generator) -> float:
    """Minimise ``loss_fn`` over ``params`` for ``epochs``, shuffled minibatches drawn from
    ``generator``, model in training mode; the sample-weighted mean loss (PROTOCOL §5)."""
    params = [p for p in params]
    opt = make_optimizer(params, train)
    model.train()
    total, count = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), train["batch_size"]):
            idx = order[start:start + train["batch_size"]]
            if len(idx) < 2 and has_batchnorm(model):
                continue  # MODELS.md: a batch of one is skipped with BatchNorm
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(x[idx], y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
    return total / count if count else math.nan


def local_update(method: str, options: dict, model: Classifier, x, y, train: dict, generator) -> float:
    """The method's local update; returns its `train_loss`."""
    if method == "fedrep":
        # classifier alone on detached features, then the encoder alone (train_loss: this phase)
        fit(model, x, y, lambda xb, yb: F.cross_entropy(model.head(model.encoder(xb).detach()), yb),
            model.head.parameters(), options["head_epochs"], train, generator)
        return fit(model, x, y, lambda xb, yb: F.cross_entropy(model(xb), yb), model.encoder.parameters(),
                   options["body_epochs"] or train["epochs"], train, generator)
    # fedavg, fedper: every parameter, jointly, cross-entropy
    return fit(model, x, y, lambda xb, yb: F.cross_entropy(model(xb), yb), model.parameters(),
               train["epochs"], train, generator)


@torch.no_grad()
def evaluate(model: nn.Module, x, y) -> tuple[int, float | None]:
    """(eval_correct, eval_loss): eval mode, argmax, mean natural-log cross-entropy."""
    if len(y) == 0:
        return 0, None
    model.eval()
    logits = model(x)
    return int((logits.argmax(1) == y).sum()), float(F.cross_entropy(logits, y))


# ----------------------------------------------------------------------------- the trainer

def split_pooled(x: np.ndarray, y: np.ndarray, test_fraction: float) -> dict[str, np.ndarray]:
    """Pooled samples -> train / held-out: per class, in file order, the last round(F · n) held out."""
    test = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        where = np.flatnonzero(y == label)
        held = int(round(test_fraction * len(where)))
        test[where[len(where) - held:]] = held > 0
    return {"x_train": x[~test], "y_train": y[~test], "x_test": x[test], "y_test": y[test]}


class Trainer:
    """Local data, the model of the current run, its personal state on disk."""

    def __init__(self, agent_id: str, data: Path, state_dir: Path, test_fraction: float | None = None):
        self.agent_id = agent_id
        raw = dict(np.load(data))
        if test_fraction is not None:
            raw.update(split_pooled(raw["x"], raw["y"], test_fraction))
        self.pixels = {"train": raw["x_train"], "test": raw["x_test"]}
        if any(p.dtype != np.uint8 or p.ndim != 4 for p in self.pixels.values()):
            raise ValueError(f"{data}: x_train and x_test must be uint8 (N, C, H, W)")
        self.labels = {s: torch.as_tensor(raw[f"y_{s}"], dtype=torch.long) for s in ("train", "test")}
        self.num_classes = int(raw["num_classes"]) if "num_classes" in raw else int(raw["y"].max()) + 1
        self.class_names = ([str(n) for n in raw["class_names"]] if "class_names" in raw
                            else [str(i) for i in range(self.num_classes)])
        self.state_dir = state_dir
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._model_key: str | None = None
        self.model: Classifier | None = None
        self._inputs: tuple[str, dict] | None = None

    @property
    def num_train(self) -> int:
        return len(self.labels["train"])

    @property
    def num_test(self) -> int:
        return len(self.labels["test"])

    def labels_for(self, run_names: list[str]) -> dict[str, torch.Tensor]:
        """The local labels in the run's numbering (PROTOCOL §5, Labels): local label j is the
        run's index of local name j; another set of names is not this agent's data."""
        if sorted(run_names) != sorted(self.class_names):
            raise ValueError(f"the run's classes {run_names} are not this agent's {self.class_names}")
        index = torch.tensor([run_names.index(name) for name in self.class_names], dtype=torch.long)
        return {split: index[labels] for split, labels in self.labels.items()}

    def inputs(self, data: dict) -> dict[str, torch.Tensor]:
        """The local images preprocessed as `run.data` says (PROTOCOL §5):
        x[c] = (p[c] · pixel_scale − mean[c]) / std[c], float32 NCHW."""
        key = json.dumps([data["pixel_scale"], data.get("normalization")])
        if self._inputs is not None and self._inputs[0] == key:
            return self._inputs[1]
        norm = data.get("normalization")
        channels = data["input_shape"][0]
        if norm is None:
            log.warning("the run does not say how inputs are normalized: using pixel_scale alone")
            norm = {"mean": [0.0] * channels, "std": [1.0] * channels}
        mean = np.asarray(norm["mean"], np.float32).reshape(1, -1, 1, 1)
        std = np.asarray(norm["std"], np.float32).reshape(1, -1, 1, 1)
        scale = np.float32(data["pixel_scale"])
        out = {s: torch.from_numpy((p.astype(np.float32) * scale - mean) / std) for s, p in self.pixels.items()}
        self._inputs = (key, out)
        return out

    def _personal_path(self) -> Path:
        return self.state_dir / f"personal-{self._model_key}.safetensors"

    def model_for(self, run: dict, method: str, options: dict) -> Classifier:
        """The model of ``run`` (built once per method + options + model), personal state restored."""
        key = hashlib.sha256(json.dumps([method, options, run["model"]], sort_keys=True).encode()).hexdigest()[:16]
        if key != self._model_key:
            # MODELS.md's personal initialisation (a MAY): a stand-in for an edgepfl agent of the
            # same id then starts from the same personal tensors
            torch.manual_seed(seed_for(run["seed"], "init", self.agent_id))
            self.model, self._model_key = Classifier(run), key
            path = self._personal_path()
            if path.exists():
                saved = st_load(path.read_bytes())
                self.model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in saved.items()}, strict=False)
                log.info("restored personal state from %s", path)
        assert self.model is not None
        return self.model

    def save_personal(self, method: str) -> None:
        """Everything not shared, written atomically (temp file, fsync, rename)."""
        assert self.model is not None
        shared = set(shared_keys(method, self.model))
        personal = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items() if k not in shared}
        path = self._personal_path()
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(st_save(personal))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def answer(self, task: dict, payload: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
        """The update's meta and tensors for one task (PROTOCOL §10, step 4.3–4.5)."""
        run = task["run"]
        method = run["method"]["name"]
        if method not in SHARED_PARTS:
            raise ValueError(f"method {method!r} is not implemented by this agent")
        unknown = set(run["method"]["options"]) - set(OPTIONS[method])
        if unknown:
            raise ValueError(f"unknown {method} options {sorted(unknown)}")
        options = {**OPTIONS[method], **run["method"]["options"]}
        shape = list(self.pixels["train"].shape[1:])
        if list(run["data"]["input_shape"]) != shape or run["data"]["num_classes"] != self.num_classes:
            raise ValueError(f"the run's data ({run['data']['input_shape']}, {run['data']['num_classes']} classes) "
                             f"is not this agent's ({shape}, {self.num_classes} classes)")
        x = self.inputs(run["data"])
        labels = self.labels_for(run["data"]["class_names"])
        started = time.perf_counter()
        model = self.model_for(run, method, options)
        keys = shared_keys(method, model)
        if set(payload) != set(keys):
            raise ValueError(f"payload tensors {sorted(set(payload) ^ set(keys))[:3]} do not fit the {method} model")
        with torch.no_grad():
            state = model.state_dict()
            for name, value in payload.items():
                state[name].copy_(torch.from_numpy(value.copy()))
        correct, eval_loss = evaluate(model, x["test"], labels["test"])
        meta = {"num_train": self.num_train, "num_test": self.num_test, "eval_correct": correct,
                "eval_loss": eval_loss, "train_loss": None}
        upload: dict[str, np.ndarray] = {}
        if task["kind"] == "train":
            generator = torch.Generator().manual_seed(task["seed"])
            torch.manual_seed(task["seed"])
            loss = local_update(method, options, model, x["train"], labels["train"], run["train"], generator)
            meta["train_loss"] = None if math.isnan(loss) else loss
            self.save_personal(method)
            state = model.state_dict()
            upload = {k: state[k].detach().cpu().numpy().copy() for k in keys}
        meta["train_seconds"] = time.perf_counter() - started
        return meta, upload


# ----------------------------------------------------------------------------- the agent (§1, §2, §10, §11)

class Agent:
    """Connects, announces itself, answers tasks until SIGTERM / SIGINT."""

    def __init__(self, args: argparse.Namespace):
        self.federation, self.agent_id = args.federation, args.agent_id
        self.codec = Codec(args.schemas)
        self.trainer = Trainer(args.agent_id, args.data, args.state_dir, args.test_fraction)
        self.own_m = args.max_message_bytes
        self.max_message = self.own_m                 # min(own, announced): §8
        self.accept_bytes = self.own_m + CHUNK_SLACK  # max(own, announced) + 64 KiB
        self.reassembler = Reassembler(DEFAULT_MAX_PAYLOAD)
        self.session = uuid.uuid4().hex               # one per process: §10 step 1
        self.answered_sessions: set[str] = set()
        self.answers: OrderedDict[str, list[bytes]] = OrderedDict()
        self.base = f"edgepfl/v1/{self.federation}/agents/{self.agent_id}"
        self.coordinator_topic = f"edgepfl/v1/{self.federation}/coordinator"
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = False
        host, _, port = args.broker.removeprefix("mqtt://").partition(":")
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgepfl-{self.federation}-{self.agent_id}",
                                  protocol=mqtt.MQTTv311, clean_session=True)
        self.client.will_set(f"{self.base}/status", self.status("offline"), qos=1, retain=True)
        self.client.on_connect = self.on_connect
        self.client.on_message = lambda c, u, msg: self.inbox.put((msg.topic, msg.payload))  # network thread: queue only
        self.client.reconnect_delay_set(1, 30)
        self.client.connect_async(host, int(port or 1883), keepalive=30)

    def status(self, state: str) -> bytes:
        meta = {"state": state, "tier": "trainer", "device": "cpu", "num_train": self.trainer.num_train,
                "num_test": self.trainer.num_test, "version": PROTOCOL_VERSION, "software": "foreign-agent 1.0",
                "platform": f"{platform.system()} {platform.machine()}", "session": self.session}
        return self.codec.encode("status", self.federation, self.agent_id, -1, meta)

    def on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("broker refused the connection: %s", reason_code)
            return
        client.subscribe([(f"{self.base}/task", 1), (self.coordinator_topic, 1)])  # every connect: §10 step 3
        client.publish(f"{self.base}/status", self.status("online"), qos=1, retain=True)  # birth
        log.info("connected; birth published")

    def publish(self, channel: str, frames: list[bytes]) -> None:
        for frame in frames:
            self.client.publish(f"{self.base}/{channel}", frame, qos=1)

    def run(self) -> None:
        self.client.loop_start()
        try:
            while not self.stopping:
                try:
                    topic, payload = self.inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if payload:  # empty: a retained message being cleared, not a frame (§3)
                    self.receive(topic, payload)
        finally:
            info = self.client.publish(f"{self.base}/status", self.status("offline"), qos=1, retain=True)
            info.wait_for_publish(5)
            self.client.disconnect()
            self.client.loop_stop()

    def receive(self, topic: str, payload: bytes) -> None:
        """One MQTT message: a frame, or a chunk of one; bad ones are logged and dropped."""
        try:
            header, tensors = self.codec.decode(payload, self.accept_bytes)
            if header["type"] == "chunk":
                whole = self.reassembler.add(topic, header["meta"], tensors)
                if whole is None:
                    return
                header, tensors = self.codec.decode(whole, self.reassembler.max_payload)
            if header["federation"] != self.federation:
                raise Rejected("wrong_federation", header["federation"])
            if header["sender"] != "coordinator":
                raise Rejected("wrong_sender", header["sender"])
            if topic == self.coordinator_topic and header["type"] == "coordinator":
                self.on_presence(header["meta"])
            elif topic == f"{self.base}/task" and header["type"] == "task":
                self.on_task(header, tensors)
            else:
                raise Rejected("wrong_type", f"{header['type']} on {topic}")
        except Rejected as exc:
            log.warning("dropped a message on %s: %s", topic, exc)

    def on_presence(self, meta: dict) -> None:
        """Adopt the announced message size (§8); answer a roll call (§11)."""
        announced = meta.get("max_message_bytes")
        if announced is not None:
            if announced < self.own_m and self.max_message != announced:
                log.warning("the coordinator announces max_message_bytes=%d, below this agent's %d", announced,
                            self.own_m)
            self.max_message = min(self.own_m, announced)
            self.accept_bytes = max(self.own_m, announced) + CHUNK_SLACK
        if meta.get("max_payload_bytes"):
            self.reassembler.max_payload = min(DEFAULT_MAX_PAYLOAD, meta["max_payload_bytes"])
        session = meta.get("session", "")
        if meta["state"] == "online" and session and session not in self.answered_sessions:
            self.answered_sessions.add(session)
            self.client.publish(f"{self.base}/status", self.status("online"), qos=1, retain=True)

    def on_task(self, header: dict, tensors: dict[str, np.ndarray]) -> None:
        task = header["meta"]
        cached = self.answers.get(task["task_id"])
        if cached is not None:  # QoS 1 redelivery: the same frames again, same message id (§9)
            self.publish("update", cached)
            return
        try:
            meta, upload = self.trainer.answer(task, tensors)
        except Exception as exc:  # a task this agent cannot run: log, do not answer (§5)
            log.error("task %s (round %d) refused: %s", task["task_id"], header["round"], exc)
            return
        meta = {"task_id": task["task_id"], "kind": task["kind"], **meta, "extra": {}}
        frame = self.codec.encode("update", self.federation, self.agent_id, header["round"], meta, upload)
        frames = split_frame(self.codec, frame, self.max_message, self.federation, self.agent_id, header["round"])
        self.answers[task["task_id"]] = frames
        while len(self.answers) > ANSWERS_KEPT:
            self.answers.popitem(last=False)
        self.publish("update", frames)
        log.info("round %d: %s task answered (%d of %d correct, %d message(s))", header["round"], task["kind"],
                 meta["eval_correct"], meta["num_test"], len(frames))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--broker", required=True, help="mqtt://host[:port]")
    parser.add_argument("--federation", required=True)
    parser.add_argument("--agent-id", required=True)
    parser.add_argument("--data", type=Path, required=True, help=".npz of raw uint8 images and labels")
    parser.add_argument("--schemas", type=Path, required=True, help="docs/schemas of the protocol version spoken")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_M)
    parser.add_argument("--test-fraction", type=float, help="--data holds pooled x / y: hold out this fraction "
                                                              "of each class (the last samples in file order)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Agent(args)

    def stop(*_):
        agent.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    agent.run()


if __name__ == "__main__":
    main()
