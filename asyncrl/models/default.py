"""The embedded default checkpoint: where it lives and how `asyncrl sft` rebuilds it.

The package ships `asyncrl/assets/default_model/` (about 1.3 MB), produced by
`asyncrl sft --out asyncrl/assets/default_model` with the settings below. `asyncrl launch` with no
arguments trains it with RL, so the default job needs no download and no warm-up.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_model"


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


def build_default_checkpoint(
    out_dir: Path,
    settings: SftSettings = SftSettings(),
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Create the tiny model and tokenizer, warm-start them with SFT, save to `out_dir`."""
    import torch

    from asyncrl.config import TaskConfig
    from asyncrl.models.sft import sft
    from asyncrl.models.tiny import build_model, build_tokenizer
    from asyncrl.tasks.arithmetic import AdditionTask, demonstrations

    torch.manual_seed(settings.seed)
    tokenizer = build_tokenizer()
    model = build_model(
        len(tokenizer),
        hidden_size=settings.hidden_size,
        num_layers=settings.num_layers,
        num_heads=settings.num_heads,
        seed=settings.seed,
    )
    # Never demonstrate the default job's held-out evaluation prompts.
    defaults = TaskConfig()
    held_out = AdditionTask(
        seed=defaults.seed,
        eval_seed=defaults.eval_seed,
        num_eval=defaults.num_eval,
        max_operand=settings.max_operand,
    ).held_out
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
    (out_dir / "asyncrl_sft.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
