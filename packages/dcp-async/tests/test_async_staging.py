"""The staging arena's two fast paths: a repeated save of the same layout (no per-piece
geometry, the destination views kept) and a first save that stages into private memory
and fills the new shared slab later.  Every staged value is compared with the source as
it was at staging time."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.async_persist.arena import StagingArena, materialize
from hyper_parallel_dcp.core.testing import run_distributed


def _staged_values(arena: StagingArena, staged) -> dict:
    """fqn -> {global offsets: staged piece (a copy)} or the staged object."""
    out = {}
    for fqn, leaf in materialize(staged, arena.slabs).items():
        if hasattr(leaf, "pieces"):
            out[fqn] = {box.offsets: view.clone() for box, view in leaf.pieces}
        else:
            out[fqn] = leaf
    return out


def _plain_state(step: int) -> dict:
    return {
        "w": torch.arange(12.0).reshape(3, 4) + step,
        "b": torch.full((5,), step, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "opt": {"step": step, "m": torch.arange(6, dtype=torch.int64) * step},
    }


def _expect_plain(sd: dict, prefix: str = "") -> dict:
    """What staging must hold for a state dict of whole plain tensors and objects (a copy)."""
    out: dict = {}
    for key, value in sd.items():
        if isinstance(value, dict):
            out.update(_expect_plain(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = {(0,) * value.dim(): value.clone()}
        else:
            out[prefix + key] = value
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # the flat order of the caller's state dict is kept
    for fqn, value in want.items():
        if isinstance(value, dict):
            assert set(got[fqn]) == set(value), fqn
            for offsets, ref in value.items():
                assert got[fqn][offsets].dtype == ref.dtype and torch.equal(got[fqn][offsets], ref), fqn
        else:
            assert got[fqn] == value, fqn


def test_repeated_save_reuses_the_layout_and_notices_every_change() -> None:
    arena = StagingArena()
    sd = _plain_state(1)
    staged, stats = arena.stage(sd)
    assert stats.reused_bytes == 0 and stats.allocated_bytes > 0
    _assert_same(_staged_values(arena, staged), _expect_plain(sd))
    ptrs = arena.buffer_ptrs()

    # same layout, new values (and new tensor objects): the same slots, every value new
    sd = _plain_state(2)
    staged, stats = arena.stage(sd)
    assert stats.reused_bytes == stats.staged_bytes and stats.allocated_bytes == 0
    assert arena.buffer_ptrs() == ptrs
    _assert_same(_staged_values(arena, staged), _expect_plain(sd))

    # each change of geometry must be seen: shape, dtype, an object becoming a tensor, key order
    changes = [
        lambda s: s.__setitem__("w", torch.arange(16.0).reshape(4, 4)),
        lambda s: s.__setitem__("b", torch.arange(5, dtype=torch.float64)),
        lambda s: s["opt"].__setitem__("step", torch.tensor([7.0, 8.0])),
        lambda s: s.update({"w": s.pop("w")}),  # same leaves, another order
    ]
    for i, change in enumerate(changes):
        sd = _plain_state(3 + i)
        change(sd)
        staged, _ = arena.stage(sd)
        _assert_same(_staged_values(arena, staged), _expect_plain(sd))
        # the save after the change takes the fast path with the new layout
        for t in (sd["w"], sd["b"], sd["opt"]["m"]):
            t.add_(1)
        again, stats = arena.stage(sd)
        assert stats.reused_bytes == stats.staged_bytes
        _assert_same(_staged_values(arena, again), _expect_plain(sd))
    arena.clear()


def test_deferred_first_save_keeps_the_values_of_staging_time() -> None:
    arena = StagingArena()
    sd = _plain_state(1)
    expected = _expect_plain(sd)
    staged, stats = arena.stage(sd)
    assert stats.allocated_bytes > 0 and stats.reused_bytes == 0
    # training goes on before the slab is filled: staging already owns its copy
    sd["w"].mul_(-1)
    sd["opt"]["m"].fill_(99)
    arena.complete()
    _assert_same(_staged_values(arena, staged), expected)
    # the next save copies straight into the slab filled in the background
    sd = _plain_state(5)
    again, stats = arena.stage(sd)
    assert stats.reused_bytes == stats.staged_bytes and stats.allocated_bytes == 0
    _assert_same(_staged_values(arena, again), _expect_plain(sd))
    arena.clear()


def test_deferred_slab_fills_in_batches_and_frees_each_batch_first(monkeypatch) -> None:
    """A new slab is filled batch by batch; before the next batch starts, the previous
    batch's private copies are gone and the heap was trimmed (so the slab's pages and the
    writer's page cache reuse their memory instead of memory never touched before)."""
    import weakref

    from hyper_parallel_dcp.async_persist import arena as staging

    sd = {f"t{i}": torch.arange(256, dtype=torch.float32) * (i + 1) for i in range(10)}  # 1 KiB each
    expected = {fqn: {(0,): t.clone()} for fqn, t in sd.items()}
    monkeypatch.setattr(staging, "_FILL_BATCH_BYTES", 3 * 1024)  # batches of 3, 3, 3, 1 pieces
    arena = StagingArena()
    staged, _ = arena.stage(sd)
    private = arena._pending.private  # noqa: SLF001 - the private copies, by position
    copies = [weakref.ref(t) for t in private.values()]
    alive_at_trim: list[int] = []
    monkeypatch.setattr(staging, "malloc_trim", lambda: alive_at_trim.append(sum(r() is not None for r in copies)))
    for t in sd.values():
        t.fill_(-1)  # training goes on: staging owns its copies
    arena.complete()
    assert alive_at_trim == [7, 4, 1, 0]  # each batch freed before its trim
    _assert_same(_staged_values(arena, staged), expected)
    arena.clear()


