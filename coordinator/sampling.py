"""Who takes part in a round: a seeded sample of the online trainers, and the evaluators.

Deterministic per (seed, round): a restarted coordinator samples the same agents, and
the in-process and MQTT fleets the same ones.
"""

from __future__ import annotations

import math

import numpy as np

from edgepfl.config import RunConfig

# Keeps the evaluators' sample independent of the trainers' drawn from the same seed and round.
EVALUATION_STREAM = 1
# Keeps each device's Poisson draw apart from the other streams of the seed and round.
POISSON_STREAM = 2


def sample_agents(online: list[str], fraction: float, seed: int, round: int) -> list[str]:
    """Deterministic per (seed, round): the same sample whether or not the coordinator restarted."""
    if not online:
        return []
    return draw(online, sample_size(fraction, len(online)), [seed, round])


def poisson_sample(online: list[str], rate: float, seed: int, round: int) -> list[str]:
    """Each of ``online`` independently with probability ``rate`` (``privacy.sampling:
    poisson``), sorted: its own draw from the seed, the round and its id, so one device's
    inclusion depends on no other device being online. Deterministic per (seed, round)."""
    return sorted(a for a in online
                  if np.random.default_rng([seed, round, POISSON_STREAM, *a.encode()]).random() < rate)


def sample_size(fraction: float, online: int) -> int:
    """How many of ``online`` trainers a round samples: ``fraction`` of them, at least one."""
    return max(1, round_half_up(fraction * online))


def draw(agents: list[str], k: int, entropy: list[int]) -> list[str]:
    """``k`` of ``agents`` (all of them when ``k`` reaches their number), sorted; the same for the same ``entropy``."""
    if k >= len(agents):
        return sorted(agents)
    if k <= 0:
        return []
    rng = np.random.default_rng(entropy)
    return sorted(rng.choice(sorted(agents), size=k, replace=False).tolist())


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def choose_participants(online: list[str], config: RunConfig, r: int, final: bool) -> tuple[list[str], list[str]]:
    """Who trains round ``r`` (a seeded sample of ``online``; nobody in the final round)
    and who only evaluates, on evaluation rounds: enough of the other online trainers,
    drawn with the seed and round, that ``eval_fraction`` of the online trainers
    (``final_eval_fraction`` in the final round) are evaluated. The trainers count: each
    evaluates the global model before it trains."""
    c = config
    rate = c.privacy.poisson_rate(c.fraction)
    sampled = [] if final else sample_agents(online, c.fraction, c.seed, r) if rate is None else \
        poisson_sample(online, rate, c.seed, r)
    if not (final or r % c.eval_every == 0):
        return sampled, []
    training = set(sampled)
    idle = [a for a in online if a not in training]
    share = c.eval_fraction if not final or c.final_eval_fraction is None else c.final_eval_fraction
    wanted = max(1, round_half_up(share * len(online))) - len(sampled)
    return sampled, draw(idle, wanted, [c.seed, r, EVALUATION_STREAM])


__all__ = ["choose_participants", "draw", "poisson_sample", "round_half_up", "sample_agents", "sample_size"]
