"""Retention of published weight versions (asyncrl.transport.retention): never delete one in use."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncrl.transport.retention import (
    VersionRetention,
    list_versions,
    prune,
    spare_dirs,
    version_dir,
)


def published(keep_last: int, versions: list[int]) -> VersionRetention:
    r = VersionRetention(keep_last=keep_last)
    for v in versions:
        r.publish(v)
    return r


def test_without_generators_all_but_the_last_k_are_deletable() -> None:
    assert published(2, [1, 2, 3, 4, 5]).deletable() == [1, 2, 3]
    assert published(5, [1, 2, 3]).deletable() == []
    assert published(1, []).deletable() == []


def test_a_lagging_generator_pins_its_version_and_everything_newer() -> None:
    r = published(2, [1, 2, 3, 4, 5, 6])
    r.ack("gen-a", 6)
    r.ack("gen-b", 2)
    assert r.deletable() == [1]
    r.ack("gen-b", 6)
    assert r.deletable() == [1, 2, 3, 4]
    r.ack("gen-b", 3)  # went back (restarted on an older version): that version is pinned again
    assert r.deletable() == [1, 2]


def test_forget_releases_a_generator_and_register_pins_the_latest() -> None:
    r = published(1, [1, 2, 3])
    r.ack("gen-a", 1)
    assert r.deletable() == []
    r.forget("gen-a")
    r.forget("never-seen")  # ignored
    assert r.deletable() == [1, 2]
    r.register("gen-b")  # about to load version 3
    r.publish(4)
    r.publish(5)
    assert r.deletable() == [1, 2]
    r.register("gen-b")  # a second registration does not move its pin
    assert r.acked == {"gen-b": 3}


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        VersionRetention(keep_last=0)
    r = published(1, [3])
    with pytest.raises(ValueError, match="not newer"):
        r.publish(3)
    with pytest.raises(ValueError, match="never published"):
        r.ack("gen", 4)
    with pytest.raises(ValueError, match="never published"):
        VersionRetention(keep_last=1).ack("gen", 0)
    r.ack("gen", 3)
    with pytest.raises(ValueError, match="still in use"):
        r.deleted(3)


def test_prune_deletes_only_deletable_directories(tmp_path: Path) -> None:
    r = VersionRetention(keep_last=2)
    for v in range(1, 6):
        version_dir(tmp_path, v).mkdir(parents=True)
        (version_dir(tmp_path, v) / "model-00001-of-00001.safetensors").write_bytes(b"x")
        r.publish(v)
    r.ack("gen", 2)
    assert prune(tmp_path, r) == [1]
    assert list_versions(tmp_path) == [2, 3, 4, 5]
    r.ack("gen", 5)
    assert prune(tmp_path, r) == [2, 3]
    assert list_versions(tmp_path) == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000004", "v00000005"]  # no leftovers
    assert prune(tmp_path, r) == [] and r.published == [4, 5]


def test_prune_keeps_one_spare(tmp_path: Path) -> None:
    r = VersionRetention(keep_last=1)
    for v in range(1, 5):
        version_dir(tmp_path, v).mkdir(parents=True)
        (version_dir(tmp_path, v) / "model-00001-of-00001.safetensors").write_bytes(b"x")
        r.publish(v)
    r.ack("gen", 3)
    assert prune(tmp_path, r, keep_spare=True) == [1, 2]
    (spare,) = spare_dirs(tmp_path)  # the first pruned version; the second was deleted
    assert (spare / "model-00001-of-00001.safetensors").read_bytes() == b"x"
    assert list_versions(tmp_path) == [3, 4]
    r.ack("gen", 4)
    assert prune(tmp_path, r, keep_spare=True) == [3]
    assert spare_dirs(tmp_path) == [spare]  # one spare at most
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([spare.name, "v00000004"])


def test_prune_tolerates_an_already_deleted_directory(tmp_path: Path) -> None:
    r = published(1, [1, 2])
    version_dir(tmp_path, 2).mkdir(parents=True)
    assert prune(tmp_path, r) == [1]
    assert r.published == [2]


GENERATORS = ("gen-0", "gen-1", "gen-2")


class RetentionMachine(RuleBasedStateMachine):
    """Random publish / register / ack / forget / prune sequences against a model of what is in use.

    A generator only ever loads (and acks) a version that exists at that moment; a registered
    generator will load the latest version. The properties: a version some generator uses or is
    about to load is never deleted, and the last `keep_last` versions are never deletable.
    """

    def __init__(self) -> None:
        super().__init__()
        self.keep_last = 2
        self.retention = VersionRetention(keep_last=self.keep_last)
        self.on_disk: list[int] = []
        self.uses: dict[str, int] = {}  # the model: what each generator samples with or will load
        self.next_version = 0

    @rule(gap=st.integers(1, 3))
    def publish(self, gap: int) -> None:
        self.next_version += gap
        self.retention.publish(self.next_version)
        self.on_disk.append(self.next_version)

    @precondition(lambda self: self.on_disk)
    @rule(gen=st.sampled_from(GENERATORS))
    def register(self, gen: str) -> None:
        self.retention.register(gen)
        self.uses.setdefault(gen, self.on_disk[-1])

    @precondition(lambda self: self.on_disk)
    @rule(gen=st.sampled_from(GENERATORS), data=st.data())
    def load_and_ack(self, gen: str, data: st.DataObject) -> None:
        version = data.draw(st.sampled_from(self.on_disk))
        self.retention.ack(gen, version)
        self.uses[gen] = version

    @rule(gen=st.sampled_from(GENERATORS))
    def leave(self, gen: str) -> None:
        self.retention.forget(gen)
        self.uses.pop(gen, None)

    @rule()
    def prune(self) -> None:
        for version in self.retention.deletable():
            self.retention.deleted(version)
            self.on_disk.remove(version)

    @invariant()
    def versions_in_use_are_on_disk_and_not_deletable(self) -> None:
        deletable = set(self.retention.deletable())
        for version in self.uses.values():
            assert version in self.on_disk
            assert version not in deletable

    @invariant()
    def the_last_k_are_kept(self) -> None:
        deletable = set(self.retention.deletable())
        assert not deletable & set(self.on_disk[-self.keep_last :])
        assert deletable <= set(self.on_disk)
        assert self.retention.published == self.on_disk


RetentionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRetentionMachine = RetentionMachine.TestCase
