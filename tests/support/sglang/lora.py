"""LoRA adapters in the stand-in SGLang server: what `/load_lora_adapter` reads, and how a request
that names an adapter (`lora_path` on /generate) is computed.

Place in the data flow: `server.py` hands `/load_lora_adapter` bodies to `Engine.load_lora_adapter`
(`engine.py`), which calls `read_adapter` here off its lock and registers the result under the
adapter's name; `/unload_lora_adapter` unregisters it (new requests naming it fail at once) and
returns once no running request uses it, as SGLang's `LoRARegistry` does. Every forward of a
request with an adapter runs the model with each adapted weight replaced by W + (alpha / r) B A,
W being the weight the server holds at that moment (so a base-weight update applies under the
adapter too, as in SGLang, which applies adapters unmerged).

What is checked at load, with SGLang's wording where it has one: the server was started with
`--enable-lora`; the directory holds a PEFT adapter (`adapter_config.json` and
`adapter_model.safetensors`); its rank is at most `--max-lora-rank` and its target modules are
among `--lora-target-modules` (when given; `all` allows any); every tensor is a `lora_A` / `lora_B`
of a linear layer of the model with the right shape. Not modelled: GPU memory slots
(`--max-loras-per-batch`), eviction (`--max-loaded-loras`), DoRA and rsLoRA, adapters on embeddings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.sglang.params import RequestError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSettings:
    """The server's LoRA flags (`--enable-lora`, `--max-lora-rank`, `--lora-target-modules`)."""

    enabled: bool = False
    max_rank: int | None = None
    target_modules: tuple[str, ...] = ()  # () = inferred (any); ("all",) = any


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    deltas: dict[str, torch.Tensor] = field(default_factory=dict)  # weight name -> scaling * B @ A

    def params(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The adapted weights for one forward: the model's current W plus this adapter's delta."""
        current = dict(model.named_parameters())
        return {name: current[name] + delta for name, delta in self.deltas.items()}


def _split(key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "A")."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if key.startswith(_PEFT_PREFIX) and key.endswith(suffix):
            return key[len(_PEFT_PREFIX) : -len(suffix)], part
    raise RequestError(f"unexpected tensor {key!r} in the adapter (expected PEFT lora_A / lora_B weights)")


def read_adapter(model: torch.nn.Module, name: str, path: str, settings: LoraSettings) -> Adapter:
    """Read and check the PEFT adapter directory `path` against `model`; RequestError says why not."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not settings.enabled:
        raise RequestError(NOT_ENABLED)
    directory = Path(path)
    try:
        config: dict[str, Any] = json.loads((directory / CONFIG_NAME).read_text())
        tensors = load_file(directory / WEIGHTS_NAME)
    except (OSError, ValueError, SafetensorError) as exc:
        raise RequestError(f"Failed to load LoRA adapter {name} from {path}: {exc}") from None
    if config.get("use_dora") or config.get("use_rslora"):
        raise RequestError(f"LoRA adapter {name}: DoRA and rsLoRA are not supported by the stand-in server")
    rank = int(config.get("r", 0))
    if rank <= 0:
        raise RequestError(f"LoRA adapter {name}: adapter_config.json has no positive rank r")
    if settings.max_rank is not None and rank > settings.max_rank:
        raise RequestError(
            f"LoRA adapter {name} has rank {rank}, which exceeds --max-lora-rank {settings.max_rank}"
        )
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    allowed = set(settings.target_modules)
    if allowed and "all" not in allowed:
        outside = sorted({t.rsplit(".", 1)[-1] for t in targets} - allowed)
        if outside:
            raise RequestError(
                f"LoRA adapter {name} targets {outside}, which are not in --lora-target-modules {sorted(allowed)}"
            )
    scaling = float(config.get("lora_alpha", rank)) / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, part = _split(key)
        pairs.setdefault(module, {})[part] = t
    modules = dict(model.named_modules())
    adapter = Adapter(name=name, path=path, rank=rank, scaling=scaling)
    for module, ab in sorted(pairs.items()):
        layer = modules.get(module)
        if not isinstance(layer, torch.nn.Linear):
            raise RequestError(f"LoRA adapter {name}: {module} is not a linear layer of the model")
        a, b = ab.get("A"), ab.get("B")
        out_features, in_features = layer.weight.shape
        if a is None or b is None or a.shape != (rank, in_features) or b.shape != (out_features, rank):
            shapes = {k: list(v.shape) for k, v in ab.items()}
            raise RequestError(
                f"LoRA adapter {name}: {module} needs lora_A [{rank}, {in_features}] and lora_B "
                f"[{out_features}, {rank}], got {shapes}"
            )
        delta = (b.float() @ a.float()) * scaling
        adapter.deltas[f"{module}.weight"] = delta.to(layer.weight.dtype)
    return adapter


def forward(model: torch.nn.Module, adapter: Adapter | None, **kwargs: Any) -> Any:
    """`model(**kwargs)`, with `adapter`'s weights in place of the base ones when given."""
    if adapter is None:
        return model(**kwargs)
    return torch.func.functional_call(model, adapter.params(model), args=(), kwargs=kwargs)