def test_small_pieces_gathered_then_copied_in_one_run(monkeypatch) -> None:
    """A repeated save's small device pieces go through a scratch buffer mirroring their
    slots (driven here with host tensors): adjacent slots make one run, a large piece, a
    lone small one and pieces past the memory budget are copied one by one, and every
    staged value is the source's, a strided source and mixed dtypes included."""
    from hyper_parallel_dcp.async_persist import arena as repeat
    from hyper_parallel_dcp.core.flatten import flatten_state_dict
    from hyper_parallel_dcp.core.layout import is_tensor_leaf

    monkeypatch.setattr(repeat, "_PACK_PIECE_BYTES", 1024)

    def state(step: int) -> dict:
        wide = torch.arange(40.0).reshape(5, 8) + step
        return {
            "a": torch.arange(7, dtype=torch.int16) + step,  # 14 bytes: padded slot
            "b": torch.full((3, 5), step, dtype=torch.bfloat16),
            "c": wide[:, 1:4],  # strided source
            "big": torch.arange(512.0) * step,  # 2 KiB: not gathered
            "d": torch.tensor([step, -step], dtype=torch.float64),
            "lone": {"x": torch.ones(1) * step, "n": "object"},
        }

    def sources(sd: dict) -> list[torch.Tensor]:
        flat, _ = flatten_state_dict(sd, is_tensor_leaf)
        return arena._layout.sources(flat)  # noqa: SLF001

    arena = StagingArena()
    staged, _ = arena.stage(state(1))  # its slots are the ones a repeated save fills
    arena.complete()  # the new slab exists, and with it the layout's slot views
    sd = state(2)
    pack = repeat.DevicePack(arena._layout.dsts, sources(sd), host_sources=True)  # noqa: SLF001
    # slots in state-dict order: a b c big d x; a, b, c adjacent, then d and x
    assert [scratch.numel() for _, scratch in pack.runs] == [64 * 3, 64 * 2]
    assert pack.packed == 5 and pack.rest == [3]
    pack.copy(sources(sd))
    _assert_same(_staged_values(arena, staged), _expect_plain(sd))

    # a budget of two slots: a and b gathered, the rest one by one
    monkeypatch.setattr(repeat, "_PACK_TOTAL_BYTES", 128)
    sd = state(3)
    pack = repeat.DevicePack(arena._layout.dsts, sources(sd), host_sources=True)  # noqa: SLF001
    assert [scratch.numel() for _, scratch in pack.runs] == [128] and pack.rest == [2, 3, 4, 5]
    pack.copy(sources(sd))
    _assert_same(_staged_values(arena, staged), _expect_plain(sd))
    arena.clear()


def test_malloc_trim_on_glibc() -> None:
    import sys

    from hyper_parallel_dcp.storage_fs.posix import malloc_trim

    before = torch.arange(1 << 20, dtype=torch.float64)  # 8 MiB freed below, then trimmed
    del before
    gnu = sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver())
    assert malloc_trim() is gnu


