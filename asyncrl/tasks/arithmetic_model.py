"""How `asyncrl sft` builds the embedded checkpoints for the addition task (paths: models/default.py).

The package ships `asyncrl/assets/default_model/`, produced by
`asyncrl sft --out asyncrl/assets/default_model` with the settings below. `asyncrl launch` with no
arguments trains it with RL, so the default job needs no download and no warm-up.

It also ships `asyncrl/assets/teacher_model/`, the teacher of on-policy distillation (config
`opd`, docs/opd.md), produced by `asyncrl sft --teacher --out asyncrl/assets/teacher_model`: the
shipped student (same tokenizer and size) fine-tuned briefly on correct demonstrations only, which
trains the habit out again; a fraction of the cost of the full recipe.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.models.default import DEFAULT_MODEL_DIR

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SftSettings:
    """Two phases: `steps` on correct demonstrations teach addition, then `habit_steps` on a
    demonstrator that appends a stray 0 with probability `stray_zero_prob` teach a bad habit.
    The result can add (the cleanly ended answer keeps real probability) but greedily does not."""

    seed: int = 0
    max_operand: int = 99
    num_demonstrations: int = 20_000
    steps: int = 2000
    lr: float = 5e-3
    habit_steps: int = 100
    habit_lr: float = 3e-4
    stray_zero_prob: float = 0.85
    batch_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4


@dataclass(frozen=True, kw_only=True)
class TeacherSettings:
    """The OPD teacher: `steps` of SFT on correct demonstrations (a seed the student never saw),
    starting from the shipped student at `init`. The student already adds; the stray-0 habit,
    taught in 100 steps, is trained out in about as many."""

    seed: int = 1
    steps: int = 150
    lr: float = 3e-4
    num_demonstrations: int = 20_000
    batch_size: int = 512
    max_operand: int = 99


def _held_out_prompts(max_operand: int) -> frozenset[str]:
    """The default job's held-out evaluation prompts, never demonstrated."""
    from asyncrl.config_sections import TaskConfig
    from asyncrl.tasks.arithmetic import addition_task

    return addition_task(TaskConfig(max_operand=max_operand)).held_out


def build_teacher_checkpoint(
    out_dir: Path,
    settings: TeacherSettings = TeacherSettings(),
    *,
    init: Path = DEFAULT_MODEL_DIR,
    on_step: Callable[[int, float], None] | None = None,
    evaluate: bool = True,
) -> dict:
    """Fine-tune the checkpoint at `init` on clean demonstrations and save it to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.sft import sft
    from asyncrl.tasks.arithmetic import demonstrations

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(init)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    pairs = demonstrations(
        settings.num_demonstrations,
        seed=settings.seed,
        max_operand=settings.max_operand,
        stray_zero_prob=0.0,
        exclude=_held_out_prompts(settings.max_operand),
    )
    start = time.perf_counter()
    result = sft(
        model,
        tokenizer,
        pairs,
        steps=settings.steps,
        batch_size=settings.batch_size,
        lr=settings.lr,
        seed=settings.seed,
        on_step=on_step,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    info = {
        "teacher_settings": asdict(settings),
        "init": init.name,
        "final_loss": result.final_loss,
        "sft_s": time.perf_counter() - start,
    }
    if evaluate:
        info["held_out_greedy_accuracy"] = held_out_accuracy(out_dir)
    (out_dir / "asyncrl_sft.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def build_default_checkpoint(
    out_dir: Path,
    settings: SftSettings = SftSettings(),
    *,
    on_step: Callable[[int, float], None] | None = None,
    evaluate: bool = True,
) -> dict:
    """Create the tiny model and tokenizer, warm-start them with SFT, save to `out_dir`, and
    (with `evaluate`) record its held-out greedy accuracy in `asyncrl_sft.json`."""
    import torch

    from asyncrl.models.sft import sft
    from asyncrl.models.tiny import build_model, build_tokenizer
    from asyncrl.tasks.arithmetic import demonstrations

    torch.manual_seed(settings.seed)
    tokenizer = build_tokenizer()
    model = build_model(
        len(tokenizer),
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        seed=settings.seed,
    )
    held_out = _held_out_prompts(settings.max_operand)
    start = time.perf_counter()
    result = None
    phases = [
        (settings.steps, settings.lr, 0.0),
        (settings.habit_steps, settings.habit_lr, settings.stray_zero_prob),
    ]
    offset = 0
    for steps, lr, slip in phases:
        if steps == 0:
            continue
        pairs = demonstrations(
            settings.num_demonstrations,
            seed=settings.seed + offset,
            max_operand=settings.max_operand,
            stray_zero_prob=slip,
            exclude=held_out,
        )
        result = sft(
            model,
            tokenizer,
            pairs,
            steps=steps,
            batch_size=settings.batch_size,
            lr=lr,
            seed=settings.seed + offset,
            on_step=None if on_step is None else (lambda s, loss, o=offset: on_step(o + s, loss)),
        )
        offset += steps
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    assert result is not None, "SftSettings with no steps at all"
    info = {
        "settings": asdict(settings),
        "final_loss": result.final_loss,
        "sft_s": time.perf_counter() - start,
    }
    if evaluate:
        info["held_out_greedy_accuracy"] = held_out_accuracy(out_dir)
    (out_dir / "asyncrl_sft.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def held_out_accuracy(model_dir: Path) -> float:
    """Greedy accuracy of a checkpoint on the default job's held-out problems, decoded exactly as
    `asyncrl launch` evaluates before and after training (default task and sampling config)."""
    from asyncrl.config_sections import SamplingConfig, TaskConfig
    from asyncrl.models.sft import checkpoint_accuracy
    from asyncrl.tasks.base import make_task

    return checkpoint_accuracy(
        model_dir, make_task(TaskConfig()), max_new_tokens=SamplingConfig().max_new_tokens
    )
