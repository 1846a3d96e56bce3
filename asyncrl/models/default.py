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
    seed: int = 0
    max_operand: int = 99
    # The demonstrator forgets the carry this often; the SFT model inherits the habit.
    forget_carry_prob: float = 0.6
    num_demonstrations: int = 50_000
    steps: int = 1500
    batch_size: int = 512
    lr: float = 4e-3
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

    from asyncrl.models.sft import sft
    from asyncrl.models.tiny import build_model, build_tokenizer
    from asyncrl.config import TaskConfig
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
        seed=defaults.seed, eval_seed=defaults.eval_seed, num_eval=defaults.num_eval, max_operand=settings.max_operand
    ).held_out
    pairs = demonstrations(
        settings.num_demonstrations,
        seed=settings.seed,
        max_operand=settings.max_operand,
        forget_carry_prob=settings.forget_carry_prob,
        exclude=held_out,
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
    info = {"settings": asdict(settings), "final_loss": result.final_loss, "sft_s": time.perf_counter() - start}
    (out_dir / "asyncrl_sft.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
