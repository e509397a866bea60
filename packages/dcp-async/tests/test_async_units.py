"""One-process tests of async_save's parts: DataCopier, the safe mailbox reader, the file
mailbox (ranks as threads), the staging arena, and single-process async saves."""

from __future__ import annotations

import collections
import logging
import os
import pickle
import threading
from pathlib import Path

import async_test_api as dcp
import pytest
import torch

from hyper_parallel_dcp.async_persist import DataCopier, safe_pickle
from hyper_parallel_dcp.async_persist.arena import StagingArena, materialize
from hyper_parallel_dcp.async_persist.mailbox import FileMailbox
from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.planner import SavePlan, WriteItem, WriteItemType
from hyper_parallel_dcp.storage_fs import FileSystemWriter


# ----------------------------------------------------------------------------- DataCopier
class _Base:
    def __init__(self, v):
        self.v = v


class _Mid(_Base):
    pass


class _Leaf(_Mid):
    pass


class _Unregistered:
    def __init__(self):
        self.items = [1, 2]


def test_data_copier_dispatch_exact_then_most_derived_base_then_deepcopy(caplog) -> None:
    @DataCopier.register(_Base)
    def _base(obj):
        return ("base", obj.v)

    @DataCopier.register(_Mid)
    def _mid(obj):
        return ("mid", obj.v)

    assert DataCopier.copy(_Base(1)) == ("base", 1)
    assert DataCopier.copy(_Mid(2)) == ("mid", 2)
    assert DataCopier.copy(_Leaf(3)) == ("mid", 3)  # most derived registered base wins

    @DataCopier.register(_Leaf)
    def _leaf(obj):
        return ("leaf", obj.v)

    assert DataCopier.copy(_Leaf(4)) == ("leaf", 4)  # exact type first

    original = _Unregistered()
    with caplog.at_level(logging.WARNING, logger="hyper_parallel_dcp.async_persist.copier"):
        copied = DataCopier.copy(original)
    assert copied is not original and copied.items == [1, 2] and copied.items is not original.items
    assert any("_Unregistered" in r.getMessage() and "deepcopy" in r.getMessage() for r in caplog.records)
    with pytest.raises(TypeError):
        DataCopier.register("not a class")


def test_data_copier_containers_and_tensors_share_nothing() -> None:
    t = torch.arange(4.0)
    groups = [{"lr": 0.1, "params": [0, 1]}]
    od = collections.OrderedDict(a=t)
    out = DataCopier.copy({"g": groups, "t": t, "od": od})
    t.add_(10)
    groups[0]["lr"] = 5.0
    groups[0]["params"].append(2)
    assert out["g"] == [{"lr": 0.1, "params": [0, 1]}]
    assert torch.equal(out["t"], torch.arange(4.0)) and torch.equal(out["od"]["a"], torch.arange(4.0))
    assert type(out["od"]) is collections.OrderedDict


# ----------------------------------------------------------------------------- safe pickle
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_safe_pickle_reads_plans_and_refuses_code() -> None:
    plan = SavePlan((WriteItem(MetadataIndex("w", (0, 2)), WriteItemType.TENSOR, (2, 2), (4, 4), "bfloat16", 8),),
                    save_id="x")
    data = safe_pickle.dumps(("tag", [plan, torch.Size([3]), torch.bfloat16, {"k": (1, 2.5, None)}]))
    assert safe_pickle.loads(data) == ("tag", [plan, torch.Size([3]), torch.bfloat16, {"k": (1, 2.5, None)}])
    with pytest.raises(safe_pickle.UnsafePickleError, match=r"LOCAL_PLAN_1\.pkl.*posix\.system|os\.system"):
        safe_pickle.loads(pickle.dumps(_Evil()), source="/ckpt/LOCAL_PLAN_1.pkl")
    with pytest.raises(safe_pickle.UnsafePickleError, match="_Base"):
        safe_pickle.loads(pickle.dumps(_Base(1)))


# ----------------------------------------------------------------------------- file mailbox
def _run_ranks(world_size: int, fn):
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_file_mailbox_reduce_scatter_all_reduce_and_cleanup(tmp_path: Path) -> None:
    world = 3
    # a file of an earlier (killed) save with another tag must not be taken for this one
    stale = FileMailbox(tmp_path, 2, world, "old-tag")
    stale._step = "plan"
    stale._post("LOCAL_PLAN_2.pkl", 999)

    def rank_fn(rank: int):
        mb = FileMailbox(tmp_path, rank, world, "new-tag", timeout=30)
        got = mb.reduce_scatter("plan", lambda: rank * 10, lambda xs: [sum(xs) + r for r in range(world)])
        total = mb.all_reduce("write", lambda: [rank], lambda xs: sorted(v for x in xs for v in x))
        mb.finish()
        return got, total

    results, errors = _run_ranks(world, rank_fn)
    assert not errors, errors
    assert results == {r: (30 + r, [0, 1, 2]) for r in range(world)}
    assert sorted(os.listdir(tmp_path)) == []


