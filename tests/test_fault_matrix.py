"""The fault matrix of docs/faults.md, run row by row with real processes.

The table in the docs is the parametrisation: each row names the operation, the phase at
which one rank (or its async writer) SIGKILLs itself through the core fault hook, and the
outcome the surviving rank must see — error class, the phase it names, the rank it names
— within the deadline.  Then: the checkpoint saved before the fault is intact, and a new
job saves and loads again.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from hyper_parallel_dcp.core.testing import run_ranks  # tolerates ranks that die

DOCS = Path(__file__).resolve().parents[1] / "docs" / "faults.md"
TIMEOUT_S = "4"
_ROW = re.compile(r"^\| (?P<op>[a-z_ ]+) \| `(?P<phase>[a-z.]+)` \| (?P<fault>[^|]+) \| "
                  r"`(?P<error>\w+)` in phase `(?P<named_phase>\w+)`, names rank (?P<named>\d+) \|$")


def matrix_rows() -> list[dict]:
    text = DOCS.read_text()
    block = text.split("<!-- fault-matrix:start -->")[1].split("<!-- fault-matrix:end -->")[0]
    rows = []
    for line in block.strip().splitlines()[2:]:
        match = _ROW.match(line.strip())
        assert match, f"docs/faults.md: matrix row not understood: {line!r}"
        row = match.groupdict()
        row["killed"] = int(re.search(r"rank (\d+)", row["fault"]).group(1))
        row["named"] = int(row["named"])
        rows.append(row)
    return rows


def _state(value: float, rank: int) -> dict:
    return {"w": torch.full((64, 8), value), f"own{rank}": torch.full((16,), value + rank), "step": int(value)}


def _changed(value: float, rank: int) -> dict:
    """Another key set than the checkpoint before: the save plans anew (no plan-cache hit)."""
    return dict(_state(value, rank), extra=torch.ones(4))


def _target(rank: int) -> dict:
    return {"w": torch.zeros(64, 8), f"own{rank}": torch.zeros(16), "step": -1}


def _arm(row: dict, once: str) -> None:
    import os

    os.environ["HP_DCP_FAULT"] = f"{row['phase']}@{row['killed']}"
    os.environ["HP_DCP_FAULT_ONCE"] = once


def _run_row(rank: int, world_size: int, root: str, row: dict) -> dict:
    """Save OLD into root/good; then the row's operation with its fault armed."""
    import hyper_parallel_dcp as dcp

    good = f"{root}/good"
    dcp.save(_state(1.0, rank), checkpoint_id=good)
    once = f"{root}/fired"
    started = time.monotonic()
    out: dict = {}
    try:
        if row["op"] == "save":
            _arm(row, once)
            dcp.save(_changed(2.0, rank), checkpoint_id=good)
        elif row["op"] == "async_save":
            from hyper_parallel_dcp.async_persist.persist import _get_persister

            _arm(row, once)
            _get_persister().shutdown()  # the next writer starts with the fault armed
            dcp.async_save(_changed(2.0, rank), checkpoint_id=good).get_result(120)
        else:
            _arm(row, once)
            dcp.load(_target(rank), checkpoint_id=good,
                     broadcast_replicated_tensors=row["op"] == "broadcast load")
        out["error"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - started
    if row["op"] == "async_save":
        # the same job: the next async_save lands on every rank
        dcp.async_save(_state(3.0, rank), checkpoint_id=f"{root}/next").get_result(120)
        target = _target(rank)
        dcp.load(target, checkpoint_id=f"{root}/next")
        out["next"] = (target["w"][0, 0].item(), target[f"own{rank}"][0].item(), target["step"])
    return out


def _new_job(rank: int, world_size: int, root: str) -> list:
    """A fresh job: the old checkpoint loads (unless the row replaced it whole), and a new one saves and loads."""
    import hyper_parallel_dcp as dcp

    old = _target(rank)
    dcp.load(old, checkpoint_id=f"{root}/good")
    dcp.save(_state(4.0, rank), checkpoint_id=f"{root}/after")
    new = _target(rank)
    dcp.load(new, checkpoint_id=f"{root}/after")
    return [old["w"][0, 0].item(), old[f"own{rank}"][0].item(), new["w"][0, 0].item(), new[f"own{rank}"][0].item()]


ROWS = matrix_rows()


def test_matrix_covers_every_operation_and_phase() -> None:
    from hyper_parallel_dcp.core.settings import PHASES

    assert {r["op"] for r in ROWS} == {"save", "async_save", "load", "broadcast load"}
    save_phases = {p for p in PHASES if p.startswith("save.")}
    assert {r["phase"] for r in ROWS if r["op"] == "save"} == save_phases
    assert {r["phase"] for r in ROWS if r["op"] == "async_save"} == save_phases
    assert {r["phase"] for r in ROWS if r["op"] in ("load", "broadcast load")} == {
        p for p in PHASES if p.startswith("load.")}


@pytest.mark.distributed
@pytest.mark.parametrize("row", ROWS, ids=[f"{r['op']}-{r['phase']}-rank{r['killed']}" for r in ROWS])
def test_fault_matrix_row(tmp_path: Path, row: dict) -> None:
    env = {"HP_DCP_COLLECTIVE_TIMEOUT": TIMEOUT_S, "HP_DCP_ASYNC_TIMEOUT": "60"}
    out = run_ranks(_run_row, 2, str(tmp_path), row, env=env, timeout=150)
    killed, survivor = row["killed"], 1 - row["killed"]
    assert (tmp_path / "fired").exists(), "the fault never fired"
    if row["op"] == "async_save":
        # the writer died, the training process lives on
        status, got = out[killed]
        assert status == "ok", got
        assert got["error"].startswith("AsyncSaveError"), got
        assert got["next"] == (3.0, 3.0 + killed, 3)
    else:
        assert out[killed][0] == "died", out
    status, got = out[survivor]
    assert status == "ok", got
    text = got["error"]
    assert text.startswith(row["error"] + ":"), text
    if row["error"] == "AsyncSaveError":
        assert f"failed on rank(s) [{row['named']}]" in text, text
        assert got["next"] == (3.0, 3.0 + survivor, 3)
        assert got["seconds"] < 30, got  # a writer's death surfaces in seconds, not at the timeout
    else:
        assert f"phase '{row['named_phase']}'" in text, text
        assert f"[{row['named']}]" in text, text
        assert got["seconds"] < 5 * float(TIMEOUT_S), got
    # nothing complete was damaged; the save that was killed left no metadata of its own
    from hyper_parallel_dcp.storage_fs.integrity import verify_checkpoint

    good = tmp_path / "good"
    report = verify_checkpoint(good)
    assert report.ok, report.problems
    assert not [n for n in good.iterdir() if n.name.endswith(".metadata") and n.name != ".metadata"]
    # a new job saves and loads again (the old checkpoint holds OLD: the killed save never committed)
    values = run_ranks(_new_job, 2, str(tmp_path), timeout=120)
    for rank in (0, 1):
        assert values[rank] == ("ok", [1.0, 1.0 + rank, 4.0, 4.0 + rank]), values
