"""msgspec encoding of messages, with tensors as raw frames after the header.

A multipart message is `[header, tensor_0, tensor_1, ...]`, or, when its tensors are small,
`[header, tensor_0 + tensor_1 + ...]`: their bytes back to back in one frame, each padded to a
multiple of 8 bytes. The header is the msgpack encoding of one Struct from `asyncrl.messages`;
each `TensorRef` inside it names a tensor by index, its dtype and its shape, which fix its byte
size and so its place in a packed frame. Packing is for speed: one frame instead of three costs
ZeroMQ about a third as much per trajectory (bench/README.md, "Pipeline"); large tensors keep a
frame each and travel without a copy. Decoding validates everything (type tag, frame count,
dtype allow-list, byte sizes) and raises `MalformedFrame` on any mismatch: receivers count and
drop such messages, never crash, and nothing is ever unpickled.

A `Trajectories` message carries several trajectories: its frames are each item's frames in turn
(`batch_trajectories` builds it, `split_trajectories` hands each item its own tensors back). A
generator builds each item with `trajectory_frames`, from a rollout and its task.
"""

from __future__ import annotations

import array
import functools
import math
import typing
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from asyncrl.messages import Message, PromptTask, TensorRef, Trajectories, Trajectory

if TYPE_CHECKING:
    import torch

# Tensors we put on the wire (name -> bytes per element); anything else in a header is rejected.
# By name, so that a process that only exchanges control messages (the launcher) never loads
# torch: it is imported where a tensor is made or read.
DTYPES: dict[str, int] = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "uint8": 1,
    "bool": 1,
}
# A header larger than this is not one of ours (prompts are token lists; tensors travel apart).
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_FRAMES = 64
# Tensors totalling at most this many bytes travel packed in one frame (one copy, fewer frames).
PACK_MAX_BYTES = 1 << 20
# Each packed tensor starts at a multiple of this (any dtype's size), so views of it are aligned.
PACK_ALIGN = 8
_PADDING = [bytes(n) for n in range(PACK_ALIGN)]
# array.array type codes that may travel as tensors (1-D): a sender holding Python lists skips
# torch on its side, which costs about ten times as much per short list.
ARRAY_DTYPES: dict[str, str] = {"q": "int64", "d": "float64", "f": "float32"}

# Received frames are read-only buffers that `_tensor_from` wraps without copying (callers treat
# the tensors as read-only); torch warns about that on every wrap. One filter, scoped to this
# module and that message, instead of a catch_warnings block per tensor (a third of decode's time).
warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning, module=__name__
)


