"""Where the embedded checkpoints live.

The package ships `asyncrl/assets/default_model/` (the student that `asyncrl launch` trains with no
arguments, so the default job needs no download) and `asyncrl/assets/teacher_model/` (the teacher
of on-policy distillation, docs/opd.md). How they are built belongs to the task they were made
for: `asyncrl/tasks/arithmetic_model.py` (`asyncrl sft`).
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "default_model"
TEACHER_MODEL_DIR = ASSETS_DIR / "teacher_model"
