"""The collective wrapper without a process group, and how remote failures are re-raised."""

from __future__ import annotations

import pickle

import pytest

from hyper_parallel_dcp.core.collectives import DistWrapper, _Failure, _raise_failures
from hyper_parallel_dcp.core.errors import CheckpointException, MismatchError, describe_failures, format_ranks


def test_without_a_group_every_step_runs_locally():
    dw = DistWrapper(None, use_dist=True)  # no process group initialised: a no-op wrapper
    assert not dw.use_dist and (dw.rank, dw.world_size) == (0, 1)
    assert dw.all_gather("plan", lambda: 7) == [7]
    assert dw.reduce_scatter("plan", lambda: 3, lambda xs: [sum(xs) * 10]) == 30
    assert dw.all_reduce("write", lambda: 2, lambda xs: xs + ["done"]) == [2, "done"]
    assert dw.all_gather_object("x") == ["x"] and dw.broadcast_object("y") == "y"
    dw.check("read", None)
    dw.barrier()


def test_without_a_group_the_original_exception_comes_through():
    dw = DistWrapper(None, use_dist=False)
    with pytest.raises(MismatchError, match="'w'"):
        dw.all_gather("plan", lambda: (_ for _ in ()).throw(MismatchError("'w': shape")))
    with pytest.raises(KeyError):
        dw.check("read", KeyError("gone"))


def _capture(exc: BaseException) -> _Failure:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return _Failure.capture(caught)


def test_remote_failures_are_raised_as_their_class_naming_every_rank():
    failures = {3: _capture(KeyError("'layer.w' missing")), 1: _capture(MismatchError("'b': dtype mismatch"))}
    failures = pickle.loads(pickle.dumps(failures))  # they travel between processes
    with pytest.raises(CheckpointException) as info:
        _raise_failures("plan", failures)
    exc = info.value
    # the lowest failing rank's class is kept, so `except MismatchError` still works
    assert isinstance(exc, MismatchError)
    text = str(exc)
    assert "phase 'plan' failed on rank(s) 1, 3" in text
    assert "[rank 1] MismatchError: 'b': dtype mismatch" in text and "[rank 3] KeyError" in text
    assert set(exc.remote_tracebacks) == {1, 3} and "Traceback" in exc.remote_tracebacks[1]
    # it crosses processes too (the async writer process ships its errors back), class kept
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, CheckpointException) and isinstance(back, MismatchError)
    assert str(back) == text and back.failures.keys() == {1, 3}
    assert back.remote_tracebacks == exc.remote_tracebacks
    plain = pickle.loads(pickle.dumps(CheckpointException("read", {0: "OSError: disk"})))
    assert type(plain) is CheckpointException and "[rank 0] OSError: disk" in str(plain)


def test_rank_lists_are_compact():
    assert format_ranks([]) == ""
    assert format_ranks([3]) == "3"
    assert format_ranks([3, 1]) == "1, 3"
    assert format_ranks([1, 2]) == "1, 2"  # a run of two stays as it is
    assert format_ranks(range(1024)) == "0-1023"
    # sorted, duplicates dropped, a gap splits a run
    assert format_ranks([*range(512), *range(513, 1024), 2001, 2000, 5]) == "0-511, 513-1023, 2000, 2001"


def test_a_failure_shared_by_many_ranks_is_one_line():
    """A key missing on every rank of a 1024-rank job: one line naming the ranks, not 1024."""
    texts = {r: "MissingKeyError: key 'x' is not in the checkpoint" for r in range(1024)}
    texts[5] = "OSError: disk gone"
    exc = CheckpointException("plan", texts)
    lines = str(exc).splitlines()
    assert lines == ["checkpoint phase 'plan' failed on rank(s) 0-1023:",
                     "[ranks 0-4, 6-1023] MissingKeyError: key 'x' is not in the checkpoint",
                     "[rank 5] OSError: disk gone"]
    assert exc.failures is texts  # every rank's failure is still there
    # past the limit of distinct texts, one line counts the rest
    distinct = {r: f"OSError: disk {r} gone" for r in range(20)}
    body = describe_failures(distinct, limit=3).splitlines()
    assert body == ["[rank 0] OSError: disk 0 gone", "[rank 1] OSError: disk 1 gone", "[rank 2] OSError: disk 2 gone",
                    "... and 17 other failure(s) on rank(s) 3-19"]


def test_foreign_exception_classes_are_not_imported():
    """Only builtins and our own classes are re-created; anything else is a CheckpointException."""
    failure = _Failure("some.module", "Evil", "boom", "trace")
    with pytest.raises(CheckpointException, match=r"\[rank 0\] Evil: boom") as info:
        _raise_failures("write", {0: failure})
    assert type(info.value) is CheckpointException
    _raise_failures("write", {})  # nothing failed: nothing raised


def _checks(rank: int, world_size: int, failing_rank: int) -> dict:
    import torch.distributed as dist

    calls = {"all_reduce": 0, "all_gather_object": 0}

    def counting(name):  # type: ignore[no-untyped-def]
        real = getattr(dist, name)

        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    dist.all_reduce, dist.all_gather_object = counting("all_reduce"), counting("all_gather_object")
    dw = DistWrapper(None, use_dist=True)
    error = None
    try:
        dw.check("read", OSError(f"disk gone on rank {rank}") if rank == failing_rank else None)
    except CheckpointException as exc:
        error = str(exc)
    return {"calls": calls, "error": error}


@pytest.mark.distributed
@pytest.mark.parametrize("failing_rank", [-1, 1])
def test_a_check_agrees_on_success_with_one_flag_and_gathers_the_failures_only_when_there_are_some(
        failing_rank: int) -> None:
    from hyper_parallel_dcp.core.testing import run_distributed

    results = run_distributed(_checks, 3, failing_rank, timeout=120)
    for out in results:
        if failing_rank < 0:
            assert out == {"calls": {"all_reduce": 1, "all_gather_object": 0}, "error": None}
        else:
            assert out["calls"] == {"all_reduce": 1, "all_gather_object": 1}
            assert "phase 'read' failed on rank(s) 1" in out["error"]
            assert "[rank 1] OSError: disk gone on rank 1" in out["error"]
