"""Pure helpers of the benchmarks, and a smoke run of the quick mode (no timed asserts)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.benchmarks.planning_sim import (
    GLOBAL_LOAD_SAMPLES,
    LAYOUTS,
    fit_exponent,
    rank_boxes,
    simulate_world,
)
from hyper_parallel_dcp.benchmarks.report import evaluate_goals, nlogn_exponent, summarize
from hyper_parallel_dcp.benchmarks.state_dicts import dense_shapes, small_shapes
from hyper_parallel_dcp.benchmarks.throttle import SharedBandwidth
from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.metadata import ChunkStorageMetadata, MetadataIndex
from hyper_parallel_dcp.core.planner import SavePlan, WriteItem, WriteItemType
from hyper_parallel_dcp.core.save_planning import build_metadata


def test_fit_exponent_recovers_power_laws():
    worlds = [64, 256, 1024, 8192]
    assert fit_exponent(worlds, [3.0 * w**1.5 for w in worlds]) == pytest.approx(1.5)
    assert fit_exponent(worlds, [0.01 * w for w in worlds]) == pytest.approx(1.0)
    assert fit_exponent([2, 4], [5.0, 5.0]) == pytest.approx(0.0)


def test_fit_exponent_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_exponent([64], [1.0])
    with pytest.raises(ValueError):
        fit_exponent([64, 128], [1.0, 0.0])
    with pytest.raises(ValueError):
        fit_exponent([64, 64], [1.0, 2.0])


def test_nlogn_exponent_is_above_one_and_shrinks_with_range():
    wide = nlogn_exponent([64, 8192])
    # n log n between 64 and 8192: log2 grows 6 -> 13
    assert wide == pytest.approx(1 + math.log(13 / 6) / math.log(128))
    assert 1.0 < nlogn_exponent([2**20, 2**21]) < wide


def test_summarize():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    with pytest.raises(ValueError):
        summarize([])


def test_synthetic_shapes_hit_their_size():
    total = sum(2 * math.prod(s) for _, s, _ in dense_shapes(256))
    assert 0.8 * 256 * 2**20 < total <= 256 * 2**20 + 2**20
    small = small_shapes(100, 128)
    assert len(small) == 100 and all(2 * math.prod(s) == 128 * 1024 for _, s, _ in small)


def test_rank_boxes_tile_every_tensor_exactly_once_per_replica():
    layout = LAYOUTS["dense"]
    specs = layout.specs()[:12]
    mesh = layout.save_mesh(64)  # (dp=8, tp=8)
    for dp in (0, 5):
        held: dict[str, list] = {}
        for rank in range(dp * mesh[1], (dp + 1) * mesh[1]):
            for spec, box in rank_boxes(specs, mesh, rank):
                held.setdefault(spec.fqn, []).append(box)
        for spec in specs:
            boxes = held[spec.fqn]
            sharded = any(type(p).__name__ == "Shard" for p in spec.placements)
            if sharded:  # the tp ranks of one replica tile the tensor exactly once
                assert sum(b.volume for b in boxes) == math.prod(spec.shape)
                assert all(a.intersect(b) is None for a, b in itertools.combinations(boxes, 2))
            else:  # every rank holds the whole replicated tensor
                assert all(b.offsets == (0,) and b.sizes == spec.shape for b in boxes) and len(boxes) == 8


def test_simulated_planning_matches_torch_chunk_counts():
    row = simulate_world(LAYOUTS["dense"], 64, load_ranks=2)
    specs = LAYOUTS["dense"].specs()
    # stored chunks: tp=8 per sharded tensor, one per replicated tensor
    expected = sum(8 if any(type(p).__name__ == "Shard" for p in s.placements) else 1 for s in specs)
    assert row["chunks_stored"] == expected
    assert row["items_total"] == 64 * len(specs)
    assert row["ours_metadata_json_bytes"] > 0 and row["torch_metadata_pickle_bytes"] > 0
    moe = simulate_world(LAYOUTS["moe"], 64, load_ranks=2, with_torch=False)
    assert moe["save_mesh"] == [1, 64] and moe["chunks_stored"] > 64
    # the coordinator's reader assignment: the median of GLOBAL_LOAD_SAMPLES runs
    for r in (row, moe):
        samples = r["ours_global_load_samples_s"]
        assert len(samples) == GLOBAL_LOAD_SAMPLES == 3
        assert r["ours_global_load_s"] == sorted(samples)[1]


def _check_disjoint(chunks, shape=(11, 11)):
    """``build_metadata`` of one rank holding ``chunks`` of a tensor ``t``: what refuses overlaps."""
    items = tuple(WriteItem(MetadataIndex("t", c.offsets), WriteItemType.TENSOR, c.sizes, shape, "float32",
                            4 * math.prod(c.sizes)) for c in chunks)
    build_metadata([SavePlan(items)])


def _overlaps_brute(chunks):
    boxes = [ChunkBox(c.offsets, c.sizes) for c in chunks]
    return any(a.intersect(b) is not None for a, b in itertools.combinations(boxes, 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6), st.integers(1, 4)),
                min_size=2, max_size=8, unique=True))
def test_overlap_check_agrees_with_brute_force(raw):
    chunks = [ChunkStorageMetadata((a, c), (b, d)) for a, b, c, d in raw]
    if len({c.offsets for c in chunks}) != len(chunks):
        return  # build_metadata never sees two chunks at one offset (dedup merges them)
    if _overlaps_brute(chunks):
        with pytest.raises(ValueError, match="overlap"):
            _check_disjoint(chunks)
    else:
        _check_disjoint(chunks)


def test_grid_tiling_is_accepted():
    chunks = [ChunkStorageMetadata((i * 4, j * 3), (4, 3)) for i in range(16) for j in range(16)]
    _check_disjoint(chunks, (64, 48))
    chunks.append(ChunkStorageMetadata((5, 5), (1, 1)))
    with pytest.raises(ValueError, match="overlap"):
        _check_disjoint(chunks, (64, 48))


def test_shared_bandwidth_reserves_consecutive_slots(tmp_path):
    bw = SharedBandwidth(tmp_path / "bw", 1e9)
    bw.consume(1_000_000)  # 1 ms slot
    first = (tmp_path / "bw").read_bytes()
    bw.consume(2_000_000)
    import struct

    a = struct.unpack("d", first)[0]
    b = struct.unpack("d", (tmp_path / "bw").read_bytes())[0]
    # the second slot starts no earlier than the first ends: 2 ms later at least
    assert b - a >= 0.002 - 1e-9
    with pytest.raises(ValueError):
        SharedBandwidth(tmp_path / "x", 0)


def test_goals_report_not_measured_without_data():
    goals = evaluate_goals({}, None)
    assert goals == []
    io = {"dense": {"summary": {"ours.save": summarize([1.2]), "ref.raw_write_fsync": summarize([1.0]),
                                "torch.load": summarize([3.0]), "ours.load": summarize([1.0])},
                    "info": {"rank_bytes": 10, "pieces_per_rank": 1}}}
    by_name = {g["goal"]: g for g in evaluate_goals(io, None)}
    assert by_name["dense: save ≤ 1.1× raw write+fsync"]["met"] is False
    assert by_name["dense: save ≤ 1.1× raw write+fsync"]["value"] == pytest.approx(1.2)
    assert by_name["dense: load ≥ 2.0× faster than torch (page cache)"]["met"] is True
    assert by_name["dense: async blocking (first save) ≤ 1.3× fresh host copy"]["met"] is None
    assert by_name["dense: async time to landed (later saves) ≤ torch's async_save"]["met"] is None
    io["dense"]["summary"].update({"ours.async_landed": summarize([0.2, 0.3]),
                                   "torch.async_landed": summarize([0.25, 0.25])})
    landed = {g["goal"]: g for g in evaluate_goals(io, None)}["dense: async time to landed (later saves) ≤ torch's async_save"]
    assert landed["met"] is True and landed["value"] == pytest.approx(1.0)


def test_per_tensor_goals_divide_the_whole_time_of_the_tiny_case():
    io = {"tiny": {"summary": {"ours.save": summarize([0.12, 0.08, 0.09]), "ours.load": summarize([0.05])},
                   "info": {"tensors": 1000, "rank_bytes": 2_048_000, "pieces_per_rank": 1000}}}
    by_name = {g["goal"]: g for g in evaluate_goals(io, None)}
    save = by_name["per-tensor cost on save ≤ 0.1 ms (whole save of 1000 tensors ÷ 1000)"]
    load = by_name["per-tensor cost on load ≤ 0.1 ms (whole load of 1000 tensors ÷ 1000)"]
    assert save["value"] == pytest.approx(0.09) and save["met"] is True  # median 0.09 s / 1000
    assert load["value"] == pytest.approx(0.05) and load["met"] is True
    io["tiny"]["summary"]["ours.load"] = summarize([0.15])
    by_name = {g["goal"]: g for g in evaluate_goals(io, None)}
    assert by_name["per-tensor cost on load ≤ 0.1 ms (whole load of 1000 tensors ÷ 1000)"]["met"] is False


@pytest.mark.distributed
def test_quick_mode_smoke(tmp_path):
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "hyper_parallel_dcp.benchmarks", "--quick", "--dense-mib", "8", "--small-count", "20",
           "--small-kib", "32", "--tiny-count", "50", "--bcast-mib", "4", "--bcast-worlds", "2", "--plan-worlds", "64,128",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    for kind in ("dense", "small"):
        s = result["io"][kind]["summary"]
        for case in ("ref.raw_write_fsync", "ref.raw_read_cold", "ref.clone"):
            assert s[case]["n"] == 1 and s[case]["median"] > 0
        for case in ("ours.save", "torch.save", "ours.save_cached_plan", "torch.save_cached_plan"):
            assert s[case]["n"] == 3 and s[case]["median"] > 0  # saves of each kind: 2 * reps + 1
        for case in ("ours.load", "torch.load", "ours.load_resharded", "ref.copy_pieces", "ref.copy_pieces_resharded"):
            assert s[case]["n"] == 3 and s[case]["median"] > 0  # page-cache loads repeat 2 * reps + 1 times
        # ours: three first saves, each by a new writer, then the later ones; torch's first once
        assert s["ours.async_blocking_first"]["n"] == 3 and s["ours.async_blocking"]["n"] == 3
        assert s["torch.async_blocking_first"]["n"] == 1
        info = result["io"][kind]["info"]
        # a same-layout load reads every stored byte once over all ranks (replicated
        # shards read once and broadcast, or once per holder without broadcast)
        expected = sum(2 * math.prod(shape) for _, shape, _ in (
            dense_shapes(8) if kind == "dense" else small_shapes(20, 32)))
        replicated = sum(2 * math.prod(shape) for _, shape, k in dense_shapes(8) if k == "rep") if kind == "dense" else 0
        assert info["bytes_needed"] == expected
        assert info["ours.load.bytes_read"] in (expected, expected + replicated)
    tiny = result["io"]["tiny"]
    assert tiny["info"]["tensors"] == 50 and tiny["summary"]["ours.save"]["median"] > 0
    assert any(g["goal"].startswith("per-tensor cost on save") and g["met"] is not None for g in result["goals"])
    assert [r["world"] for r in result["planning"]["rows"]] == [64, 128, 64, 128]
    assert any(g["goal"].startswith("global save planning") for g in result["goals"])
    assert any(g["goal"].startswith("global load planning with reader assignment") for g in result["goals"])
    for row in result["planning"]["rows"]:
        # a rank receives its own replica groups and readers only, never the world's plans
        assert 0 < row["ours_load_rank_received_bytes"] <= 2 * row["ours_load_rank_own_plan_bytes"]
    # the local tier section: node 1's two ranks restored from their replicas, nothing from the persistent tier
    local = result["local"]["info"]
    assert local["all_exact"] and local["local.persistent_bytes"] == 0
    assert local["local.received_bytes"] >= 2 * local["bytes_per_rank"]
    assert "| goal | measured | met |" in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_throttled_reader_charges_every_byte_it_reads(tmp_path, compression):
    import struct

    import torch

    import hyper_parallel_dcp as hp
    from hyper_parallel_dcp.benchmarks.throttle import ThrottledFileSystemReader

    sd = {"a": torch.arange(4096, dtype=torch.float32).view(64, 64), "b": torch.ones(100, dtype=torch.bfloat16)}
    md = hp.save(sd, checkpoint_id=tmp_path / "ck", no_dist=True, compression=compression)
    bw = SharedBandwidth(tmp_path / "bw", 1e8)
    t0 = __import__("time").time()
    reader = ThrottledFileSystemReader(tmp_path / "ck", bw)
    target = {"a": torch.zeros(64, 64), "b": torch.zeros(100, dtype=torch.bfloat16)}
    hp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["a"], sd["a"]) and torch.equal(target["b"], sd["b"])
    assert reader.bytes_read == (4096 * 4 + 100 * 2 if compression is None else
                                 sum(info.length for info in md.storage_data.values()))
    # the shared link is booked for at least bytes_read / bandwidth after the start
    free_at = struct.unpack("d", (tmp_path / "bw").read_bytes())[0]
    assert free_at - t0 >= reader.bytes_read / 1e8


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_throttled_writer_charges_every_data_file_byte_to_the_link(tmp_path, compression):
    import struct

    import torch

    import hyper_parallel_dcp as hp
    from hyper_parallel_dcp.benchmarks.throttle import ThrottledFileSystemWriter

    if compression:
        pytest.importorskip("zstandard")
    sd = {"a": torch.arange(4096, dtype=torch.float32).view(64, 64), "b": torch.ones(100, dtype=torch.bfloat16),
          "meta": {"step": 3}}
    bw = SharedBandwidth(tmp_path / "bw", 1e8)
    t0 = __import__("time").time()
    md = hp.save(sd, storage_writer=ThrottledFileSystemWriter(tmp_path / "ck", bw), no_dist=True, compression=compression)
    target = {"a": torch.zeros(64, 64), "b": torch.zeros(100, dtype=torch.bfloat16), "meta": {"step": 0}}
    hp.load(target, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert torch.equal(target["a"], sd["a"]) and target["meta"] == {"step": 3}
    free_at = struct.unpack("d", (tmp_path / "bw").read_bytes())[0]
    assert sum(md.files.values()) / 1e8 <= free_at - t0 < sum(md.files.values()) / 1e8 + 0.5


def test_every_planning_goal_of_issue_13_is_a_goal_row():
    def row(layout, world, scale):
        return {"layout": layout, "world": world, "ours_global_save_s": 0.1 * scale, "ours_global_load_s": 0.05 * scale,
                "ours_load_received_over_own_plan": 0.2, "ours_metadata_json_bytes": 30 * scale,
                "torch_metadata_pickle_bytes": 100 * scale, "ours_metadata_parse_s": 0.01 * scale}

    rows = [row(layout, w, w / 1024) for layout in ("dense", "moe") for w in (1024, 8192)]
    rows.append(row("moe", 16384, 16))
    del rows[-1]["torch_metadata_pickle_bytes"]  # torch runs only its global save there
    planning = {"rows": rows, "exponents": {f"{lay}.{k}": 1.0 for lay in ("dense", "moe")
                                            for k in ("ours_global_save_s", "ours_global_load_s")}}
    by_name = {g["goal"]: g for g in evaluate_goals({}, planning)}
    for layout in ("dense", "moe"):
        expected = {
            f"global save planning ({layout}) at 8192 simulated ranks < 2 s": 0.8,
            f"global load planning with reader assignment ({layout}) at 8192 simulated ranks < 2 s": 0.4,
            f"a rank receives ≤ 2× its own final load plan ({layout}, 8192 simulated ranks)": 0.2,
            f"metadata ≤ 0.5× torch's pickle ({layout}, 8192 simulated ranks)": 0.3,
            f"metadata parsed < 1 s ({layout}, 8192 simulated ranks)": 0.08,
        }
        for name, value in expected.items():
            assert by_name[name]["value"] == pytest.approx(value) and by_name[name]["met"] is True, name
        growth = [g for g in by_name.values() if g["goal"].startswith(("global save planning", "global load planning"))
                  and f"({layout}) grows no worse than n·log n" in g["goal"]]
        assert len(growth) == 2 and all(g["met"] is True for g in growth)
    moe_8192 = rows[3]
    assert (moe_8192["layout"], moe_8192["world"]) == ("moe", 8192)
    moe_8192["ours_global_save_s"] = 2.5
    moe_8192["ours_metadata_json_bytes"] = 60 * 8
    by_name = {g["goal"]: g for g in evaluate_goals({}, planning)}
    assert by_name["global save planning (moe) at 8192 simulated ranks < 2 s"]["met"] is False
    assert by_name["metadata ≤ 0.5× torch's pickle (moe, 8192 simulated ranks)"]["met"] is False


@pytest.mark.parametrize("flip", [False, True])
def test_memory_copy_reference_copies_exactly_what_a_load_copies(flip):
    """The pieces of the in-memory copy reference, copied from the saved chunks' values,
    assemble each rank's tensors of the (resharded) target layout."""
    from hyper_parallel_dcp.benchmarks.io_bench import _load_pieces
    from hyper_parallel_dcp.benchmarks.state_dicts import _placements
    from hyper_parallel_dcp.core.layout import placement_boxes

    world = 2
    shapes = dense_shapes(1, hidden=16, vocab=40)
    full = {fqn: torch.arange(math.prod(shape), dtype=torch.float32).view(shape).to(torch.bfloat16)
            for fqn, shape, _ in shapes}
    # the saved chunks hold the saved layout's slices of the global tensors
    stand_ins = {}
    for fqn, shape, kind in shapes:
        for j in range(world):
            box = placement_boxes(shape, (world,), (j,), _placements(kind, len(shape), False), fqn)[0][0]
            stand_ins[(fqn, box.offsets)] = full[fqn][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
    saved_chunks = len(stand_ins)
    for rank in range(world):
        boxes = {fqn: placement_boxes(shape, (world,), (rank,), _placements(kind, len(shape), flip), fqn)[0][0]
                 for fqn, shape, kind in shapes}
        dest = {fqn: torch.zeros(boxes[fqn].sizes, dtype=torch.bfloat16) for fqn, _, _ in shapes}
        pieces = _load_pieces(shapes, dest, world, rank, flip, stand_ins)
        for d, src in pieces:
            d.copy_(src)
        for fqn, _, _ in shapes:
            box = boxes[fqn]
            expect = full[fqn][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
            assert torch.equal(dest[fqn], expect), (rank, fqn)
        # same layout: one piece a tensor; resharded: a 2-D sharded tensor takes a piece of each saved chunk
        two_d = sum(1 for _, shape, kind in shapes if kind != "rep")
        assert len(pieces) == len(shapes) + (two_d if flip else 0)
    assert len(stand_ins) == saved_chunks  # nothing made up: every piece came from a saved chunk


def test_resharded_goal_shows_the_memory_copy_ratio_beside_it():
    io = {"dense": {"summary": {"ours.load": summarize([1.0]), "ours.load_resharded": summarize([1.5]),
                                "ref.copy_pieces": summarize([0.2]), "ref.copy_pieces_resharded": summarize([0.28])},
                    "info": {"rank_bytes": 10, "pieces_per_rank": 1}}}
    row = {g["goal"]: g for g in evaluate_goals(io, None)}["dense: resharded load Shard(0)→Shard(1) ≤ 1.3× same-layout load"]
    assert row["met"] is False and row["value"] == pytest.approx(1.5)
    assert row["measured"] == "1.50× (the same copies from memory: 1.40×)"


def test_plan_cache_goal_wants_the_warm_save_strictly_faster():
    name = "dense: save with a warm plan cache < a save with the cache cleared"
    io = {"dense": {"summary": {"ours.save": summarize([0.17, 0.16, 0.18]),
                                "ours.save_cached_plan": summarize([0.15, 0.16, 0.15])},
                    "info": {"rank_bytes": 10, "pieces_per_rank": 1}}}
    row = {g["goal"]: g for g in evaluate_goals(io, None)}[name]
    assert row["met"] is True and row["value"] == pytest.approx(0.15 / 0.17)
    io["dense"]["summary"]["ours.save_cached_plan"] = summarize([0.17])
    row = {g["goal"]: g for g in evaluate_goals(io, None)}[name]
    assert row["met"] is False and row["value"] == pytest.approx(1.0)  # as fast is not faster
    io["small"] = io.pop("dense")
    assert not any("plan cache" in g["goal"] for g in evaluate_goals(io, None))  # the goal is the dense one


def test_incremental_section_counts_the_bytes_it_wrote(tmp_path):
    from hyper_parallel_dcp.benchmarks.incremental_bench import incremental_goals, run_incremental
    from hyper_parallel_dcp.benchmarks.report import _incremental_lines

    inc = run_incremental(tmp_path / "inc", 8, 1, lambda msg: None, large_mib=16)
    assert inc["bit_exact"] and 0 < inc["changed_bytes"] <= 0.02 * inc["total_bytes"]
    # the changed tensors' data plus one safetensors header and the .metadata, nothing else
    assert inc["changed_bytes"] < inc["written_bytes"] <= 1.05 * inc["changed_bytes"] + 64 * 1024
    assert [g["limit"] for g in incremental_goals(inc)] == [1.05, 0.1, 0.1]
    assert "(16 MiB row)" in incremental_goals(inc)[2]["goal"] and inc["large"]["total_bytes"] > inc["total_bytes"]
    text = "\n".join(_incremental_lines(inc))
    assert "| 8 MiB | incremental |" in text and "| 16 MiB | changed_only |" in text


def test_compression_section_round_trips_every_codec(tmp_path):
    from hyper_parallel_dcp.benchmarks.compression_bench import run_compression
    from hyper_parallel_dcp.benchmarks.report import _compression_lines

    c = run_compression(64, 2, 1, lambda msg: None, tmp_path / "c", cap_mb_s=2000.0)
    assert [(r["data"], r["codec"]) for r in c["rows"]] == [
        (data, codec) for data in ("bf16 weights", "fp32 Adam moments")
        for codec in ("byte-planes+zstd", "zstd (torch DCP)", "zipnn")]
    assert all(r["bit_exact"] and 0 < r["share"] < 1.05 for r in c["rows"]), c["rows"]
    assert c["rows"][0]["raw_bytes"] == sum(2 * n for n in (64 * 256, 256, 256 * 64, 64, 64, 64, 64 * 64, 64))
    t = c["throttled"]
    assert t["plain"]["bit_exact"] and t["zstd"]["bit_exact"] and t["zstd"]["bytes"] < t["plain"]["bytes"]
    assert "| bf16 weights | zipnn |" in "\n".join(_compression_lines(c))
