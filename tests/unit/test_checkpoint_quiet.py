"""A one-process learner checkpoint is quiet: torch.distributed.checkpoint warned "torch.distributed
is disabled, unavailable or uninitialized, assuming the intent is to save in a single process" at
every save (and load), and that warning was what the launcher showed as a dead learner's last lines."""

from __future__ import annotations

import re
import types
import warnings

import torch

from asyncrl.learner.checkpoint import (
    _SINGLE_PROCESS_WARNING,
    load_learner_checkpoint,
    save_learner_checkpoint,
)


class _Trainer:
    """What the checkpoint reads and writes of a one-rank trainer, and nothing else."""

    rank = 0
    world_size = 1
    lockstep = False  # one plain rank: its weight copies go in the extras file

    def __init__(self) -> None:
        self.actor = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.SGD(self.actor.parameters(), lr=0.1)
        self.copies = types.SimpleNamespace(
            state_dict=lambda: {"ewma": None, "snapshots": {}}, load_state_dict=lambda state: None
        )
        self.updater = types.SimpleNamespace(nonfinite_total=0, restore=lambda nonfinite_total: None)


def _single_process_lines(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "single process" in str(w.message)]


def test_a_one_process_save_and_load_warn_nothing_about_torch_distributed(tmp_path):
    assert not torch.distributed.is_initialized()
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_learner_checkpoint(tmp_path, 1, _Trainer())
        load_learner_checkpoint(tmp_path, 1, _Trainer())
    assert _single_process_lines(caught) == []
    assert warnings.filters == filters  # the silencing ends with the call


def test_the_silenced_message_is_the_one_dcp_emits(tmp_path):
    """DCP called directly still warns (so the filter above is what keeps it quiet), with a message
    the filter matches; a torch that stops warning passes too."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "raw")
    assert all(re.search(_SINGLE_PROCESS_WARNING, line) for line in _single_process_lines(caught))
