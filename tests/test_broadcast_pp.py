"""Read-once + broadcast under pipeline parallelism: 8 gloo ranks, pp=2 x dp=2 x tp=2.

rank = pp * 4 + dp * 2 + tp.  Stage 0 (ranks 0-3) and stage 1 (ranks 4-7) hold disjoint
keys whose names interleave in the global order (a, c, e / b, d, f).  Stage 0 has
tp-sharded dp-replicated and stage-replicated tensors (many small ones, so batching
matters); stage 1 is fully sharded (no replicated shard of its own); ``t.tied`` is tied
across the non-adjacent ranks [0, 1, 6, 7].  Ranks 4 and 5 are in no replica group at
all and must still take part in creating the groups.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_distributed

WORLD = 8
# uneven flat ranges of d.head (8 x 3 = 24 elements) over the 4 ranks of stage 1
_HEAD_RANGES = [(0, 5), (5, 13), (13, 20), (20, 24)]


def _reference():
    g = torch.Generator().manual_seed(3)
    ref = {
        "a.embed": torch.randn(16, 4, generator=g),
        "b.layer1": torch.randn(12, 4, generator=g),
        "c.norm0": torch.randn(8, generator=g),
        "d.head": torch.randn(8, 3, generator=g),
        "t.tied": torch.randn(4, 4, generator=g),
        "g.state0": {"stage": 0, "sched": [1, 2, 3]},
        "h.state1": {"stage": 1, "sched": [4, 5]},
    }
    ref.update({f"e.bias.{i}": torch.randn(3, generator=g) for i in range(10)})
    return ref


def _holdings(rank):
    """key -> ("full",) | ("rows", start, rows) | ("flat", start, end) | ("object",)."""
    pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
    held: dict = {}
    if pp == 0:
        held["a.embed"] = ("rows", 8 * tp, 8)
        held["c.norm0"] = ("full",)
        held.update({f"e.bias.{i}": ("full",) for i in range(10)})
        held["g.state0"] = ("object",)
    else:
        shard = dp * 2 + tp
        held["b.layer1"] = ("rows", 3 * shard, 3)
        held["d.head"] = ("flat", *_HEAD_RANGES[shard])
        held["h.state1"] = ("object",)
    if rank in (0, 1, 6, 7):
        held["t.tied"] = ("full",)
    return held


def _expected(ref, key, spec):
    full = ref[key]
    if spec[0] == "full":
        return full
    if spec[0] == "rows":
        return full[spec[1]:spec[1] + spec[2]]
    return full.reshape(-1)[spec[1]:spec[2]]


def _targets(rank, ref):
    from hyper_parallel_dcp import RaggedShard

    sd = {}
    for key, spec in _holdings(rank).items():
        full = ref[key]
        if spec[0] == "object":
            sd[key] = {"stage": -1, "sched": []}
        elif spec[0] == "full":
            sd[key] = torch.zeros_like(full)
        elif spec[0] == "rows":
            sd[key] = RaggedShard.from_rows(torch.zeros(spec[2], *full.shape[1:]), full.shape, spec[1])
        else:
            sd[key] = RaggedShard(torch.zeros(spec[2] - spec[1]), full.shape, [(spec[1], spec[2])])
    return sd


def _pp_worker(rank, world_size, path, ref):
    import torch.distributed.distributed_c10d as c10d

    from hyper_parallel_dcp import RaggedShard
    from hyper_parallel_dcp.api import load
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    out = {}
    for name, kwargs in (("on", {}), ("unbatched", {"broadcast_batch_bytes": 0}),
                         ("off", {"broadcast_replicated_tensors": False})):
        sd = _targets(rank, ref)
        reader = FileSystemReader(path)
        before = len(c10d._world.pg_map)
        load(sd, storage_reader=reader, **kwargs)
        bad = []
        for key, spec in _holdings(rank).items():
            got = sd[key]
            if spec[0] == "object":
                if got != ref[key]:
                    bad.append(key)
                continue
            got = got.local_tensor if isinstance(got, RaggedShard) else got
            if not torch.equal(got.reshape(-1), _expected(ref, key, spec).reshape(-1)):
                bad.append(key)
        out[name] = (bad, reader.bytes_read, len(c10d._world.pg_map) - before)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_dp2_tp2_stages_with_disjoint_keys_and_a_tied_parameter(tmp_path):
    from hyper_parallel_dcp.api import save
    from hyper_parallel_dcp.storage_fs import FileSystemReader

    ref = _reference()
    path = str(tmp_path / "ckpt")
    save(ref, checkpoint_id=path, no_dist=True)
    md = FileSystemReader(path).load_metadata()
    stored_objects = {idx.fqn: info.length for idx, info in md.storage_data.items() if idx.offset is None}
    # a nested dict is stored leaf by leaf ("g.state0.stage", "g.state0.sched")
    object_len = {key: sum(n for fqn, n in stored_objects.items() if fqn.startswith(key + "."))
                  for key in ("g.state0", "h.state1")}
    assert all(object_len.values())

    # Expected bytes from the layout table: without broadcast every rank reads what it
    # holds; with it, every distinct (key, region) is read once.  Objects: every holder.
    off = on = 0
    distinct = set()
    for rank in range(WORLD):
        for key, spec in _holdings(rank).items():
            if spec[0] == "object":
                off += object_len[key]
                on += object_len[key]
                continue
            nbytes = _expected(ref, key, spec).numel() * ref[key].element_size()
            off += nbytes
            if (key, spec) not in distinct:
                distinct.add((key, spec))
                on += nbytes

    results = run_distributed(_pp_worker, WORLD, path, ref, timeout=420)

    for rank, out in enumerate(results):
        for name, (bad, _, leaked) in out.items():
            assert bad == [], f"rank {rank} ({name}): wrong values for {bad}"
            assert leaked == 0, f"rank {rank} ({name}): {leaked} process groups left behind"
    assert sum(out["off"][1] for out in results) == off
    assert sum(out["on"][1] for out in results) == on
    assert sum(out["unbatched"][1] for out in results) == on
    assert on < off
    # stage 1 ranks outside the tied group read exactly their own shards either way
    for rank in (4, 5):
        assert results[rank]["on"][1] == results[rank]["off"][1]
