"""An agent builds no model larger than its config allows: one forged task naming ResNet-18
once made a digits agent build it (1.09 GB resident). A real agent process (default config)
is sent such a task by a plain MQTT client playing the coordinator, on an unsigned
deployment: it refuses it ``unsupported_arch`` with the parameter count in the detail,
without building it (its peak memory does not grow), stays up, and trains the honest task
that follows."""

from __future__ import annotations

from pathlib import Path

from edgepfl.agent_config import DEFAULT_MAX_MODEL_PARAMS
from edgepfl.protocol import AgentChannel, MessageType, RefusalMeta, UpdateMeta, decode

from tests.fleet_helpers import RunningFleet, run_config, wait_until
from tests.integration.agent.test_agent_protocol12 import AGENT, PlayedCoordinator, _statuses


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_forged_resnet18_task_is_refused_unbuilt_and_the_honest_task_still_trains(mosquitto, tmp_path):
    config = run_config(model={"arch": "mlp", "feature_dim": 32}, data={"dataset": "digits"})
    with RunningFleet(config, tmp_path, mosquitto.url, 1) as fleet:
        played = PlayedCoordinator(mosquitto.url, config.federation)
        try:
            _statuses(played, 1)
            played.presence("1.9")
            _statuses(played, 2)
            honest = fleet.config.run_spec(**fleet.shape())
            warm = played.task(honest, round=0, kind="evaluate")  # the agent at its working size
            wait_until(lambda: len(played.sent(AgentChannel.UPDATE)) >= 1, 120, what="the first answer")
            before = _peak_rss_kb(fleet.procs[AGENT].pid)
            forged = honest.model_copy(update={"model": honest.model.model_copy(update={"arch": "resnet18"})})
            refused = played.task(forged, round=1, kind="train")
            trained = played.task(honest, round=2, kind="train")
            frames = wait_until(lambda: len(s := played.sent(AgentChannel.UPDATE)) >= 3 and s, 180,
                                what="the refusal and the honest update")
            after = _peak_rss_kb(fleet.procs[AGENT].pid)
            assert fleet.procs[AGENT].poll() is None
        finally:
            played.close()
    answers = {m.meta.task_id: m for m in map(decode, frames)}
    assert answers[warm].type == MessageType.UPDATE
    refusal = answers[refused]
    assert refusal.type == MessageType.REFUSAL and refusal.meta_as(RefusalMeta).reason == "unsupported_arch"
    detail = refusal.meta_as(RefusalMeta).detail
    assert "11,175,370 parameters" in detail and f"max_model_params {DEFAULT_MAX_MODEL_PARAMS:,}" in detail, detail
    assert "not built" in detail
    assert after - before < 30_000, (before, after)  # ResNet-18's 45 MB of weights never allocated
    update = answers[trained]
    assert update.type == MessageType.UPDATE and update.meta_as(UpdateMeta).kind == "train" and update.tensors
    assert "built fedavg model" in fleet.log(AGENT) and "torchvision" not in fleet.log(AGENT)