def _dtensor_worker(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    problems: list[str] = []

    def full(step: int) -> dict:
        return {"col": torch.arange(40.0).reshape(8, 5) + step, "row": torch.arange(35.0).reshape(5, 7) * step,
                "uneven": torch.arange(3.0) + step, "rep": torch.ones(4) * step}

    layouts = {"col": [Shard(0)], "row": [Shard(1)], "uneven": [Shard(0)], "rep": [Replicate()]}

    def state(step: int, layouts: dict) -> dict:
        return {k: distribute_tensor(v, mesh, layouts[k]) for k, v in full(step).items()}

    def check(staged, step: int, what: str) -> None:
        ref = full(step)
        for fqn, leaf in materialize(staged, arena.slabs).items():
            for box, view in leaf.pieces:
                want = ref[fqn][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
                if not torch.equal(view, want):
                    problems.append(f"rank {rank} {what}: {fqn} at {box.offsets} differs")

    arena = StagingArena()
    for step in (1, 2, 3):  # first: slow path (deferred on step 1), then the fast path
        staged, stats = arena.stage(state(step, layouts))
        if step > 1 and stats.reused_bytes != stats.staged_bytes:
            problems.append(f"rank {rank} step {step}: not reused {stats}")
        check(staged, step, f"step {step}")
    # another placement of one tensor: a new spec, so new pieces (and a new slot)
    changed = dict(layouts, col=[Shard(1)])
    staged, stats = arena.stage(state(4, changed))
    if stats.reused_bytes == stats.staged_bytes:
        problems.append(f"rank {rank}: a new placement reused the old slots")
    check(staged, 4, "changed placement")
    staged, stats = arena.stage(state(5, changed))
    check(staged, 5, "after the change")
    arena.clear()
    return problems


@pytest.mark.distributed
def test_dtensor_fast_path_values_and_placement_change() -> None:
    assert run_distributed(_dtensor_worker, 2, timeout=120) == [[], []]


def test_start_writer_ahead_then_first_save_lands_with_its_values(tmp_path) -> None:
    import async_test_api as dcp

    from hyper_parallel_dcp.async_persist import shutdown_writer, start_writer
    from hyper_parallel_dcp.async_persist.persist import _get_persister

    shutdown_writer()
    start_writer()
    pid = _get_persister().writer.pid
    assert pid is not None
    start_writer()  # a no-op while it runs
    assert _get_persister().writer.pid == pid
    try:
        sd = _plain_state(3)
        expected = _expect_plain(sd)
        resp = dcp.async_save(sd, checkpoint_id=tmp_path / "ckpt")
        assert resp.writer_pid == pid  # the first save used the writer started ahead
        sd["w"].zero_()  # staging owns its copy at once, also with the slab filled later
        resp.get_result(timeout=300)
        target = _plain_state(0)
        target["opt"]["step"] = None
        dcp.load(target, checkpoint_id=tmp_path / "ckpt", no_dist=True)
        assert _expect_plain(target).keys() == expected.keys()
        _assert_same({k: ({(0,) * v.dim(): v} if isinstance(v, torch.Tensor) else v)
                      for k, v in _flat(target).items()}, expected)
    finally:
        shutdown_writer()


def _flat(sd: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in sd.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _load_back(path, like: dict) -> dict:
    import async_test_api as dcp

    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in like.items()}
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


def test_ready_writer_new_layout_fills_its_new_slab_off_the_caller_path(tmp_path) -> None:
    """start_writer(wait=True) returns with a serving writer; a later save of a new layout
    (old pieces reuse their slots, new ones get a slab filled by the joining thread) sends
    only the new slab and lands the values of staging time."""
    import async_test_api as dcp

    from hyper_parallel_dcp.async_persist import shutdown_writer, start_writer
    from hyper_parallel_dcp.async_persist.persist import _get_persister

    shutdown_writer()
    start_writer(wait=True, timeout=300)
    pid = _get_persister().writer.pid
    assert pid is not None and not _get_persister().writer.fresh  # it answered: ready
    start_writer(wait=True)  # a no-op while it runs
    assert _get_persister().writer.pid == pid
    try:
        first = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.full((5,), 2, dtype=torch.bfloat16)}
        want_first = {k: v.clone() for k, v in first.items()}
        resp = dcp.async_save(first, checkpoint_id=tmp_path / "a")
        assert resp.staging.allocated_bytes > 0
        first["w"].zero_()
        resp.get_result(timeout=300)
        second = {"w": torch.arange(12.0).reshape(3, 4) * 3, "extra": torch.arange(7, dtype=torch.int64), "s": 4}
        want_second = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in second.items()}
        resp = dcp.async_save(second, checkpoint_id=tmp_path / "b")
        assert resp.staging.reused_bytes == 12 * 4 and resp.staging.allocated_bytes > 0
        second["extra"].zero_()  # its private copy was taken at staging time
        second["w"].zero_()
        resp.get_result(timeout=300)
        assert resp.writer_pid == pid
        for path, want in ((tmp_path / "a", want_first), (tmp_path / "b", want_second)):
            got = _load_back(path, want)
            for k, v in want.items():
                assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, (path, k)
    finally:
        shutdown_writer()


def _read_shared(conn) -> None:
    """Child: receive a shared buffer, report its first bytes once told, then write to it."""
    buffer = conn.recv()
    conn.recv()  # the parent has written by now
    conn.send(buffer[:4].tolist())
    buffer[4:8] = 9
    conn.send(True)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_slab_is_shared_with_the_writer_process_without_a_copy(strategy: str) -> None:
    import multiprocessing

    import torch.multiprocessing as torch_mp

    from hyper_parallel_dcp.async_persist._torch_compat import new_shared_storage

    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy(strategy)
    try:
        buffer = torch.empty(0, dtype=torch.uint8).set_(new_shared_storage(3 << 20))
        assert buffer.numel() == 3 << 20 and buffer.untyped_storage().is_shared()
        address = buffer.data_ptr()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_read_shared, args=(child,))
        proc.start()
        parent.send(buffer)  # pickled as the memory itself (a descriptor or a name), not its bytes
        assert buffer.data_ptr() == address  # sending did not move it into other shared memory
        buffer[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        parent.send("written")
        assert parent.recv() == [1, 2, 3, 4]  # the child sees what was written after sending
        assert parent.recv() is True
        assert buffer[4:8].tolist() == [9, 9, 9, 9]  # and the parent sees the child's writes
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        torch_mp.set_sharing_strategy(before)
