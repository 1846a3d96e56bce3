"""A generator plugin that misbehaves on purpose (tests/integration/test_byo_task.py): the first
draw of every group's sample 0 has a NaN behavior log-prob, which the learner would reject."""

from __future__ import annotations

import dataclasses

from asyncrl.generators.torch_gen import TorchGenerator


class NanOnFirstDraw(TorchGenerator):
    def generate_sync(self, tasks):
        attempt = {t.task_id: t.attempt for t in tasks}
        return [
            dataclasses.replace(r, behavior_logprobs=[float("nan"), *r.behavior_logprobs[1:]])
            if r.sample_index == 0 and attempt[r.task_id] == 0
            else r
            for r in super().generate_sync(tasks)
        ]
