"""The StorageReader interface's defaults and the one read loop, in one process."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.planner import LoadItemType, LoadPlanner, ReadItem
from hyper_parallel_dcp.core.storage import StorageReader, read_items


def _tensor_item(fqn, offset, storage_offsets, lengths, source=None, dest_offsets=None):
    return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, offset), dest_offsets or tuple(0 for _ in lengths),
                    MetadataIndex(fqn, offset), storage_offsets, lengths, source)


def _object_item(fqn, source=None):
    return ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), (), MetadataIndex(fqn), (), (), source)


class _DictReader(StorageReader):
    """Only the abstract methods, over stored values kept in a dict (a third-party reader)."""

    def __init__(self, stored, *, commit_own_tensor=False, deliver=True):
        self.stored = stored
        self.commit_own_tensor = commit_own_tensor
        self.deliver = deliver
        self.plans = []

    def reset(self, checkpoint_id=None):
        pass

    def load_metadata(self):
        raise NotImplementedError

    def execute_read(self, plan, planner):
        self.plans.append(plan)
        for item in plan.items:
            if not self.deliver:
                continue
            value = self.stored[item.storage_index]
            if item.type is LoadItemType.BYTE_IO:
                planner.load_bytes(item, value)
                continue
            data = value[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))].clone()
            if self.commit_own_tensor:
                planner.commit_tensor(item, data)  # allowed: the planner copies it into place
            else:
                target = planner.resolve_tensor(item)
                target.copy_(data)
                planner.commit_tensor(item, target)


STORED = {
    MetadataIndex("w", (0, 0)): torch.arange(24, dtype=torch.float32).reshape(4, 6),
    MetadataIndex("opt"): {"lr": 0.1, "betas": [0.9, 0.99]},
}


@pytest.mark.parametrize("commit_own_tensor", [False, True])
def test_default_read_into_runs_execute_read_on_one_item(commit_own_tensor):
    reader = _DictReader(STORED, commit_own_tensor=commit_own_tensor)
    item = _tensor_item("w", (0, 0), (1, 2), (2, 3), source=5)
    dest = torch.full((2, 3), -1.0)
    reader.read_into(item, dest)
    assert torch.equal(dest, torch.tensor([[8.0, 9.0, 10.0], [14.0, 15.0, 16.0]]))
    (plan,) = reader.plans
    # one item, marked "this rank" so that a reader filtering by its own rank reads it
    assert len(plan.items) == 1 and plan.items[0].source is None
    assert plan.items[0].storage_offsets == (1, 2) and plan.items[0].lengths == (2, 3)


def test_default_read_object_returns_the_stored_object():
    reader = _DictReader(STORED)
    assert reader.read_object(_object_item("opt", source=1)) == {"lr": 0.1, "betas": [0.9, 0.99]}


def test_default_reads_refuse_a_reader_that_delivers_nothing():
    reader = _DictReader(STORED, deliver=False)
    with pytest.raises(RuntimeError, match=r"_DictReader.execute_read delivered nothing for 'w'"):
        reader.read_into(_tensor_item("w", (0, 0), (0, 0), (1, 6)), torch.empty(1, 6))
    with pytest.raises(RuntimeError, match=r"delivered nothing for 'opt'"):
        reader.read_object(_object_item("opt"))


def test_default_sort_items_is_the_global_order():
    a0 = _tensor_item("a", (0,), (0,), (4,))
    a4 = _tensor_item("a", (4,), (0,), (4,))
    b_hi = _tensor_item("b", (0, 0), (2, 0), (2, 6))
    b_lo = _tensor_item("b", (0, 0), (0, 0), (2, 6))
    obj = _object_item("c")
    reader = _DictReader({})
    items = [obj, b_hi, a4, b_lo, a0]
    assert reader.sort_items(items) == [a0, a4, b_lo, b_hi, obj]
    assert items == [obj, b_hi, a4, b_lo, a0]  # a new list; the argument is untouched


class _RecordingPlanner(LoadPlanner):
    def __init__(self, targets):
        self.targets = targets
        self.events = []

    def set_up_planner(self, *a, **k):
        raise NotImplementedError

    def create_local_plan(self):
        raise NotImplementedError

    def create_global_plan(self, all_plans):
        raise NotImplementedError

    def finish_plan(self, new_plan):
        raise NotImplementedError

    def resolve_tensor(self, read_item):
        self.events.append(("resolve", read_item.dest_index.fqn))
        return self.targets[read_item.dest_index.fqn]

    def commit_tensor(self, read_item, tensor):
        assert tensor is self.targets[read_item.dest_index.fqn]
        self.events.append(("commit", read_item.dest_index.fqn))

    def load_bytes(self, read_item, value):
        self.events.append(("object", read_item.dest_index.fqn, value))


class _SliceReader(_DictReader):
    """Overrides the per-item methods, as the filesystem reader does."""

    def __init__(self, stored):
        super().__init__(stored)
        self.calls = []

    def read_into(self, item, dest):
        self.calls.append(item.dest_index.fqn)
        value = self.stored[item.storage_index]
        dest.copy_(value[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))])

    def read_object(self, item):
        self.calls.append(item.dest_index.fqn)
        return self.stored[item.storage_index]


@pytest.mark.parametrize("reader_cls", [_DictReader, _SliceReader])
def test_read_items_reads_in_the_order_given_and_commits_each(reader_cls):
    stored = dict(STORED)
    stored[MetadataIndex("v", (0,))] = torch.arange(5, dtype=torch.int64)
    reader = reader_cls(stored)
    planner = _RecordingPlanner({"w": torch.zeros(2, 6), "v": torch.zeros(3, dtype=torch.int64)})
    items = [_tensor_item("v", (0,), (2,), (3,)), _object_item("opt"), _tensor_item("w", (0, 0), (2, 0), (2, 6))]
    read_items(reader, planner, items)
    assert torch.equal(planner.targets["v"], torch.tensor([2, 3, 4]))
    assert torch.equal(planner.targets["w"], STORED[MetadataIndex("w", (0, 0))][2:4])
    assert planner.events == [("resolve", "v"), ("commit", "v"), ("object", "opt", STORED[MetadataIndex("opt")]),
                              ("resolve", "w"), ("commit", "w")]
    if reader_cls is _SliceReader:
        assert reader.calls == ["v", "opt", "w"]
