"""Task deltas (coordinator/downlink.py, protocol 1.7): a round's tasks carry the state's change
since the previous round's tasks to the agents that hold those, in runs of real trainer tiers
on the in-process fleet (digits, an MLP; the frames are the MQTT fleet's)."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.codecs import dequantize
from edgepfl.config import ConfigError, RunConfig, parse_config
from edgepfl.coordinator.downlink import DownlinkChain
from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.coordinator.result import RoundResult
from edgepfl.coordinator.round_tasks import RoundTasks
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.methods import create_method
from edgepfl.protocol import Message, StatusMeta

pytest.importorskip("torch")

AGENTS = 3


def config(downlink: str, method: str = "fedavg", rounds: int = 4) -> RunConfig:
    return prepare(RunConfig(federation="downlink", method={"name": method}, model={"arch": "mlp", "feature_dim": 16},
                             train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits"}, rounds=rounds,
                             min_agents=AGENTS, device="cpu", compression={"downlink": downlink}), AGENTS)


class SpeaksOneSix:
    """A trainer that announces protocol 1.6: it is never sent a task delta."""

    def __init__(self, tier):
        self.tier = tier

    def status(self) -> StatusMeta:
        return self.tier.status().model_copy(update={"version": "1.6"})

    def handle(self, message: Message):
        return self.tier.handle(message)


class ForgetsAtRound:
    """A trainer that loses the tensors it held (as a process that lost its memory would,
    without a new session) just before its task of round ``round``."""

    def __init__(self, tier, round: int):
        self.tier, self.round = tier, round

    def status(self) -> StatusMeta:
        return self.tier.status()

    def handle(self, message: Message):
        if message.header.round == self.round:
            self.tier.runtime._held = None
        return self.tier.handle(message)


def run(cfg: RunConfig, tmp_path, wrap=lambda agent_id, tier: tier) -> tuple[Coordinator, list]:
    out = tmp_path / f"run-{cfg.compression.downlink}-{len(list(tmp_path.iterdir()))}"
    agents = {a: wrap(a, tier) for a, tier in local_trainers(cfg, agent_ids(AGENTS), out).items()}
    coordinator = Coordinator(cfg, LocalFleet(agents, cfg.federation), out, progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    return coordinator, coordinator.run()


def state_bytes(coordinator: Coordinator) -> dict[str, bytes]:
    assert coordinator.state is not None
    return {k: np.ascontiguousarray(v).tobytes() for k, v in coordinator.state.to_flat().items()}


@pytest.mark.parametrize("codec", ["q8", "q4"])
def test_deltas_after_the_first_round_train_the_same_states_as_whole_tasks_for_far_fewer_bytes(codec, tmp_path):
    with_deltas, rows = run(config(codec), tmp_path)
    whole, whole_rows = run(config(codec), tmp_path, wrap=lambda a, tier: SpeaksOneSix(tier))
    # the agents decode exactly what a whole task carries: the same states, bit for bit, and the same figures
    assert state_bytes(with_deltas) == state_bytes(whole)
    assert [r.accuracy for r in rows] == [r.accuracy for r in whole_rows]
    assert not any(r.refused for r in rows)
    # round 0 goes whole to everyone (nobody holds a base); every later round as a delta
    assert rows[0].bytes_down == pytest.approx(whole_rows[0].bytes_down, rel=0.01)  # headers differ by a byte or so
    most = {"q8": 0.35, "q4": 0.2}[codec]  # the MLP's small tensors: the codec header weighs more than on a CNN
    for row, whole_row in zip(rows[1:], whole_rows[1:], strict=True):
        assert row.bytes_down < most * whole_row.bytes_down, (row.round, row.bytes_down, whole_row.bytes_down)
        assert set(row.task_bytes) == {codec} and set(whole_row.task_bytes) == {"whole"}  # the rows say how
    assert set(rows[0].task_bytes) == {"whole"}


def test_an_agent_that_lost_its_base_refuses_the_delta_and_gets_the_next_task_whole(tmp_path):
    forgetful = agent_ids(AGENTS)[1]
    coordinator, rows = run(config("q8"), tmp_path,
                            wrap=lambda a, tier: ForgetsAtRound(tier, 2) if a == forgetful else tier)
    assert [dict(r.refused) for r in rows] == [{}, {}, {"no_base": 1}, {}, {}]
    assert forgetful not in rows[2].participants and forgetful in rows[3].participants
    assert forgetful in coordinator.registry.eligible()  # not excluded: a no_base refusal is not for good


def test_without_a_downlink_codec_the_state_is_the_aggregate_and_tasks_go_whole(tmp_path):
    _, rows = run(config("none", rounds=2), tmp_path)
    assert rows[1].bytes_down >= rows[0].bytes_down * 0.99


def test_the_adopted_state_is_the_base_plus_the_dequantized_change_with_exact_tensors_kept():
    cfg = config("q4", method="fedbn")
    method = create_method("fedbn")
    from edgepfl.config import ModelSpec

    model = method.build_model(ModelSpec(arch="cnn", feature_dim=16), (1, 28, 28), 10)
    base = method.init_server(model)
    rng = np.random.default_rng(0)
    moved = {k: (v + rng.normal(0, 0.01, v.shape)).astype(v.dtype) if v.dtype == np.float32 else v
             for k, v in base.global_tensors.items()}
    candidate = type(base)(global_tensors=moved, client_tensors=base.client_tensors, extra=dict(base.extra))
    chain = DownlinkChain(cfg, method)
    adopted = chain.step(candidate, base, RoundTasks(0), RoundResult(round=0))
    assert chain.delta is not None and adopted.global_tensors is chain.delta.tensors
    changes = dequantize(chain.delta.encoded)
    for name, value in adopted.global_tensors.items():
        if name in changes:  # compressed: exactly base + change in float32, within a step of the aggregate
            assert value.tobytes() == (base.global_tensors[name] + changes[name]).astype(np.float32).tobytes()
            assert np.abs(value - moved[name]).max() <= np.abs(changes[name]).max() / 7 + 1e-7
        else:  # integers, BatchNorm statistics: as aggregated
            assert value.tobytes() == np.asarray(moved[name]).tobytes(), name
    # a rolled-back state is another one: its tasks go whole
    assert chain.delta_for(base, 1, None) is None


def test_task_deltas_need_synchronous_rounds():
    with pytest.raises(ConfigError, match="compression.downlink needs synchronous rounds"):
        parse_config(RunConfig, {"compression": {"downlink": "q8"}, "asynchrony": {"mode": "buffered"}}, "x.yaml")


def test_a_round_whose_aggregate_is_not_adopted_is_followed_by_whole_tasks(tmp_path):
    """The state did not change, so there is no delta from the round before: the agents hold
    that round's tensors, which are the state's, and are sent them whole again (a delta against
    an older round would be refused as ``no_base``)."""
    cfg = config("q8", rounds=3)
    cfg = cfg.model_copy(update={"aggregation": cfg.aggregation.model_copy(update={"max_change_ratio": 1e-9})})
    _, rows = run(cfg, tmp_path)
    assert all(r.aborted for r in rows[:-1]) and not any(r.refused for r in rows)
    assert all(r.bytes_down == pytest.approx(rows[0].bytes_down, rel=0.01) for r in rows)
