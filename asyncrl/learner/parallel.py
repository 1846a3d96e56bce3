"""Where the learner's model lives and how it is split: device, mixed precision, FSDP2.

Place in the data flow: every learner rank (`service.py` for rank 0, `ranks.py` for the others,
or each process `torchrun` starts) loads the model, wraps it in `PolicyLM` and calls
`parallelize` once, before the optimizer exists. From then on the trainer runs forwards and
backwards on it and never asks how it is split; only three things differ:

* the step's gradient is already reduced over the ranks when the backward returns (FSDP2's
  reduce-scatter or all-reduce), so the trainer all-reduces only its scalar sums;
* `iter_full_state` gathers full tensors (a collective: every rank calls it, in the same order);
* checkpoints are written by every rank (`checkpoint.py`, torch.distributed.checkpoint).

One code path for every layout. `fully_shard` runs over a device mesh whose shape says it:

    learner.sharding   mesh                        parameters, gradients, optimizer state
    "fsdp"             (R,)     shard              1/R per rank (reduce-scatter per backward)
    "none"             (R, 1)   replicate x shard  full on every rank (all-reduce per backward)

with one unit per transformer block and one at the root (embedding, final norm, LM head: the
root's forward is `PolicyLM.forward`). Mixed precision is FSDP2's `MixedPrecisionPolicy`: the
forward and backward run in bf16/fp16, the sharded master weights, optimizer state and the
gradient reduction stay float32. A single plain rank in float32 (the default CPU job) is not
wrapped at all: it keeps per-trajectory gradient streaming, which needs the unreduced gradient
of one trajectory (`rl_work.py`).
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from asyncrl.config_sections import LearnerConfig

COMPUTE_DTYPES = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str, *, local_rank: int = 0) -> torch.device:
    """The learner's device: "cpu", "cuda" (this rank's GPU) or "auto" (cuda when one is visible)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("learner.device = 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def is_wrapped(lrn: LearnerConfig) -> bool:
    """Whether the learner's model goes through `fully_shard` (anything but one plain fp32 rank)."""
    return lrn.world_size > 1 or lrn.sharding == "fsdp" or lrn.mixed_precision != "none"


def serving_dtype(lrn: LearnerConfig) -> torch.dtype:
    """The dtype weights are published in (`LearnerConfig.publish_dtype`)."""
    return getattr(torch, lrn.publish_dtype)


def init_single_rank_group(device: torch.device, timeout_s: float) -> None:
    """A process group of one (FSDP2 wants a mesh even when there is nothing to split)."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(device),
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )


def transformer_blocks(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's repeated blocks (`model.layers` in Llama/Qwen/Mistral layouts)."""
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    lists = [m for m in decoder.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"cannot find the transformer blocks of {type(lm).__name__} to shard")
    return list(max(lists, key=len))


def parallelize(
    policy: torch.nn.Module,
    *,
    world_size: int,
    sharding: str,
    mixed_precision: str,
    cpu_offload: bool,
    activation_checkpointing: bool,
    device: torch.device,
) -> torch.nn.Module:
    """Apply FSDP2 to `policy` (a `PolicyLM`) in place over all `world_size` ranks; returns it.

    Needs the default process group (every rank calls this, in the same order). Parameters are
    float32 on `device` (or in host memory with `cpu_offload`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    if dist.get_world_size() != world_size:
        raise RuntimeError(
            f"process group has {dist.get_world_size()} ranks, learner.world_size = {world_size}"
        )
    if activation_checkpointing:
        lm = policy.lm
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.to(device=device, dtype=torch.float32)
    if sharding == "fsdp":
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("replicate", "shard"))
    compute = COMPUTE_DTYPES[mixed_precision]
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if cpu_offload and device.type == "cuda" else OffloadPolicy(),
    }
    _shard_units(policy, kwargs)
    policy.fsdp_kwargs = kwargs  # what `sharded_copy` shards a copy of the weights with
    return policy


def _shard_units(policy: torch.nn.Module, kwargs: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    units = [*transformer_blocks(policy.lm), policy]
    for unit in units:
        fully_shard(unit, **kwargs)
    for unit in units:
        # The trainer divides by the step's global unit count Z itself: reduce by summing.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)


def sharded_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of a `parallelize`d `PolicyLM`, sharded like it (the same mesh, units and
    precision), holding the same weights: each rank copies its own shards, nothing is gathered.
    What the weight copies (EWMA, version snapshots, the KL reference) run their forwards on; FSDP2
    modules cannot be deep-copied. The copy is built on the meta device, so no full model ever
    exists on a rank. Hugging Face models only (built again from their config): a LoRA (peft)
    model has no such constructor, and the config refuses copies with LoRA on several ranks."""
    from transformers import AutoModelForCausalLM

    src = policy.lm
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(src.config, torch_dtype=torch.float32)
    copy = type(policy)(lm, chunk_size=policy.chunk_size, share_prefixes=policy.share_prefixes)
    _shard_units(copy, policy.fsdp_kwargs)
    device = next(policy.parameters()).device
    copy.to_empty(device=device)
    with torch.no_grad():
        buffers = dict(src.named_buffers())  # not in the state dict (rotary frequencies): as they are
        for name, buf in lm.named_buffers():
            buf.copy_(buffers[name])
        load_local(copy.lm, src.state_dict())
    return copy.eval().requires_grad_(False)


def load_local(lm: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (tensors sharded like `lm`'s, e.g. another sharded model's state dict, an
    EWMA or a snapshot of one) into `lm`'s parameters, shard by shard: no collective."""
    own = lm.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"state lacks {missing[:3]}")
    with torch.no_grad():
        for name, t in own.items():
            local(t).copy_(local(state[name]))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly sharded) tensor, as a plain tensor (a view)."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter: an all-gather for a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_full_state(lm: torch.nn.Module, dtype: torch.dtype | None = None):
    """(name, full CPU tensor in `dtype`) for every entry of `lm.state_dict()`, gathered one at a
    time: a collective on a sharded model, so every rank iterates it to the end, in step."""
    done: dict[int, torch.Tensor] = {}  # tied weights (an LM head sharing the embedding): one gather
    for name, t in lm.state_dict(keep_vars=True).items():
        if id(t) in done:
            yield name, done[id(t)]
            continue
        full = full_tensor(t.detach())
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        done[id(t)] = full = full.cpu()
        yield name, full


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
