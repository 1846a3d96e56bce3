"""LoRA RL (peft): the learner trains low-rank adapters; the generators get merged weights or the adapter.

Place in the data flow: `learner/loop.py: load_policy_model` wraps the Hugging Face model with
`apply_lora` when `learner.lora.rank > 0`, so the trainer's parameters (those that require grad) are
the adapters' A and B only: gradients, optimizer state, streaming accumulators and the data-parallel
all-reduce shrink to the adapters' size. After each step the learner service publishes either

* `serving_state(model)` (`learner.lora.publish = "merged"`): W + (alpha / r) B A under the base
  model's own names and shapes, a normal checkpoint every generator loads as it loads full weights
  (shards or broadcast); or
* `adapter_state(model)` with `adapter_config(model)` (`"adapter"`): the adapter alone, written by
  `transport.publisher.AdapterPublisher` as a PEFT adapter directory that SGLang servers load with
  `/load_lora_adapter` (docs/weights.md, "LoRA").

`serving_state` never merges in place (peft's `merge_and_unload` would change the model being
trained): each adapted weight is computed afresh from the frozen base weight and the adapter.
`save_merged` writes the same merged weights as a plain Hugging Face model (the run's final_model).

The wrapped model is a `peft.PeftModel`; `get_decoder()`, `get_output_embeddings()`, `config` and
forward pass through to the Hugging Face model, whose layers peft has replaced by LoRA layers in
place, so `PolicyLM(model)` and `causal_lm_logprobs(model, ...)` run the adapted model unchanged.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from asyncrl.config_sections import LoraConfig

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "adapter_config",
    "adapter_state",
    "apply_lora",
    "base_model",
    "default_target_modules",
    "is_lora",
    "save_merged",
    "serving_state",
]

# The file names of a PEFT adapter directory (what `PeftModel.from_pretrained` and SGLang read).
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def default_target_modules(model: torch.nn.Module) -> list[str]:
    """The short names of every linear layer inside the decoder (attention and MLP blocks), sorted.

    The output embedding (lm_head) lies outside the decoder and is never adapted by default.
    """
    decoder = model.get_decoder()
    names = {
        name.rsplit(".", 1)[-1] for name, mod in decoder.named_modules() if isinstance(mod, torch.nn.Linear)
    }
    if not names:
        raise ValueError(
            f"learner.lora: the decoder of {type(model).__name__} has no nn.Linear layers to adapt; "
            "name them in learner.lora.target_modules"
        )
    return sorted(names)


def _check_targets(model: torch.nn.Module, names: list[str]) -> None:
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    full = {name for name, _ in model.named_modules()}
    missing = [n for n in names if n not in leaves and n not in full]
    if missing:
        raise ValueError(
            f"learner.lora.target_modules names {missing}, which {type(model).__name__} does not have; "
            f"its linear layers are {default_target_modules(model)}"
        )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, *, seed: int) -> torch.nn.Module:
    """Wrap `model` (a Hugging Face causal LM) with LoRA adapters as `cfg` (config.LoraConfig) says.

    Only the adapters require grad afterwards. A is initialised from `seed` (B is zero, so the
    wrapped model computes exactly what `model` did): every learner rank gets the same adapters,
    and the global RNG is left as it was. Returns the `peft.PeftModel`.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if cfg.rank <= 0:
        raise ValueError(f"learner.lora.rank must be > 0 to apply LoRA, got {cfg.rank}")
    targets = list(cfg.target_modules) or default_target_modules(model)
    _check_targets(model, targets)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # peft initialises the adapters on the CPU (then moves them next to their base layer).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, peft_cfg)
    for name, p in wrapped.named_parameters():
        assert p.requires_grad == ("lora_" in name), f"{name}: requires_grad={p.requires_grad}"
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` was wrapped by `apply_lora`."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside (its adapted layers are peft's LoRA layers); `model` itself if
    it is not wrapped."""
    return model.get_base_model() if is_lora(model) else model


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name (in the Hugging Face model) -> peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {name: mod for name, mod in base_model(model).named_modules() if isinstance(mod, LoraLayer)}


def _split_key(key: str, layers: Mapping[str, torch.nn.Module]) -> tuple[str, str] | None:
    """(LoRA layer name, the rest of the key) when `key` lies inside a LoRA layer, else None."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix, ".".join(parts[i:])
    return None


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an FSDP2-wrapped model's (learner.world_size > 1, or mixed precision) are
    DTensors, gathered here (a collective: every rank computes the same states in step)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = _full(t)
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _delta(layer: torch.nn.Module, adapter: str) -> torch.Tensor:
    """(alpha / r) B A of one adapter of one LoRA layer, in float32, in the base weight's layout."""
    if adapter in layer.lora_A:  # nn.Linear (and Conv1D with fan_in_fan_out)
        a, b = _full(layer.lora_A[adapter].weight), _full(layer.lora_B[adapter].weight)
        delta = b.float() @ a.float()
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
    elif adapter in layer.lora_embedding_A:  # nn.Embedding: the weight is [vocab, dim]
        a, b = _full(layer.lora_embedding_A[adapter]), _full(layer.lora_embedding_B[adapter])
        delta = (b.float() @ a.float()).T
    else:
        raise ValueError(f"{type(layer).__name__}: no LoRA weights for adapter {adapter!r}")
    return delta * layer.scaling[adapter]


@torch.no_grad()
def serving_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """What a generator serves: the merged weights, under the base model's names and shapes.

    Each adapted weight is W + (alpha / r) B A, computed in float32 from the frozen W and the current
    adapter into a new tensor (the model is not modified); every other tensor is the model's own
    (detached, not copied unless `dtype` casts it or it is gathered from a DTensor). Floating
    tensors are cast to `dtype` if given. A model without adapters gives its plain state dict.
    Supported LoRA layers: linear (the default targets) and embedding.
    """
    base = base_model(model)
    layers = _lora_layers(model) if is_lora(model) else {}
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}  # tied weights (an LM head sharing the embedding): cast once
    for key, t in base.state_dict(keep_vars=True).items():
        split = _split_key(key, layers)
        if split is None:
            if id(t) not in done:
                done[id(t)] = _cast(t, dtype)
            out[key] = done[id(t)]
            continue
        layer_name, rest = split
        if not rest.startswith("base_layer."):
            continue  # lora_A / lora_B / ...: folded into the weight below
        param = rest.removeprefix("base_layer.")
        name = f"{layer_name}.{param}"
        layer = layers[layer_name]
        if param != "weight":
            out[name] = _cast(t, dtype)
            continue
        assert not layer.merged, f"{layer_name}: adapters merged in place; serving_state expects them apart"
        merged = _full(t).float()
        for adapter in layer.active_adapters:
            merged = merged + _delta(layer, adapter)
        out[name] = merged.to(dtype or t.dtype)
    return out


@torch.no_grad()
def adapter_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's file names (`base_model.model.<module>.lora_A.weight`, ...),
    as `adapter_model.safetensors` stores them; detached, cast to `dtype` if given."""
    from peft import get_peft_model_state_dict

    if not is_lora(model):
        raise ValueError("adapter_state needs a model wrapped by apply_lora (learner.lora.rank > 0)")
    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    return {k: _cast(v.detach(), dtype) for k, v in state.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The content of the adapter's `adapter_config.json` (JSON-ready), as `PeftModel.save_pretrained`
    writes it: rank `r`, `lora_alpha`, `target_modules` (sorted), `base_model_name_or_path`, ..."""
    if not is_lora(model):
        raise ValueError("adapter_config needs a model wrapped by apply_lora (learner.lora.rank > 0)")
    cfg = _jsonable(model.peft_config[model.active_adapter].to_dict())
    cfg["inference_mode"] = True  # what a saved adapter says: it is served, not trained further
    json.dumps(cfg)  # fails here, not in the publisher, if peft adds a field JSON cannot hold
    return cfg


def save_merged(model: torch.nn.Module, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    """Write the merged model (`serving_state`) as a plain Hugging Face model directory: config,
    generation config and safetensors weights, loadable with `from_pretrained` without peft."""
    base = base_model(model)
    base.save_pretrained(Path(out_dir), state_dict=serving_state(model, dtype), safe_serialization=True)
