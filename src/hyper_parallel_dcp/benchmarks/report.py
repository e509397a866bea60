"""Turn raw timings into figures, goal verdicts, a markdown table and PNG plots."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from .io_bench import FIRST_ASYNC_SAVES, async_reps, load_reps, save_reps

__all__ = ["evaluate_goals", "nlogn_exponent", "summarize", "write_markdown", "write_plots"]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of repeated timings (seconds)."""
    if not values:
        raise ValueError("summarize needs at least one value")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def nlogn_exponent(worlds: Sequence[int]) -> float:
    """The exponent a pure ``n·log n`` curve shows when fitted over ``worlds``."""
    from .planning_sim import fit_exponent

    return fit_exponent(worlds, [w * math.log(w) for w in worlds])


def _med(io: dict, key: str) -> Optional[float]:
    entry = io.get(key)
    return None if entry is None else entry["median"]


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def _per_tensor_ms(tiny: dict, key: str) -> Optional[float]:
    """Whole save or load time of the per-tensor case ÷ its tensors (ms), every overhead
    included: planning, collectives, the commit, the fsyncs."""
    t = _med(tiny["summary"], key)
    return None if t is None else 1000.0 * t / tiny["info"]["tensors"]


def evaluate_goals(io: dict[str, Any], planning: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each performance goal of the project with its measured figure and met / not met."""
    goals: list[dict[str, Any]] = []

    def goal(name: str, value: Optional[float], limit: float, fmt: str, higher_is_better: bool = False,
             strict: bool = False) -> None:
        if value is None:
            goals.append({"goal": name, "measured": "not measured", "met": None})
            return
        met = value >= limit if higher_is_better else value < limit if strict else value <= limit
        goals.append({"goal": name, "measured": fmt.format(value), "value": value, "limit": limit, "met": met})

    for kind, save_limit, load_limit in (("dense", 1.1, 2.0), ("small", 1.3, 4.0)):
        d = io.get(kind)
        if d is None:
            continue
        s = d["summary"]
        goal(f"{kind}: save ≤ {save_limit}× raw write+fsync", _ratio(_med(s, "ours.save"), _med(s, "ref.raw_write_fsync")),
             save_limit, "{:.2f}×")
        if kind == "dense":
            goal(f"{kind}: save with a warm plan cache < a save with the cache cleared",
                 _ratio(_med(s, "ours.save_cached_plan"), _med(s, "ours.save")), 1.0, "{:.2f}×", strict=True)
        goal(f"{kind}: load ≥ {load_limit}× faster than torch (page cache)",
             _ratio(_med(s, "torch.load"), _med(s, "ours.load")), load_limit, "{:.2f}×", True)
        floor = _ratio(_med(s, "ref.copy_pieces_resharded"), _med(s, "ref.copy_pieces"))
        goal(f"{kind}: resharded load Shard(0)→Shard(1) ≤ 1.3× same-layout load",
             _ratio(_med(s, "ours.load_resharded"), _med(s, "ours.load")), 1.3,
             "{:.2f}×" + ("" if floor is None else f" (the same copies from memory: {floor:.2f}×)"))
        for case in ("save", "load"):
            goal(f"{kind}: torch's {case} through the torch_compat plugin ≤ 1.1× our {case}",
                 _ratio(_med(s, "plugin." + case), _med(s, "ours." + case)), 1.1, "{:.2f}×")
        needed = d["info"].get("bytes_needed")
        capped = d["info"].get("ours.load_resharded_capped.bytes_read")
        goal(f"{kind}: resharded load under the storage cap reads ≤ 1.05× the needed bytes",
             _ratio(capped, needed), 1.05, "{:.3f}×")
        goal(f"{kind}: resharded load under the storage cap ≤ 1.3× same-layout load",
             _ratio(_med(s, "ours.load_resharded_capped"), _med(s, "ours.load_capped")), 1.3, "{:.2f}×")
        goal(f"{kind}: async blocking (first save) ≤ 1.3× fresh host copy",
             _ratio(_med(s, "ours.async_blocking_first"), _med(s, "ref.clone")), 1.3, "{:.2f}×")
        goal(f"{kind}: async blocking (later saves) ≤ 2× copy into preallocated buffers",
             _ratio(_med(s, "ours.async_blocking"), _med(s, "ref.copy_into_prealloc")), 2.0, "{:.2f}×")
        goal(f"{kind}: async time to landed (later saves) ≤ torch's async_save",
             _ratio(_med(s, "ours.async_landed"), _med(s, "torch.async_landed")), 1.0, "{:.2f}×")
    tiny = io.get("tiny")
    if tiny is not None:
        n = tiny["info"]["tensors"]
        goal(f"per-tensor cost on save ≤ 0.1 ms (whole save of {n} tensors ÷ {n})",
             _per_tensor_ms(tiny, "ours.save"), 0.1, "{:.3f} ms")
        goal(f"per-tensor cost on load ≤ 0.1 ms (whole load of {n} tensors ÷ {n})",
             _per_tensor_ms(tiny, "ours.load"), 0.1, "{:.3f} ms")
    if planning and planning.get("rows"):
        rows = planning["rows"]
        worlds_run = {r["world"] for r in rows}
        at = 8192 if 8192 in worlds_run else max(worlds_run)
        for layout in sorted({r["layout"] for r in rows}):
            row: dict[str, Any] = next((r for r in rows if r["layout"] == layout and r["world"] == at), {})
            goal(f"global save planning ({layout}) at {at} simulated ranks < 2 s",
                 row.get("ours_global_save_s"), 2.0, "{:.2f} s")
            goal(f"global load planning with reader assignment ({layout}) at {at} simulated ranks < 2 s",
                 row.get("ours_global_load_s"), 2.0, "{:.2f} s")
            goal(f"a rank receives ≤ 2× its own final load plan ({layout}, {at} simulated ranks)",
                 row.get("ours_load_received_over_own_plan"), 2.0, "{:.2f}×")
            goal(f"metadata ≤ 0.5× torch's pickle ({layout}, {at} simulated ranks)",
                 _ratio(row.get("ours_metadata_json_bytes"), row.get("torch_metadata_pickle_bytes")), 0.5, "{:.2f}×")
            goal(f"metadata parsed < 1 s ({layout}, {at} simulated ranks)", row.get("ours_metadata_parse_s"), 1.0,
                 "{:.2f} s")
            worlds = sorted({r["world"] for r in rows if r["layout"] == layout})
            if len(worlds) >= 2:
                limit = nlogn_exponent(worlds)
                for key, what in (("ours_global_save_s", "global save planning"),
                                  ("ours_global_load_s", "global load planning")):
                    goal(f"{what} ({layout}) grows no worse than n·log n (fitted exponent ≤ {limit:.2f})",
                         planning["exponents"].get(f"{layout}.{key}"), limit, "{:.2f}")
    return goals


_ROWS = [
    ("ref.raw_write_fsync", "raw write + fsync (rank's bytes)"),
    ("ref.raw_read_page_cache", "raw read, page cache"),
    ("ref.raw_read_cold", "raw read, cold (fadvise DONTNEED)"),
    ("ref.clone", "host copy: clone"),
    ("ref.copy_into_prealloc", "host copy: into preallocated"),
    ("ref.copy_pieces", "memory copy of what a same-layout load copies"),
    ("ref.copy_pieces_resharded", "memory copy of what a Shard(0)→Shard(1) load copies"),
    ("save", "save"),
    ("save_cached_plan", "save, plan cache warm"),
    ("load", "load, same layout (page cache)"),
    ("load_cold", "load, same layout (cold)"),
    ("load_resharded", "load, Shard(0)→Shard(1)"),
    ("load_capped", "load, same layout, under the storage cap"),
    ("load_resharded_capped", "load, Shard(0)→Shard(1), under the storage cap (chunks exchanged)"),
    ("load_n_to_1", "load, world N→1 (rank 0 loads all)"),
    ("async_blocking_first", "async save: blocking, first"),
    ("async_blocking", "async save: blocking, later"),
    ("async_landed_first", "async save: landed, first (ours: writer started ahead by start_writer())"),
    ("async_landed", "async save: landed, later"),
]


def _fmt(entry: Optional[dict]) -> str:
    if entry is None:
        return "—"
    return f"{entry['median']:.3f} ({entry['min']:.3f}–{entry['max']:.3f})"


def write_markdown(path: Path, result: dict[str, Any]) -> None:
    """The human-readable results page: header, goals, then one section per benchmark run."""
    lines = _header_lines(result) + _goal_lines(result["goals"])
    for kind, d in result["io"].items():
        lines += _io_lines(kind, d)
    if result.get("broadcast"):
        lines += _broadcast_lines(result["broadcast"])
    if result.get("local"):
        from .local_bench import local_lines

        lines += local_lines(result["local"])
    if result.get("convert"):
        lines += _convert_lines(result["convert"])
    if result.get("incremental"):
        lines += _incremental_lines(result["incremental"])
    if result.get("compression"):
        lines += _compression_lines(result["compression"])
    if result.get("planning"):
        lines += _planning_lines(result["planning"])
    # the plots that write_plots draws for the sections that ran (a page must not link a
    # picture that is not there: the docs build is strict)
    if result["io"]:
        lines += ["", "![save and load](bench_io.png)"]
    if (result.get("planning") or {}).get("rows"):
        lines += ["", "![planning](bench_planning.png)"]
    lines.append("")
    path.write_text("\n".join(lines))


def _header_lines(result: dict[str, Any]) -> list[str]:
    return [
        "# Benchmarks: hyper-parallel-dcp vs torch.distributed.checkpoint",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']}",
        *([f"- save writes end on {result['save_writes']} boundaries (page-cache folios of that size)"]
          if "save_writes" in result else []),
        f"- torch {result['versions']['torch']}, python {result['versions']['python']}",
        f"- sizes: dense {result['config']['dense_mib']} MiB, {result['config']['small_count']} small tensors of "
        f"{result['config']['small_kib']} KiB, per-tensor case {result['config'].get('tiny_count', 0)} tensors of "
        f"{result['config'].get('tiny_kib', 0)} KiB, broadcast {result['config']['bcast_mib']} MiB at "
        f"{result['config']['cap_mb_s']} MB/s shared cap (a link charged by bytes, not by read calls)",
        f"- repetitions: {result['config']['reps']} (page-cache loads and their memory copies: "
        f"{load_reps(result['config']['reps'])}, each library's in a block of its own after one untimed load of "
        f"each layout; saves with the plan cache cleared and warm: {save_reps(result['config']['reps'])} of each, "
        "interleaved; cold loads, N→1: "
        f"{result['config'].get('reps_secondary', result['config']['reps'])}; async: torch's first save and ours "
        f"{FIRST_ASYNC_SAVES} times, each by a new writer, then "
        f"{async_reps(result['config'].get('reps_secondary', result['config']['reps']))} later saves); "
        "times in seconds, median (min–max); "
        "every case timed between barriers (slowest rank).",
        "",
        "Reproduce: `python -m hyper_parallel_dcp.benchmarks` (default sizes, < 10 min on 2 cores), "
        "`--quick` (smoke test), `--full` (1 GiB / 2000 × 0.5 MiB, 5 repetitions), or set sizes with "
        "`--dense-mib`, `--small-count`, `--small-kib`, `--tiny-count`, `--tiny-kib`, `--world`, `--plan-worlds`; "
        "`--help` lists all. "
        "`nox -s bench` runs the default.",
        "",
    ]


def _goal_lines(goals: list[dict[str, Any]]) -> list[str]:
    lines = ["## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    for g in goals:
        met = {True: "met", False: "**not met**", None: "not measured"}[g["met"]]
        lines.append(f"| {g['goal']} | {g['measured']} | {met} |")
    return lines


#: the reference each of our cases is compared with in the io tables
_REFERENCE_OF = {"save": "ref.raw_write_fsync", "save_cached_plan": "ref.raw_write_fsync",
                 "load": "ref.raw_read_page_cache", "load_resharded": "ref.raw_read_page_cache",
                 "load_cold": "ref.raw_read_cold", "async_blocking_first": "ref.clone",
                 "async_blocking": "ref.copy_into_prealloc", "async_landed_first": "torch.async_landed_first",
                 "async_landed": "torch.async_landed", "load_resharded_capped": "ours.load_capped"}


def _io_lines(kind: str, d: dict[str, Any]) -> list[str]:
    info = d["info"]
    lines = ["", f"## State dict `{kind}` — world {d['world']}, {info['tensors']} tensors, "
             f"{info['global_bytes'] / 2**20:.0f} MiB bf16, {info['rank_bytes'] / 2**20:.0f} MiB written per rank", "",
             "| case | hyper-parallel-dcp | torch.distributed.checkpoint | ours / reference |", "|---|---|---|---|"]
    s = d["summary"]
    for key, label in _ROWS:
        if key.startswith("ref."):
            lines.append(f"| {label} | {_fmt(s.get(key))} | | |")
            continue
        o, t = s.get("ours." + key), s.get("torch." + key)
        refkey = _REFERENCE_OF.get(key)
        r = _ratio(_med(s, "ours." + key), _med(s, refkey)) if refkey else None
        ours_cell = _fmt(o) if o else str(info.get("ours." + key.split("_")[0], "—"))
        lines.append(f"| {label} | {ours_cell} | {_fmt(t)} | {'' if r is None else f'{r:.2f}×'} |")
    if "plugin.save" in s:
        lines += ["", "torch's `save` / `load` with the `torch_compat` plugin (our format, torch's planners):", "",
                  "| case | plugin | hyper-parallel-dcp | torch FileSystemWriter/Reader | plugin / ours |",
                  "|---|---|---|---|---|"]
        for label, mine, key in (("save", "plugin.save", "save"), ("save, torch's plan cache on, GC paused "
                                 "(the integrations')", "plugin.save_cached_plan", "save_cached_plan"),
                                 ("load", "plugin.load", "load"), ("load, GC paused (the integrations')",
                                 "plugin_gc_paused.load", "load"), ("load_resharded", "plugin.load_resharded",
                                 "load_resharded")):
            r = _ratio(_med(s, mine), _med(s, "ours." + key))
            lines.append(f"| {label} | {_fmt(s.get(mine))} | {_fmt(s.get('ours.' + key))} | "
                         f"{_fmt(s.get('torch.' + key))} | {'' if r is None else f'{r:.2f}×'} |")
    lines.append("")
    lines.append(f"Bytes read from storage by all ranks vs the checkpoint's bytes: same layout "
                 f"{info.get('ours.load.bytes_read', 0):,} vs {info.get('bytes_needed', 0):,}; "
                 f"Shard(0)→Shard(1): {info.get('ours.load_resharded.bytes_read', 0):,} (from the page cache, which the "
                 "ranks of one host share: each reads its column slices itself); under the storage cap, same layout "
                 f"{info.get('ours.load_capped.bytes_read', 0):,}, Shard(0)→Shard(1) "
                 f"{info.get('ours.load_resharded_capped.bytes_read', 0):,} (each stored chunk read once, by one rank).")
    for note in d.get("notes", []):
        lines.append(f"\n{note}")
    return lines


def _broadcast_lines(b: dict[str, Any]) -> list[str]:
    lines = ["", "## Read-once + broadcast under a shared storage bandwidth cap", "",
             f"Cap: {b['cap_mb_s']} MB/s shared by all readers; every rank loads the whole "
             f"{b['mib']} MiB replicated state dict.", "",
             "| replication (world) | without broadcast | with broadcast | bytes read by rank 0 (without / with) |",
             "|---|---|---|---|"]
    for world, d in sorted(b["runs"].items()):
        s, info = d["summary"], d["info"]
        with_b = _fmt(s.get("ours.load_broadcast")) if "ours.load_broadcast" in s else info.get(
            "ours.load_broadcast", "—")
        lines.append(f"| {world} | {_fmt(s.get('ours.load_no_broadcast'))} | {with_b} | "
                     f"{info.get('ours.load_no_broadcast.bytes_read', 0):,} / "
                     f"{info.get('ours.load_broadcast.bytes_read', '—')} |")
    return lines


def _convert_lines(c: dict[str, Any]) -> list[str]:
    lines = ["", "## Hugging Face conversion (one process)", ""]
    if "status" in c:
        lines.append(c["status"])
    else:
        lines += ["| case | seconds | ratio to raw read+write |", "|---|---|---|"]
        for key in ("hf_to_dcp", "dcp_to_hf", "ref.raw_read_write"):
            e = c["summary"].get(key)
            r = _ratio(_med(c["summary"], key), _med(c["summary"], "ref.raw_read_write"))
            lines.append(f"| {key} | {_fmt(e)} | {'' if r is None else f'{r:.2f}×'} |")
    return lines


def _incremental_lines(inc: dict[str, Any]) -> list[str]:
    """The section of ``incremental_bench``: one table row per save and size."""
    lines = ["", "## Incremental save (frozen base, 2 % changed; one process)", "",
             "| model | save | seconds (median, min-max) | × full | bytes written |", "|---|---|---|---|---|"]
    for row in (inc, inc.get("large")):
        if not row:
            continue
        s, mib = row["summary"], f"{row['mib']:g} MiB"
        written = {"full": f"{row['total_bytes']} model bytes",
                   "incremental": f"{row['written_bytes']} ({row['written_over_changed']:.3f}x the "
                                  f"{row['changed_bytes']} changed)",
                   "changed_only": f"{row['changed_bytes']} changed bytes, no references (the floor)"}
        for key, what in written.items():
            e = s[key]
            lines.append(f"| {mib} | {key} | {e['median']:.3f} ({e['min']:.3f}-{e['max']:.3f}) | "
                         f"{e['median'] / s['full']['median']:.3f}× | {what} |")
    lines += ["", f"The load of the incremental checkpoint is {'bit-exact' if inc['bit_exact'] else 'NOT bit-exact'}. "
              "`changed_only` is a full save of the changed tensors alone: the same bytes, the fsyncs and metadata "
              "every save pays, no hashing."]
    return lines


def _compression_lines(c: dict[str, Any]) -> list[str]:
    """The section of ``compression_bench``."""
    lines = ["", "## Lossless compression of trained state (one process)", ""]
    if "status" in c:
        return lines + [c["status"]]
    lines += [f"An MLP of hidden size {c['hidden']} after {c['steps']} Adam steps; {c['threads']} threads.", "",
              "| data | codec | compressed share | compress MB/s | decompress MB/s | bit-exact |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['data']} | {r['codec']} | {100 * r['share']:.1f} % | {r['compress_mb_s']:.0f} | "
              f"{r['decompress_mb_s']:.0f} | {'yes' if r['bit_exact'] else 'NO'} |" for r in c["rows"]]
    t = c.get("throttled")
    if t:
        lines += ["", f"The trained state as a checkpoint under a {t['cap_mb_s']:g} MB/s shared cap:", "",
                  "| checkpoint | bytes | save s | load s |", "|---|---|---|---|"]
        lines += [f"| {k} | {t[k]['bytes']} | {t[k]['save_s']:.3f} | {t[k]['load_s']:.3f} |" for k in ("plain", "zstd")]
        lines += ["", f"Compressed vs plain: save {t['save_speedup']:.2f}x, load {t['load_speedup']:.2f}x as fast."]
    return lines


def _planning_lines(p: dict[str, Any]) -> list[str]:
    lines = ["", "## Planning at scale (simulated, one process)", "",
             "CPU seconds of the planning process (`time.process_time`). "
             "Global save planning = dedup + metadata build on the coordinator over the gathered plans, which "
             "travel as columns (unpickling them is measured apart: `ours_save_gather_unpickle_s` in the JSON) "
             "(torch: `_dedup_save_plans` + "
             "`create_default_global_save_plan` + `_validate_global_plan`). Local load plan = one rank's plan "
             "for a resharded target (slowest of a sample of ranks). Global load = the coordinator's reader "
             "assignment over every rank's target description (median of 3 runs; the rest are one run). Rank receives = the largest answer a sampled "
             "rank receives in the load's planning collectives, and its ratio to that rank's own final plan. "
             "Metadata: our JSON with storage entries; torch's pickle. — : not run (above 8192 simulated ranks "
             "torch runs only its global save; its overlap validation is projected from the seconds per chunk "
             "pair at a smaller world once that passes the budget). torch's plans share one object per chunk "
             "among replicas (cheaper to build; it makes torch's dedup faster than after a real gather).", "",
             "| layout | world | items | stored chunks | ours global save (s) | torch global save (s) "
             "| ours global load (s) | ours local load (s) | torch local load (s) | rank receives (KB) "
             "| ÷ own plan | ours metadata (MB) | torch metadata (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r: dict, k: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        return fmt.format(r[k] / scale) if k in r else "—"

    for r in p["rows"]:
        lines.append(
            f"| {r['layout']} | {r['world']} | {r['items_total']:,} | {r['chunks_stored']:,} | "
            f"{cell(r, 'ours_global_save_s')} | {cell(r, 'torch_global_save_s')} | "
            f"{cell(r, 'ours_global_load_s')} | "
            f"{cell(r, 'ours_local_load_plan_s')} | {cell(r, 'torch_local_load_plan_s')} | "
            f"{cell(r, 'ours_load_rank_received_bytes', 1e3, '{:.1f}')} | "
            f"{cell(r, 'ours_load_received_over_own_plan', 1.0, '{:.2f}')} | "
            f"{cell(r, 'ours_metadata_json_bytes', 1e6, '{:.1f}')} | "
            f"{cell(r, 'torch_metadata_pickle_bytes', 1e6, '{:.1f}')} |")
    lines += ["", "Fitted exponents (time ∝ world^k):", ""]
    for k, v in sorted(p["exponents"].items()):
        lines.append(f"- `{k}`: {v:.2f}")
    return lines


def write_plots(out_dir: Path, result: dict[str, Any]) -> list[str]:
    """``bench_io.png`` (bars, ratio to references) and ``bench_planning.png`` (log-log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    if result["io"]:
        _plot_io(plt, out_dir, result["io"])
        written.append("bench_io.png")
    p = result.get("planning")
    if p and p.get("rows"):
        _plot_planning(plt, out_dir, p)
        written.append("bench_planning.png")
    return written


def _plot_io(plt: Any, out_dir: Path, io: dict[str, Any]) -> None:
    """Bars of our and torch's median times per case, min–max whiskers, reference lines."""
    cases = ["save", "save_cached_plan", "load", "load_cold", "load_resharded", "load_n_to_1", "async_blocking"]
    kinds = list(io)
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        s = io[kind]["summary"]
        xs = range(len(cases))
        for off, lib in ((-0.2, "ours"), (0.2, "torch")):
            meds = [(_med(s, f"{lib}.{c}") or 0.0) for c in cases]
            lo = [m - (s[f"{lib}.{c}"]["min"] if f"{lib}.{c}" in s else 0.0) for m, c in zip(meds, cases)]
            hi = [(s[f"{lib}.{c}"]["max"] if f"{lib}.{c}" in s else 0.0) - m for m, c in zip(meds, cases)]
            ax.bar([x + off for x in xs], meds, width=0.4, yerr=[lo, hi],
                   label="hyper-parallel-dcp" if lib == "ours" else "torch DCP")
        for key, style in (("ref.raw_write_fsync", "--"), ("ref.raw_read_page_cache", ":")):
            if key in s:
                ax.axhline(s[key]["median"], linestyle=style, color="gray", label=key[4:])
        ax.set_xticks(list(xs))
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("seconds (median, min–max)")
        ax.set_title(kind)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "bench_io.png", dpi=100)
    plt.close(fig)


def _plot_planning(plt: Any, out_dir: Path, p: dict[str, Any]) -> None:
    """Global save planning time against the simulated world size, log-log."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for layout in sorted({r["layout"] for r in p["rows"]}):
        rows = [r for r in p["rows"] if r["layout"] == layout]
        for key, style in (("ours_global_save_s", "-o"), ("torch_global_save_s", "--s")):
            pts = [(r["world"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], style,
                        label=f"{layout} {'ours' if key.startswith('ours') else 'torch'}")
    ax.axhline(2.0, color="gray", linestyle=":", label="goal 2 s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("simulated world size")
    ax.set_ylabel("global save planning (s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "bench_planning.png", dpi=100)
    plt.close(fig)