class MalformedFrame(ValueError):
    """A received multipart message that is not a valid asyncrl message."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_ref(frame: int, tensor: torch.Tensor | array.array) -> TensorRef:
    if isinstance(tensor, array.array):
        return TensorRef(frame=frame, dtype=_array_dtype(tensor), shape=(len(tensor),))
    return TensorRef(frame=frame, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


def tensor_buffer(tensor: torch.Tensor | array.array) -> memoryview:
    """The bytes of a CPU tensor without copying (a contiguous copy only if it is strided), or of
    an array of a code in ARRAY_DTYPES."""
    if isinstance(tensor, array.array):
        _array_dtype(tensor)
        return memoryview(tensor).cast("B")
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.ndim != 1:
        t = t.reshape(-1)
    import torch

    return memoryview(t.view(torch.uint8).numpy())  # via uint8: numpy has no bfloat16


def encode(msg: Any, tensors: Sequence[torch.Tensor | array.array] = ()) -> list[Any]:
    """Frames for `zmq.Socket.send_multipart(frames, copy=False)`: the header, then the tensors'
    bytes, packed into one frame when there are several and they total <= PACK_MAX_BYTES.
    A 1-D `array.array` of a code in ARRAY_DTYPES may stand in for a tensor (it arrives as one)."""
    buffers = [tensor_buffer(t) for t in tensors]
    if len(buffers) > 1 and sum(b.nbytes for b in buffers) <= PACK_MAX_BYTES:
        padded = []
        for b in buffers:
            padded += [b, _PADDING[-b.nbytes % PACK_ALIGN]]
        return [_encoder.encode(msg), b"".join(padded)]
    return [_encoder.encode(msg), *buffers]


def decode(frames: Sequence[Any]) -> tuple[Any, list[torch.Tensor]]:
    """Inverse of `encode`. Frames may be bytes or zmq.Frame. Raises MalformedFrame."""
    if not frames:
        raise MalformedFrame("empty multipart message")
    if len(frames) > MAX_FRAMES:
        raise MalformedFrame(f"{len(frames)} frames (at most {MAX_FRAMES})")
    header = _as_buffer(frames[0])
    if len(header) > MAX_HEADER_BYTES:
        raise MalformedFrame(f"header of {len(header)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        msg = _decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedFrame(f"undecodable header: {exc}") from None
    layout = _frame_layout(msg)
    packed = len(layout) > 1 and len(frames) == 2
    if len(layout) != len(frames) - 1 and not packed:
        raise MalformedFrame(
            f"{type(msg).__name__} names {len(layout)} tensor frames but {len(frames) - 1} came"
        )
    sizes = [_nbytes(ref) for ref in layout]
    if not packed:
        return msg, [
            _tensor_from(ref, _as_buffer(frames[1 + i]), size)
            for i, (ref, size) in enumerate(zip(layout, sizes, strict=True))
        ]
    blob = _as_buffer(frames[1])
    need = sum(n + (-n % PACK_ALIGN) for n in sizes)
    if need != len(blob):
        raise MalformedFrame(
            f"packed tensor frame has {len(blob)} bytes, {type(msg).__name__}'s tensors need {need}"
        )
    tensors, start = [], 0
    for ref, size in zip(layout, sizes, strict=True):
        tensors.append(_tensor_from(ref, blob[start : start + size], size))
        start += size + (-size % PACK_ALIGN)
    return msg, tensors


class RolloutFields(Protocol):
    """What `trajectory_frames` reads from one sampled completion (`generators.base.Rollout`)."""

    sample_index: int
    completion_ids: Sequence[int]
    behavior_logprobs: Sequence[float]
    token_versions: Sequence[int]
    reward: float
    finish_reason: str
    loss_mask: Sequence[bool] | None
    opd_ids: Sequence[Sequence[int]] | None
    opd_behavior_logprobs: Sequence[Sequence[float]] | None
    teacher_logprobs: Sequence[Sequence[float]] | None
    teacher_version: int | None


def _opd_frames(
    task: PromptTask, r: RolloutFields, generator_id: str, ids: torch.Tensor, num_opd_samples: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(teacher_logprobs, opd_ids, opd_behavior_logprobs), each [T, N], checked against the rollout."""
    import torch

    where = f"generator {generator_id}: rollout of task {task.task_id}"
    if r.teacher_logprobs is None or r.opd_ids is None or r.opd_behavior_logprobs is None:
        raise ValueError(
            f"{where} lacks teacher_logprobs / opd_ids / opd_behavior_logprobs, which opd.enabled "
            "needs; the generator plugin must score its rollouts with the teacher"
        )
    shape = (len(ids), num_opd_samples)
    teacher = torch.tensor(r.teacher_logprobs, dtype=torch.float32)
    opd_ids = torch.tensor(r.opd_ids, dtype=torch.int64)
    opd_logps = torch.tensor(r.opd_behavior_logprobs, dtype=torch.float32)
    for name, t in (
        ("teacher_logprobs", teacher),
        ("opd_ids", opd_ids),
        ("opd_behavior_logprobs", opd_logps),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {list(t.shape)}, expected [T, N] = {list(shape)}")
    if not torch.equal(opd_ids[:, 0], ids):
        raise ValueError(f"{where}: opd_ids[:, 0] must be the generated tokens")
    return teacher, opd_ids, opd_logps


def _top_k_frames(r: RolloutFields, *, where: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The teacher's top-K ids and log-probs ([T, K] each), when the rollout has them."""
    import torch

    top_ids = getattr(r, "teacher_top_ids", None)
    top_logps = getattr(r, "teacher_top_logprobs", None)
    if top_ids is None and top_logps is None:
        return None
    ids = torch.tensor(top_ids or [], dtype=torch.int64)
    logps = torch.tensor(top_logps or [], dtype=torch.float32)
    if ids.ndim != 2 or ids.shape != logps.shape or ids.shape[0] != len(r.completion_ids):
        raise ValueError(
            f"{where}: teacher_top_ids {list(ids.shape)} and teacher_top_logprobs {list(logps.shape)} "
            f"must both be [T, K] with T = {len(r.completion_ids)}"
        )
    return ids, logps


def _wire_array(values: Sequence[Any], code: str, dtype: torch.dtype) -> array.array | torch.Tensor:
    """A flat list as it goes on the wire: an `array.array` (`encode` sends its bytes; a tenth
    of the cost of a tensor for a short list), or a tensor when the values are not plain numbers
    of that kind (torch converts them, or names the problem)."""
    import torch

    try:
        return array.array(code, values)
    except (TypeError, OverflowError):
        return torch.tensor(values, dtype=dtype)


def trajectory_frames(
    task: PromptTask,
    r: RolloutFields,
    generator_id: str,
    generate_s: float,
    *,
    num_opd_samples: int = 0,
) -> tuple[Trajectory, tuple[torch.Tensor | array.array, ...]]:
    """The Trajectory message for one rollout of `task` and its tensor frames: three (ids,
    behavior log-probs, versions), three more when `num_opd_samples` (opd.num_samples, with
    opd.enabled) is > 0, and the loss mask when the rollout masks any token out."""
    import torch

    ids = _wire_array(r.completion_ids, "q", torch.int64)
    logps = _wire_array(r.behavior_logprobs, "f", torch.float32)
    versions = _wire_array(r.token_versions, "q", torch.int64)
    if not (len(ids) == len(logps) == len(versions)):
        raise ValueError(
            f"generator {generator_id}: rollout of task {task.task_id} has {len(ids)} tokens, "
            f"{len(logps)} log-probs and {len(versions)} versions; they must match"
        )
    tensors: tuple[torch.Tensor | array.array, ...] = (ids, logps, versions)
    opd_refs = {}
    if num_opd_samples > 0:
        ids_T = torch.as_tensor(r.completion_ids, dtype=torch.int64)
        teacher, opd_ids, opd_logps = _opd_frames(task, r, generator_id, ids_T, num_opd_samples)
        tensors += (teacher, opd_ids, opd_logps)
        opd_refs = {
            "teacher_logprobs": tensor_ref(3, teacher),
            "opd_ids": tensor_ref(4, opd_ids),
            "opd_behavior_logprobs": tensor_ref(5, opd_logps),
        }
        top = _top_k_frames(r, where=f"generator {generator_id}: rollout of task {task.task_id}")
        if top is not None:
            tensors += top
            opd_refs |= {
                "teacher_top_ids": tensor_ref(6, top[0]),
                "teacher_top_logprobs": tensor_ref(7, top[1]),
            }
    mask_ref = {}
    if r.loss_mask is not None and not all(r.loss_mask):
        mask = torch.tensor(r.loss_mask, dtype=torch.bool)
        if len(mask) != len(ids):
            raise ValueError(
                f"generator {generator_id}: rollout of task {task.task_id} has {len(ids)} tokens and a "
                f"loss_mask of {len(mask)}; they must match"
            )
        mask_ref = {"loss_mask": tensor_ref(len(tensors), mask)}
        tensors += (mask,)
    msg = Trajectory(
        traj_id=task.traj_id(r.sample_index),
        group_id=task.group_id,
        task_id=task.task_id,
        sample_index=r.sample_index,
        window=task.window,
        num_samples=task.num_samples,
        prompt_ids=list(task.prompt_ids),
        completion_ids=tensor_ref(0, ids),
        behavior_logprobs=tensor_ref(1, logps),
        token_versions=tensor_ref(2, versions),
        reward=r.reward,
        finish_reason=r.finish_reason if r.finish_reason in ("stop", "length", "abort") else "stop",
        generator_id=generator_id,
        generate_s=generate_s,
        teacher_version=r.teacher_version if num_opd_samples > 0 else None,
        teacher_id=getattr(r, "teacher_id", "") if num_opd_samples > 0 else "",
        reward_parts=list(r.reward_parts or ()),
        guided_prefix=r.guided_prefix,
        **opd_refs,
        **mask_ref,
    )
    return msg, tensors


def batch_trajectories(
    pairs: Sequence[tuple[Trajectory, Sequence[torch.Tensor | array.array]]],
) -> list[tuple[Trajectories, list[torch.Tensor | array.array]]]:
    """Trajectories and their tensor frames -> `Trajectories` messages with the frames in item
    order: one message, or several so that each either packs into one frame (`encode`) or has
    at most MAX_FRAMES frames."""
    out: list[tuple[list[Trajectory], list[torch.Tensor | array.array], int]] = []
    for msg, tensors in pairs:
        nbytes = sum(_size(t) for t in tensors)
        if out:
            items, frames, size = out[-1]
            if len(frames) + len(tensors) <= MAX_FRAMES - 1 or size + nbytes <= PACK_MAX_BYTES:
                items.append(msg)
                frames.extend(tensors)
                out[-1] = (items, frames, size + nbytes)
                continue
        out.append(([msg], list(tensors), nbytes))
    return [(Trajectories(items=items), frames) for items, frames, _ in out]


def _size(tensor: torch.Tensor | array.array) -> int:
    if isinstance(tensor, array.array):
        return len(tensor) * tensor.itemsize
    return tensor.numel() * tensor.element_size()


def split_trajectories(
    msg: Trajectory | Trajectories, tensors: Sequence[torch.Tensor]
) -> list[tuple[Trajectory, list[torch.Tensor]]]:
    """A decoded Trajectory or Trajectories -> (trajectory, its own tensor frames) pairs."""
    if isinstance(msg, Trajectory):
        return [(msg, list(tensors))]
    out, start = [], 0
    for item in msg.items:
        count = sum(getattr(item, f) is not None for f in _ref_fields(Trajectory))
        out.append((item, list(tensors[start : start + count])))
        start += count
    return out


def _frame_layout(msg: Any) -> list[TensorRef]:
    """The TensorRefs of a decoded message in frame order; MalformedFrame unless each struct's
    refs number its frames 0..n-1 exactly once. A Trajectories' items follow one another."""
    if isinstance(msg, Trajectories):
        return [ref for item in msg.items for ref in _own_frames(item)]
    return _own_frames(msg)


def _own_frames(msg: Any) -> list[TensorRef]:
    refs = [ref for f in _ref_fields(type(msg)) if (ref := getattr(msg, f)) is not None]
    by_index: list[TensorRef | None] = [None] * len(refs)
    for ref in refs:
        if not 0 <= ref.frame < len(refs) or by_index[ref.frame] is not None:
            raise MalformedFrame(f"tensor frame index {ref.frame} out of range or repeated")
        by_index[ref.frame] = ref
    return by_index  # type: ignore[return-value]  # every slot filled: len(refs) distinct indices


@functools.cache
def _ref_fields(cls: type) -> tuple[str, ...]:
    """The fields of message type `cls` that may hold a TensorRef (a decoded message's other
    fields cannot: msgspec checked every field against its annotation)."""
    hints = typing.get_type_hints(cls)
    return tuple(f for f in cls.__struct_fields__ if TensorRef in (hints[f], *typing.get_args(hints[f])))


def _array_dtype(values: array.array) -> str:
    dtype = ARRAY_DTYPES.get(values.typecode)
    if dtype is None:
        raise ValueError(
            f"array type code {values.typecode!r} cannot travel (allowed: {', '.join(ARRAY_DTYPES)})"
        )
    return dtype


def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    return memoryview(buf)


def _nbytes(ref: TensorRef) -> int:
    """The byte size `ref` declares; MalformedFrame for a dtype or shape we never send."""
    if ref.dtype not in DTYPES:
        raise MalformedFrame(f"tensor dtype {ref.dtype!r} is not allowed (allowed: {', '.join(DTYPES)})")
    if any(d < 0 for d in ref.shape):
        raise MalformedFrame(f"negative tensor shape {ref.shape}")
    return math.prod(ref.shape) * DTYPES[ref.dtype]


def _tensor_from(ref: TensorRef, buf: memoryview, nbytes: int) -> torch.Tensor:
    """A tensor over `buf` (no copy), which must hold `nbytes`, the size `ref` declares."""
    if len(buf) != nbytes:
        raise MalformedFrame(
            f"tensor frame has {len(buf)} bytes, {ref.dtype}{list(ref.shape)} needs {nbytes}"
        )
    import torch

    dtype = getattr(torch, ref.dtype)
    if nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=dtype)
    return flat if len(ref.shape) == 1 else flat.reshape(ref.shape)