def test_file_mailbox_failure_on_one_rank_raised_everywhere_and_timeout_names_rank(tmp_path: Path) -> None:
    def rank_fn(rank: int):
        mb = FileMailbox(tmp_path / "a", rank, 2, "t1", timeout=30)

        def local():
            if rank == 1:
                raise KeyError("model.w missing on rank 1")
            return rank

        return mb.reduce_scatter("plan", local, lambda xs: xs)

    results, errors = _run_ranks(2, rank_fn)
    assert set(errors) == {0, 1}
    assert all("model.w missing on rank 1" in str(e) for e in errors.values())

    lonely = FileMailbox(tmp_path / "b", 0, 2, "t2", timeout=0.3)
    with pytest.raises(TimeoutError, match="rank 1 did not write .*LOCAL_PLAN_1.pkl"):
        lonely.reduce_scatter("plan", lambda: 0, lambda xs: xs)


# ----------------------------------------------------------------------------- staging arena
def test_staging_arena_reuses_slots_and_releases_unused_slabs() -> None:
    arena = StagingArena()
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16), "n": {"x": 1}}
    staged, stats = arena.stage(sd)
    assert stats.staged_bytes == 6 * 4 + 5 * 2 and stats.reused_bytes == 0 and stats.allocated_bytes >= 34
    ptrs = arena.buffer_ptrs()
    sd["a"].add_(1)
    again, stats2 = arena.stage(sd)
    assert stats2.reused_bytes == stats2.staged_bytes and stats2.allocated_bytes == 0
    assert arena.buffer_ptrs() == ptrs
    flat = materialize(again, arena.slabs)
    assert torch.equal(flat["a"].pieces[0][1], torch.arange(6.0).reshape(2, 3) + 1)
    assert flat["n.x"] == 1
    # a new shape: a new slab; the old one (now unused) is released
    _, stats3 = arena.stage({"a": torch.zeros(3, 3)})
    assert stats3.reused_bytes == 0 and list(arena.buffer_ptrs()) == [("a", (0, 0), (3, 3), torch.float32)]
    assert len(arena.slabs) == 1 and all(t.is_shared() for t in arena.slabs.values())


def test_a_later_description_of_one_layout_is_whole_with_this_saves_objects() -> None:
    """A repeated save's description: every leaf in the state dict's order, the tensor
    leaves staged where the first save staged them, the object leaves of this save."""
    arena = StagingArena()
    sd = {"a": torch.ones(3), "meta": {"epoch": 1}, "b": torch.zeros(2, 2), "c": {"d": torch.ones(1)}}
    first, _ = arena.stage(sd)
    sd["meta"]["epoch"] = 2
    later, _ = arena.stage(sd)
    assert list(later.leaves) == ["a", "meta.epoch", "b", "c.d"]  # the state dict's order
    assert later.leaves["meta.epoch"] == ("object", 2)
    assert {k: v for k, v in later.leaves.items() if k != "meta.epoch"} == {
        k: v for k, v in first.leaves.items() if k != "meta.epoch"}
    assert later.slab_ids == first.slab_ids
    flat = materialize(later, arena.slabs)
    assert flat["meta.epoch"] == 2 and torch.equal(flat["b"].pieces[0][1], torch.zeros(2, 2))
    assert torch.equal(flat["c.d"].pieces[0][1], torch.ones(1))


# ----------------------------------------------------------------------------- one-process saves
class _FailingWriter(FileSystemWriter):
    def execute_write(self, plan, planner):
        raise ValueError(f"disk full while writing {self.path}/_rank0_.safetensors")


