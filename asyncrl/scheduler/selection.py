"""Prompt selection (pure): which training-stream prompt each newly admitted group samples.

Place in the data flow: the dispatcher (`scheduler/dispatch.py`) admits groups by id (the admission
mode decides how many and which ids); before rendering them it asks its `Selector` which index of
the task's training stream each group's prompt is (`task.train_problem(index)`,
`PromptTask.dataset_index`). Group ids, windows and the task book are unchanged by selection: it
only chooses the prompt.

`UniformSelector` is today's stream: group j samples prompt j, in the task's own order (the
dataset task shuffles each epoch with its seed), so every prompt is seen once per epoch. It is
the default and the baseline every adaptive strategy is measured against (#37). Adaptive
strategies (pass-rate posteriors, skipping solved or hopeless prompts, priorities) will also need
the groups' rewards and checkpointed state, so that a resumed run re-admits the same prompts;
they are not built yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Selector(Protocol):
    """Chooses the training-stream index of each admitted group's prompt."""

    def select(self, groups: Sequence[int]) -> list[int]:
        """The stream index (`task.train_problem`'s argument) of each group in `groups`, in order.
        Called once per admission, with the groups in admission order."""


class UniformSelector:
    """Group j samples stream index j: the task's order, each prompt once per epoch."""

    def select(self, groups: Sequence[int]) -> list[int]:
        return list(groups)
