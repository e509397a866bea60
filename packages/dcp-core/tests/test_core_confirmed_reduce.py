"""``DistWrapper.all_reduce_confirmed`` on real gloo ranks: the order of its steps, and a
failure in any of them raised on every rank, naming the rank, without the reduce."""

from __future__ import annotations

import pytest

from hyper_parallel_dcp.core.collectives import DistWrapper
from hyper_parallel_dcp.core.testing import run_distributed

pytestmark = pytest.mark.distributed


def _steps(rank: int, world_size: int, fail_in: str, fail_rank: int) -> dict:
    dw = DistWrapper(None, use_dist=True)
    log: list[str] = []

    def step(name: str, value=None):  # type: ignore[no-untyped-def]
        log.append(name)
        if name == fail_in and rank == fail_rank:
            raise OSError(f"{name} broke on rank {rank}")
        return value

    try:
        out = dw.all_reduce_confirmed(
            "write",
            lambda: step("map", 10 * rank + 1),
            lambda results: step("prepare", sum(results)),
            lambda: step("confirm"),
            lambda prepared: step("reduce"),
        )
        return {"log": log, "out": out}
    except OSError as exc:
        return {"log": log, "error": str(exc)}


def test_steps_run_in_order_and_every_rank_gets_the_result() -> None:
    results = run_distributed(_steps, 3, "", -1, timeout=120)
    assert results[0]["log"] == ["map", "prepare", "confirm", "reduce"]
    assert results[1]["log"] == results[2]["log"] == ["map", "confirm"]
    assert all(r["out"] == 1 + 11 + 21 for r in results)  # the prepared value, shared


@pytest.mark.parametrize(("fail_in", "fail_rank"), [("map", 2), ("prepare", 0), ("confirm", 1), ("reduce", 0)])
def test_a_failure_is_raised_everywhere_after_every_confirmation(fail_in: str, fail_rank: int) -> None:
    results = run_distributed(_steps, 3, fail_in, fail_rank, timeout=120)
    for rank, r in enumerate(results):
        assert f"phase 'write' failed on rank(s) {fail_rank}" in r["error"], (rank, r)
        assert f"{fail_in} broke on rank {fail_rank}" in r["error"]
        assert "confirm" in r["log"]  # every rank confirms (its flushes end) before the error
        # nothing commits after a failure: the reduce runs (on the coordinator) only when it is the step that fails
        assert ("reduce" in r["log"]) == (fail_in == "reduce" and rank == 0)
    if fail_in == "map":  # the coordinator prepares nothing from incomplete results
        assert "prepare" not in results[0]["log"]


def test_without_a_group_the_steps_run_in_order() -> None:
    log: list[str] = []
    dw = DistWrapper(None, use_dist=False)
    out = dw.all_reduce_confirmed("write", lambda: log.append("map") or 1, lambda xs: log.append("prepare") or xs,
                                  lambda: log.append("confirm"), lambda p: log.append("reduce"))
    assert out == [1] and log == ["map", "prepare", "confirm", "reduce"]
