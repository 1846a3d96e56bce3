"""Wire codec: message round-trips with tensor frames, and rejection of malformed input."""

from __future__ import annotations

import array

import msgspec
import pytest
import torch

from asyncrl.messages import PromptTask, SamplingParams, TensorRef, Trajectory, WeightsLoaded
from asyncrl.transport.codec import (
    MAX_FRAMES,
    PACK_MAX_BYTES,
    MalformedFrame,
    batch_trajectories,
    decode,
    encode,
    split_trajectories,
    tensor_buffer,
    tensor_ref,
)


def _trajectory(ids, logps, versions):
    return Trajectory(
        traj_id=5,
        group_id=1,
        task_id=1,
        sample_index=1,
        window=0,
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
            window=0,
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


# ----------------------------------------------------------------------------- Trajectories
def _item(traj_id: int, length: int, *, mask: bool = False):
    """A Trajectory of `length` tokens and its frames (three, or four with a loss mask)."""
    ids = torch.arange(length, dtype=torch.int64) + traj_id
    logps = -torch.rand(length)
    versions = torch.full((length,), traj_id, dtype=torch.int64)
    tensors = [ids, logps, versions]
    msg = msgspec.structs.replace(
        _trajectory(ids, logps, versions), traj_id=traj_id, sample_index=traj_id % 4
    )
    if mask:
        loss_mask = torch.arange(length) % 2 == 0
        msg = msgspec.structs.replace(msg, loss_mask=tensor_ref(3, loss_mask))
        tensors.append(loss_mask)
    return msg, tensors


@pytest.mark.parametrize("length", [3, PACK_MAX_BYTES // 16], ids=["packed", "a-frame-each"])
def test_trajectories_round_trip_each_item_with_its_own_frames(length):
    pairs = [_item(0, length), _item(1, length + 1, mask=True), _item(2, 1)]
    [(msg, tensors)] = batch_trajectories(pairs)
    frames = _to_bytes(encode(msg, tensors))
    assert len(frames) == (2 if length == 3 else 1 + 10)
    got, flat = decode(frames)
    assert got == msg
    out = split_trajectories(got, flat)
    assert [m for m, _ in out] == [m for m, _ in pairs]
    for (_, sent), (_, received) in zip(pairs, out, strict=True):
        assert len(received) == len(sent)
        assert all(torch.equal(a, b) for a, b in zip(sent, received, strict=True))


def test_a_lone_trajectory_splits_into_itself():
    msg, tensors = _item(7, 4)
    got, flat = decode(_to_bytes(encode(msg, tensors)))
    [(item, frames)] = split_trajectories(got, flat)
    assert item == msg and all(torch.equal(a, b) for a, b in zip(tensors, frames, strict=True))


def test_trajectories_split_into_messages_below_the_frame_limit():
    small = [_item(k, 2) for k in range(30)]
    [(msg, tensors)] = batch_trajectories(small)  # 90 tensors, but they pack into one frame
    assert len(msg.items) == 30 and len(encode(msg, tensors)) == 2
    per_message = (MAX_FRAMES - 1) // 3
    # 20 bytes per token: eight of these fill PACK_MAX_BYTES, so the messages travel unpacked.
    large = [_item(k, PACK_MAX_BYTES // 160) for k in range(2 * per_message + 1)]
    batches = batch_trajectories(large)
    assert [len(m.items) for m, _ in batches] == [per_message, per_message, 1]
    assert all(len(encode(m, t)) <= MAX_FRAMES for m, t in batches)
    got = [
        item.traj_id for m, t in batches for item, _ in split_trajectories(*decode(_to_bytes(encode(m, t))))
    ]
    assert got == list(range(len(large)))


def test_trajectories_with_a_bad_item_are_rejected_whole():
    (m0, t0), (m1, t1) = _item(0, 3), _item(1, 3)
    bad = msgspec.structs.replace(m1, token_versions=TensorRef(frame=5, dtype="int64", shape=(3,)))
    [(msg, tensors)] = batch_trajectories([(m0, t0), (bad, t1)])
    with pytest.raises(MalformedFrame, match="out of range or repeated"):
        decode(_to_bytes(encode(msg, tensors)))
    [(msg, tensors)] = batch_trajectories([(m0, t0), (m1, t1)])
    frames = _to_bytes(encode(msg, tensors))
    with pytest.raises(MalformedFrame, match="Trajectories's tensors need"):
        decode([frames[0], frames[1][:-8]])  # the second item's last frame cut short


def test_arrays_travel_as_tensors():
    ids, logps = array.array("q", [4, 5, 2]), array.array("f", [-0.5, -1.25, -0.01])
    versions = array.array("q", [3, 3, 4])
    msg = _trajectory(torch.tensor(ids), torch.tensor(logps), torch.tensor(versions))
    assert _trajectory(ids, logps, versions) == msg  # the same refs as from tensors
    as_arrays = _to_bytes(encode(msg, [ids, logps, versions]))
    assert as_arrays == _to_bytes(
        encode(msg, [torch.tensor(ids), torch.tensor(logps), torch.tensor(versions)])
    )
    _, tensors = decode(as_arrays)
    assert tensors[0].tolist() == [4, 5, 2] and tensors[1].dtype == torch.float32
    assert torch.equal(tensors[1], torch.tensor([-0.5, -1.25, -0.01]))
    with pytest.raises(ValueError, match="type code 'i' cannot travel"):
        encode(msg, [array.array("i", [4, 5, 2]), logps, versions])
