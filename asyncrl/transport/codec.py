"""msgspec encoding of messages, with tensors as separate zero-copy frames.

A multipart message is `[header, tensor_0, tensor_1, ...]`: the header is the msgpack encoding of
one Struct from `asyncrl.messages`; each `TensorRef` inside it names a following frame, its dtype
and its shape. Decoding validates everything (type tag, frame count, dtype allow-list, byte sizes)
and raises `MalformedFrame` on any mismatch: receivers count and drop such messages, never crash,
and nothing is ever unpickled.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from asyncrl.messages import Message, TensorRef

# Tensors we put on the wire; anything else in a header is rejected.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
# A header larger than this is not one of ours (prompts are token lists; tensors travel apart).
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_FRAMES = 64
_ITEMSIZE: dict[str, int] = {name: torch.empty((), dtype=d).element_size() for name, d in DTYPES.items()}

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


def tensor_ref(frame: int, tensor: torch.Tensor) -> TensorRef:
    return TensorRef(frame=frame, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor without copying (a contiguous copy only if it is strided)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def encode(msg: Any, tensors: Sequence[torch.Tensor] = ()) -> list[Any]:
    """Frames for `zmq.Socket.send_multipart(frames, copy=False)`."""
    return [_encoder.encode(msg), *(tensor_buffer(t) for t in tensors)]


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
    refs = [getattr(msg, f) for f in msg.__struct_fields__ if isinstance(getattr(msg, f), TensorRef)]
    if len(refs) != len(frames) - 1:
        raise MalformedFrame(
            f"{type(msg).__name__} names {len(refs)} tensor frames but {len(frames) - 1} came"
        )
    tensors: list[torch.Tensor] = [torch.empty(0)] * len(refs)
    seen = set()
    for ref in refs:
        if not 0 <= ref.frame < len(refs) or ref.frame in seen:
            raise MalformedFrame(f"tensor frame index {ref.frame} out of range or repeated")
        seen.add(ref.frame)
        tensors[ref.frame] = _tensor_from(ref, frames[1 + ref.frame])
    return msg, tensors


def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    return memoryview(buf)


def _tensor_from(ref: TensorRef, frame: Any) -> torch.Tensor:
    dtype = DTYPES.get(ref.dtype)
    if dtype is None:
        raise MalformedFrame(f"tensor dtype {ref.dtype!r} is not allowed (allowed: {', '.join(DTYPES)})")
    if any(d < 0 for d in ref.shape):
        raise MalformedFrame(f"negative tensor shape {ref.shape}")
    numel = math.prod(ref.shape)
    buf = _as_buffer(frame)
    itemsize = _ITEMSIZE[ref.dtype]
    if len(buf) != numel * itemsize:
        raise MalformedFrame(
            f"tensor frame has {len(buf)} bytes, {ref.dtype}{list(ref.shape)} needs {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(ref.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(ref.shape)
