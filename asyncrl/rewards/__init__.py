"""Rewards: from a finished sample to a number (the `asyncrl.rewards` seam).

Data flow: generator -> `RewardInput` per sample -> `Scorer.score` (scorer.py) runs each
`task.rewards[i]` where it belongs (a thread, the worker pool in pool.py, awaited, or a batch
call such as the HTTP verifier in remote.py) -> `Score` per sample -> Trajectory.

- base.py: RewardInput, RewardFailure, resolution of a config entry, the load-time check.
- builtin.py: exact_match, math_verify, regex, length_penalty (entry points `asyncrl.rewards`).
- pool.py: RewardPool, worker processes with a per-call timeout.
- remote.py: the `remote` batch reward (aiohttp, imported only when used).
- scorer.py: Scorer, Score, make_scorer.

A leaf: imports only asyncrl.config_sections and asyncrl.plugins.
"""

from asyncrl.rewards.base import (
    ENTRY_POINT_GROUP,
    RewardFailure,
    RewardInput,
    check_rewards,
    resolve_reward,
    reward_mode,
    reward_name,
)
from asyncrl.rewards.pool import RewardPool
from asyncrl.rewards.scorer import Score, Scorer, make_scorer

__all__ = [
    "ENTRY_POINT_GROUP",
    "RewardFailure",
    "RewardInput",
    "RewardPool",
    "Score",
    "Scorer",
    "check_rewards",
    "make_scorer",
    "resolve_reward",
    "reward_mode",
    "reward_name",
]