def test_single_process_async_save_errors_callback_and_assertion(tmp_path: Path, caplog, monkeypatch) -> None:
    sd = {"w": torch.arange(12.0).reshape(3, 4), "meta": {"epoch": 2}}
    # a writer error arrives through the future with its original message
    resp = dcp.async_save(sd, checkpoint_id=tmp_path / "bad", storage_writer=_FailingWriter(tmp_path / "bad"))
    with pytest.raises(ValueError, match="disk full while writing"):
        resp.get_result(timeout=120)
    assert not (tmp_path / "bad" / ".metadata").exists()

    # a callback that raises is logged; the checkpoint still lands and the future resolves
    def bad_callback():
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger="hyper_parallel_dcp.async_persist.persist"):
        resp = dcp.async_save(sd, checkpoint_id=tmp_path / "ok", callback=bad_callback)
        sd["w"].zero_()
        md = resp.get_result(timeout=120)
    assert "w" in md.state_dict_metadata
    assert any("callback raised" in r.getMessage() for r in caplog.records)
    target = {"w": torch.zeros(3, 4), "meta": {"epoch": None}}
    dcp.load(target, checkpoint_id=tmp_path / "ok")
    assert torch.equal(target["w"], torch.arange(12.0).reshape(3, 4)) and target["meta"] == {"epoch": 2}

    # use_gloo without MASTER_ADDR/MASTER_PORT: AssertionError before anything starts
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(AssertionError, match="MASTER_ADDR"):
        dcp.async_save(sd, checkpoint_id=tmp_path / "gloo", use_gloo=True)
    assert not (tmp_path / "gloo").exists()


def test_later_saves_of_one_layout_send_the_writer_every_leaf_and_land_their_values(tmp_path: Path, monkeypatch) -> None:
    from multiprocessing.connection import Connection

    from hyper_parallel_dcp.async_persist import shutdown_writer
    from hyper_parallel_dcp.async_persist.writer import SaveRequest

    sent: list[list[str]] = []
    send = Connection.send

    def spy(self, obj):
        if isinstance(obj, SaveRequest):
            sent.append(list(obj.staged.leaves))
        return send(self, obj)

    monkeypatch.setattr(Connection, "send", spy)
    shutdown_writer()  # a writer of this test's own
    sd = {"w": torch.arange(12.0).reshape(3, 4), "meta": {"epoch": 0}, "b": torch.ones(2)}
    steps = []
    for step, writer in enumerate([None, None, _FailingWriter(tmp_path / "s2"), None, None]):
        sd["w"].fill_(step)
        sd["meta"]["epoch"] = step
        resp = dcp.async_save(sd, checkpoint_id=tmp_path / f"s{step}", storage_writer=writer)
        try:
            resp.get_result(timeout=120)
            steps.append(step)
        except ValueError:
            pass  # the failing writer's save
    # every request describes every leaf, in the state dict's order, a failed save's too
    assert sent == [["w", "meta.epoch", "b"]] * 5
    assert steps == [0, 1, 3, 4]
    for step in steps:
        target = {"w": torch.zeros(3, 4), "meta": {"epoch": None}, "b": torch.zeros(2)}
        dcp.load(target, checkpoint_id=tmp_path / f"s{step}")
        assert torch.equal(target["w"], torch.full((3, 4), float(step))) and target["meta"] == {"epoch": step}
        assert torch.equal(target["b"], torch.ones(2))
    # a new writer process holds nothing: it gets every leaf and the slabs again
    shutdown_writer()
    sd["meta"]["epoch"] = 9
    dcp.async_save(sd, checkpoint_id=tmp_path / "s9").get_result(timeout=120)
    assert sent[-1] == ["w", "meta.epoch", "b"]
    target = {"w": torch.zeros(3, 4), "meta": {"epoch": None}, "b": torch.zeros(2)}
    dcp.load(target, checkpoint_id=tmp_path / "s9")
    assert target["meta"] == {"epoch": 9}


def test_populate_slab_maps_a_slab_without_changing_it() -> None:
    import sys

    from hyper_parallel_dcp.async_persist.arena import populate_slab

    storage = torch.UntypedStorage._new_shared(3 << 20)
    slab = torch.empty(0, dtype=torch.uint8).set_(storage)
    slab.copy_(torch.arange(slab.numel(), dtype=torch.int64).remainder(251).to(torch.uint8))
    before = slab.clone()
    assert populate_slab(slab) is sys.platform.startswith("linux")
    assert populate_slab(slab[7:5000]) is False  # no whole page inside: nothing to do
    assert populate_slab(torch.empty(0, dtype=torch.uint8)) is False
    assert torch.equal(slab, before)


def test_reply_is_unpickled_with_the_collector_paused_and_resumed_after() -> None:
    import gc

    from hyper_parallel_dcp.async_persist.writer import recv_reply

    class Conn:
        def recv(self):
            self.enabled_during = gc.isenabled()
            return "reply"

    conn = Conn()
    assert gc.isenabled()
    assert recv_reply(conn) == "reply"
    assert conn.enabled_during is False
    assert gc.isenabled()
