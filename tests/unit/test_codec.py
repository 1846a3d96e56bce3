"""Wire codec: message round-trips with tensor frames, and rejection of malformed input."""

from __future__ import annotations

import msgspec
import pytest
import torch

from asyncrl.messages import PromptTask, SamplingParams, TensorRef, Trajectory, WeightsLoaded
from asyncrl.transport.codec import (
    PACK_MAX_BYTES,
    MalformedFrame,
    decode,
    encode,
    tensor_buffer,
    tensor_ref,
)


def _trajectory(ids, logps, versions):
    return Trajectory(
        traj_id=5,
        group_id=1,
        task_id=1,
        sample_index=1,
        step=0,
        num_samples=4,
        prompt_ids=[1, 2, 3],
        completion_ids=tensor_ref(0, ids),
        behavior_logprobs=tensor_ref(1, logps),
        token_versions=tensor_ref(2, versions),
        reward=1.0,
        finish_reason="stop",
        generator_id="gen-0",
    )


def _to_bytes(frames):
    return [bytes(f) for f in frames]


def test_round_trip_with_tensors():
    ids = torch.tensor([4, 5, 2], dtype=torch.int64)
    logps = torch.tensor([-0.5, -1.25, -0.01], dtype=torch.float32)
    versions = torch.tensor([3, 3, 4], dtype=torch.int64)
    msg = _trajectory(ids, logps, versions)
    out, tensors = decode(_to_bytes(encode(msg, [ids, logps, versions])))
    assert out == msg
    assert (
        torch.equal(tensors[0], ids) and torch.equal(tensors[1], logps) and torch.equal(tensors[2], versions)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.bool, torch.uint8])
def test_tensor_dtypes_round_trip_bitwise(dtype):
    src = (torch.randn(3, 5) * 10).to(dtype)
    ref = TensorRef(frame=0, dtype=str(dtype).removeprefix("torch."), shape=(3, 5))
    msg = _trajectory(torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    msg = msgspec.structs.replace(
        msg,
        completion_ids=ref,
        behavior_logprobs=TensorRef(frame=1, dtype="float32", shape=(0,)),
        token_versions=TensorRef(frame=2, dtype="int64", shape=(0,)),
    )
    _, tensors = decode(_to_bytes(encode(msg, [src, torch.zeros(0), torch.zeros(0, dtype=torch.int64)])))
    assert tensors[0].dtype == dtype
    assert torch.equal(tensors[0].view(torch.uint8), src.view(torch.uint8))


def test_plain_messages_round_trip():
    for msg in (
        WeightsLoaded(generator_id="g", version=3, load_s=0.5),
        PromptTask(
            task_id=1,
            group_id=1,
            prompt_ids=[1],
            num_samples=2,
            sampling=SamplingParams(),
            dataset_index=1,
            step=0,
            answer="3",
        ),
    ):
        out, tensors = decode(encode(msg))
        assert out == msg and tensors == []


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\x00garbage"],
        [b"\xc1"],
        [msgspec.msgpack.encode({"type": "Nope"})],
        [msgspec.msgpack.encode({"type": "WeightsLoaded", "generator_id": 3, "version": "x"})],
        [msgspec.msgpack.encode({"type": "WeightsLoaded", "generator_id": "g", "version": 1}), b"extra"],
    ],
)
def test_malformed_is_rejected(frames):
    with pytest.raises(MalformedFrame):
        decode(frames)


def test_small_tensors_travel_packed_in_one_aligned_frame():
    # An odd length puts the float32 log-probs at 8*T + 4 unpadded: each tensor must start aligned.
    ids = torch.tensor([4, 5, 2], dtype=torch.int64)
    logps = torch.tensor([-0.5, -1.25, -0.01], dtype=torch.float32)
    versions = torch.tensor([3, 3, 4], dtype=torch.int64)
    frames = _to_bytes(encode(_trajectory(ids, logps, versions), [ids, logps, versions]))
    assert len(frames) == 2 and len(frames[1]) == 24 + 16 + 24
    _, tensors = decode(frames)
    assert (
        torch.equal(tensors[0], ids) and torch.equal(tensors[1], logps) and torch.equal(tensors[2], versions)
    )
    offsets = [t.data_ptr() - tensors[0].data_ptr() for t in tensors]
    assert offsets == [0, 24, 40]


def test_large_tensors_keep_a_frame_each():
    n = PACK_MAX_BYTES // 8 + 1
    ids, versions = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    logps = torch.full((n,), -0.5)
    frames = encode(_trajectory(ids, logps, versions), [ids, logps, versions])
    assert len(frames) == 4
    _, tensors = decode(_to_bytes(frames))
    assert torch.equal(tensors[0], ids) and torch.equal(tensors[1], logps)


def test_tensor_frame_size_mismatch_and_bad_dtype():
    ids = torch.tensor([1, 2, 3])
    msg = _trajectory(ids, torch.zeros(3), torch.zeros(3, dtype=torch.int64))
    frames = _to_bytes(encode(msg, [ids, torch.zeros(3), torch.zeros(3, dtype=torch.int64)]))
    with pytest.raises(MalformedFrame, match="packed tensor frame has 63 bytes"):
        decode([frames[0], frames[1][:-1]])
    one_each = [frames[0], *(bytes(tensor_buffer(t)) for t in (ids, torch.zeros(3), torch.zeros(3).long()))]
    decode(one_each)  # the unpacked layout of the same message is fine too
    with pytest.raises(MalformedFrame, match="bytes"):
        decode([one_each[0], one_each[1][:-1], one_each[2], one_each[3]])
    with pytest.raises(MalformedFrame, match="names 3 tensor frames but 2 came"):
        decode(one_each[:3])
    bad = msgspec.structs.replace(msg, completion_ids=TensorRef(frame=0, dtype="object", shape=(3,)))
    with pytest.raises(MalformedFrame, match="not allowed"):
        decode(_to_bytes(encode(bad, [ids, torch.zeros(3), torch.zeros(3, dtype=torch.int64)])))
    dup = msgspec.structs.replace(msg, behavior_logprobs=TensorRef(frame=0, dtype="float32", shape=(3,)))
    decode(frames)  # the untouched message is fine
    with pytest.raises(MalformedFrame, match="out of range or repeated"):
        decode(_to_bytes(encode(dup, [ids, torch.zeros(3), torch.zeros(3, dtype=torch.int64)])))
