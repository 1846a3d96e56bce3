"""Optional third-party metric sinks (TensorBoard, wandb offline), fed by the launcher's hub.

Place in the data flow: `MonitorHub.publish` (monitor/stream.py) hands every record to these
sinks in the launcher process, after it is in metrics.jsonl. Both are import-guarded: asking for
a sink whose package is missing is a clear error at `asyncrl launch` time (`check_sinks`), and
nothing here is imported unless `monitor.sinks` names it. Scalars are keyed by learner step.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config

SINK_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}
STEP_FIELDS = ("loss", "mean_reward", "max_staleness", "mean_staleness", "clip_fraction", "grad_norm")


def check_sinks(names) -> None:
    """Raise ValueError naming the package to install for a requested sink that is unavailable."""
    for name in names:
        packages = SINK_PACKAGES.get(name)
        if packages is None:
            raise ValueError(f"monitor.sinks: unknown sink {name!r}; valid: {', '.join(SINK_PACKAGES)}")
        if not any(importlib.util.find_spec(p) is not None for p in packages):
            raise ValueError(
                f"monitor.sinks asks for {name!r} but {' or '.join(packages)} is not installed "
                f"(pip install {packages[0]}), or remove it from monitor.sinks"
            )


def scalars(record: dict) -> dict[str, float]:
    """The numeric figures of one record, with TensorBoard-style names (pure)."""
    kind = record.get("type")
    out: dict[str, float] = {}
    if kind == "step":
        for name in STEP_FIELDS:
            if isinstance(record.get(name), int | float):
                out[f"train/{name}"] = float(record[name])
        if isinstance(record.get("samples_per_s"), int | float):
            out["throughput/samples_per_s"] = float(record["samples_per_s"])
        for key, value in (record.get("stats") or {}).items():
            if isinstance(value, int | float):
                out[f"policy/{key}"] = float(value)
    elif kind == "metrics":
        source = str(record.get("source", "?"))
        for key, value in record.items():
            if key not in ("type", "time_s", "source") and isinstance(value, int | float):
                out[key if key.startswith(source) else f"{source}/{key}"] = float(value)
    elif kind == "publish" and isinstance(record.get("publish_s"), int | float):
        out[f"weights/{record.get('transport', '?')}/publish_s"] = float(record["publish_s"])
    elif kind == "loaded" and isinstance(record.get("load_s"), int | float):
        out[f"weights/{record.get('generator_id', '?')}/load_s"] = float(record["load_s"])
    return out


class _StepKeyed(ABC):
    """Tracks the learner step so that every scalar has an x coordinate."""

    def __init__(self) -> None:
        self.step = 0

    def on_record(self, record: dict) -> None:
        if record.get("type") == "step":
            self.step = int(record["step"]) + 1
        values = scalars(record)
        if values:
            self.write(values, self.step)

    @abstractmethod
    def write(self, values: dict[str, float], step: int) -> None:
        """Send one record's scalars at `step` to the sink's backend."""


class TensorBoardSink(_StepKeyed):
    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter
        else:
            from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink(_StepKeyed):
    """wandb in offline mode: files under <run>/wandb, `wandb sync` uploads them later."""

    def __init__(self, run_dir: Path, config: dict) -> None:
        super().__init__()
        import wandb

        self.run = wandb.init(
            project="asyncrl", name=run_dir.name, dir=str(run_dir), mode="offline", config=config
        )

    def write(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def make_sinks(names, run_dir: Path, config: Config) -> list:
    import msgspec

    check_sinks(names)
    sinks: list = []
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        elif name == "wandb":
            sinks.append(WandbSink(run_dir, msgspec.to_builtins(config)))
    return sinks
