"""``benchmarks.compat_bench``: the io benchmark's plugin rows and torch's planners, on 2 gloo ranks."""

from __future__ import annotations

import pytest

from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed


def test_compat_worker_times_every_row(tmp_path):
    from hyper_parallel_dcp.benchmarks.compat_bench import compat_worker

    cfg = {"kind": "small", "dense_mib": 1, "count": 20, "kib": 8, "reps": 1, "root": str(tmp_path)}
    times = run_distributed(compat_worker, 2, cfg, timeout=300)[0]
    runs = {name: len(values) for name, values in times.items()}
    assert runs == {**{f"{who}.{case}": 3 for who in ("ours", "torch", "plugin")
                       for case in ("save", "load", "load_resharded")},
                    "ours.save_cached_plan": 3, "torch.save_cached_plan": 3, "plugin.save_cached_plan": 2,
                    "plugin_gc_paused.load": 3, **{f"{who}_planner.{case}": 3 for who in ("torch", "ours")
                                                        for case in ("save", "load")}}
    assert all(0 < t < 60 for values in times.values() for t in values)  # our planning phases were logged
    assert not any(tmp_path.iterdir())  # the checkpoints are removed
