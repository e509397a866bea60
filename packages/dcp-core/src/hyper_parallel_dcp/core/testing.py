"""Test helpers shared by every package's tests and the top-level tests.

What needs only core lives here (storage-backed ``save``/``load`` for package tests live
in :mod:`hyper_parallel_dcp.storage_fs.testing`):

- :func:`run_distributed`: real multi-process gloo runs on CPU (below);
- :func:`run_ranks`: the same for fault tests, where ranks are meant to die: every rank's
  outcome (value, error text, or exit code) instead of an exception;
- :func:`free_port_pair`: a port ``p`` with ``p`` and ``p + 1`` free (async gloo writers);
- :func:`run_console_script`: a console script, or its ``python -m`` module when the
  script is not on ``PATH``;
- :func:`placements_from_text`: ``"Shard(0)"`` / ``"Replicate"`` test strings as DTensor
  placements, written out independently of the CLI's target-spec parser;
- :func:`sample_metadata`: a small checkpoint description that the metadata tests share;
- :class:`FileReads`: the bytes a process really reads from files (every ``os.preadv`` /
  ``os.pread``), to check the library's own byte accounting against.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes that meet
through a file store in a temporary directory, calls ``fn(rank, world_size, *args)`` in
each (``fn`` must be a module-level function), and returns the per-rank results.  Every
rank's traceback is collected; a rank that fails or does not finish by the deadline is
named in the raised :class:`DistributedTestError`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import torch

from . import metadata

__all__ = [
    "DistributedTestError",
    "FileReads",
    "free_port_pair",
    "placements_from_text",
    "run_console_script",
    "run_distributed",
    "run_ranks",
    "sample_metadata",
]


class DistributedTestError(AssertionError):
    """One or more ranks of a distributed test failed or hung."""


def _rank_processes() -> Any:
    """The multiprocessing context ranks start from: forked from a server that has imported
    torch, so a rank starts in a fraction of a second instead of the ~2 s of CPU a fresh
    interpreter spends importing torch (most of the test suite's time on 2 cores)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def _caller_env(env: dict[str, str] | None) -> dict[str, str]:
    """The caller's environment now plus ``env``: what a spawned rank would have inherited
    (the fork server's own environment is the one it was started with)."""
    return {**os.environ, **(env or {})}


def _set_env(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, results: Any,
            env: dict[str, str], args: tuple) -> None:
    _set_env(env)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # Plain pickle, not the queue's ForkingPickler: torch would move a returned tensor
        # into shared memory owned by this process, which exits right after, and the
        # parent's unpickling then hangs.  By value, tensors come back safely.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns results by rank."""
    ctx = _rank_processes()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hp-dcp-dist-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, rank, world_size, store, results, _caller_env(env), args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
                    if dead:
                        # give the queue a moment: a rank may have reported just before dying
                        time.sleep(0.5)
                        while True:
                            try:
                                rank, status, value = results.get_nowait()
                                outcome[rank] = (status, value)
                            except queue.Empty:
                                break
                        for r in dead:
                            outcome.setdefault(r, ("error", f"process exited with code {procs[r].exitcode}"))
                        if any(s == "error" for s, _ in outcome.values()):
                            break
                    continue
                outcome[rank] = (status, value)
                if status == "error":
                    # others may be stuck in a collective with the failed rank; give them a moment
                    deadline = min(deadline, time.monotonic() + 15.0)
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        parts = [f"--- rank {r} failed:\n{errors[r]}" for r in sorted(errors)]
        if missing:
            parts.append(f"--- rank(s) {missing} did not finish within {timeout:.0f} s")
        raise DistributedTestError(f"{fn.__name__} on {world_size} ranks:\n" + "\n".join(parts))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


def free_port_pair() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are free now (async writers use ``p + 1``)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def run_console_script(script: str, module: str, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run the installed console script ``script`` (or ``python -m module`` when it is not
    on ``PATH``) with ``args``; returns the completed process, output captured as text."""
    exe = shutil.which(script, path=os.path.dirname(sys.executable)) or shutil.which(script)
    cmd = [exe] if exe else [sys.executable, "-m", module]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


def placements_from_text(texts: Sequence[str]) -> list[Any]:
    """``["Replicate", "Shard(1)"]`` → DTensor placements (only these two forms)."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = []
    for text in texts:
        if text == "Replicate":
            out.append(Replicate())
        elif text.startswith("Shard(") and text.endswith(")"):
            out.append(Shard(int(text[6:-1])))
        else:
            raise ValueError(f"test placement {text!r} is neither 'Replicate' nor 'Shard(<dim>)'")
    return out


class FileReads:
    """Records every ``os.preadv`` / ``os.pread`` of this process (all threads) while active.

    ``with FileReads() as reads: ...`` then ``reads.records`` is a list of
    ``(path, offset, bytes returned)``.  The count comes from the system calls' return
    values, not from any library counter, so a test can check the library's own byte
    accounting (``bytes_read``, ``hp-dcp explain``) against what really left the files.
    """

    def __init__(self) -> None:
        self.records: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self._saved: tuple[Any, Any] | None = None

    def _record(self, fd: int, offset: int, nbytes: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = f"<fd {fd}>"
        with self._lock:
            self.records.append((path, offset, nbytes))

    def __enter__(self) -> FileReads:
        real_preadv, real_pread = os.preadv, os.pread

        def preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            n = real_preadv(fd, buffers, offset, *flags)
            self._record(fd, offset, n)
            return n

        def pread(fd: int, length: int, offset: int) -> bytes:
            data = real_pread(fd, length, offset)
            self._record(fd, offset, len(data))
            return data

        self._saved = (real_preadv, real_pread)
        os.preadv, os.pread = preadv, pread  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            os.preadv, os.pread = self._saved  # type: ignore[assignment]
            self._saved = None

    def bytes_from(self, keep: Callable[[str, int], bool]) -> int:
        """Total bytes of the reads for which ``keep(path, offset)`` is true."""
        with self._lock:
            return sum(n for path, offset, n in self.records if keep(path, offset))


def _rank_outcome(fn: Callable[..., Any], rank: int, world_size: int, store: str, results: Any,
                  env: dict[str, str], args: tuple) -> None:
    _set_env(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc))))
    results.close()
    results.join_thread()  # the result must be in the pipe before the hard exit below
    os._exit(0)  # skip the process group teardown, which may wait on a dead peer


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[str, str] | None = None) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on gloo ranks, tolerating ranks that die.

    For fault-injection tests: returns ``{rank: ("ok", value) | ("error", text) |
    ("died", exitcode)}`` for every rank that reported or died by ``timeout``; a rank
    missing from the result hung.  Never raises for a rank's failure.
    """
    ctx = _rank_processes()
    results = ctx.Queue()
    out: dict[int, tuple[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hp-dcp-faults-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_outcome, args=(fn, r, world_size, store, results, _caller_env(env), args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
                out[rank] = (status, pickle.loads(value) if status == "ok" else value)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None and p.exitcode != 0:
                        out[r] = ("died", p.exitcode)
                    elif r not in out and p.exitcode == 0 and results.empty():
                        out[r] = ("error", "exited without a result")
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def sample_metadata() -> metadata.Metadata:
    """``w`` (bfloat16, two row chunks on two ranks), a 0-d ``optim.state.w.step`` without
    a checksum, an empty ``e`` and an object ``optim.param_groups``, with their files."""
    def tensor(dtype: torch.dtype, shape: list[int], *chunks: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
        return metadata.TensorStorageMetadata(metadata.TensorProperties(dtype), torch.Size(shape),
                                              [metadata.ChunkStorageMetadata(o, s) for o, s in chunks])

    sd = {"w": tensor(torch.bfloat16, [4, 6], ((0, 0), (2, 6)), ((2, 0), (2, 6))),
          "optim.state.w.step": tensor(torch.float32, [], ((), ())),
          "e": tensor(torch.int64, [0, 3]),
          "optim.param_groups": metadata.BytesStorageMetadata()}
    storage = {metadata.MetadataIndex(fqn, offsets): metadata.StorageInfo(file, start, length, checksum,
                                                                          metadata.chunk_key(fqn, offsets))
               for fqn, offsets, file, start, length, checksum in [
                   ("w", (0, 0), "_rank0_.safetensors", 128, 24, "00ff00ff00ff00ff"),
                   ("w", (2, 0), "_rank1_.safetensors", 128, 24, "0123456789abcdef"),
                   ("optim.state.w.step", (), "_rank0_.safetensors", 152, 4, None)]}
    storage[metadata.MetadataIndex("optim.param_groups")] = metadata.StorageInfo("_rank0_.bytes", 0, 345,
                                                                                 "abcdefabcdefabcd")
    return metadata.Metadata(sd, planner_data={"note": [1, 2]}, storage_data=storage,
                             files={"_rank0_.safetensors": 156, "_rank1_.safetensors": 152, "_rank0_.bytes": 345})
