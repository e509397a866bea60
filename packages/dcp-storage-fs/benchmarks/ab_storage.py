"""Interleavable A/B of the filesystem backend's fast paths (``docs/perf/storage.md``): on 2
gloo ranks, a save, then REPS times a same-layout load, a resharded load and a save over
the previous checkpoint; prints each operation's wall time (the slower rank) and CPU time
(summed over the ranks), in ms, as JSON.

usage: python ab_storage.py dense|small|tiny SIZE REPS ROOT
  dense: SIZE MiB of the benchmark's dense state dict; small: SIZE tensors of 128 KiB;
  tiny: SIZE tensors of 4 KiB.  ROOT: where the checkpoint goes (its filesystem matters).
One fast path is taken out (its general path does the work) by setting one of
NOARENA, NODROP, NOLATE, NOSYNCTHREAD, NOADJ, NOALIGN to 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _take_out_fast_paths() -> None:
    from hyper_parallel_dcp.storage_fs import mapping, posix, rank_files, safetensors_stream, sinks, writer

    if os.environ.get("NOARENA"):  # every file mapped alone
        mapping.MappingArena.reserve = classmethod(lambda cls, *a: None)  # type: ignore[method-assign]
    if os.environ.get("NODROP"):  # the replaced files' page cache kept
        posix.drop_cache = lambda path: None
    if os.environ.get("NOLATE"):  # every chunk hashed as it is written
        rank_files.LateDigests = lambda: None  # type: ignore[misc,assignment]
    if os.environ.get("NOSYNCTHREAD"):  # fsync and rename on the saving thread

        class _Inline:
            def __init__(self, files: list) -> None:
                self._error: BaseException | None = None
                for i, written in enumerate(files):
                    try:
                        written.finish(sync=True)
                    except BaseException as exc:  # noqa: BLE001 - raised by wait()
                        self._error = exc
                        for rest in files[i + 1:]:
                            rest.discard()
                        return

            def wait(self) -> None:
                if self._error is not None:
                    raise self._error

        writer._BackgroundSync = _Inline  # type: ignore[misc,assignment]
    if os.environ.get("NOADJ"):  # one preadv per contiguous read
        def add(self, fd, path, start, dest, dtype):  # type: ignore[no-untyped-def]
            if not (dest.is_cpu and dest.dtype is dtype and dest.is_contiguous()):
                return False
            if dest.nbytes:
                posix.pread_exact(fd, posix.tensor_bytes(dest), start, path)
            return True

        sinks.AdjacentReads.add = add  # type: ignore[method-assign]
    if os.environ.get("NOALIGN"):  # every chunk written at once
        init = safetensors_stream._AlignedWrites.__init__

        def plain(self, f, position, align=0):  # type: ignore[no-untyped-def]
            init(self, f, position, align)
            self._fd = None

        safetensors_stream._AlignedWrites.__init__ = plain  # type: ignore[method-assign]


def worker(rank: int, world: int, kind: str, size: float, reps: int, root: str) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import hyper_parallel_dcp as hp
    from hyper_parallel_dcp.benchmarks.io_bench import _io_state_dicts
    from hyper_parallel_dcp.benchmarks.state_dicts import dense_shapes, small_shapes
    from hyper_parallel_dcp.storage_fs import FileSystemReader, wait_for_removals

    torch.set_num_threads(1)
    _take_out_fast_paths()
    shapes = dense_shapes(size) if kind == "dense" else small_shapes(int(size), 128 if kind == "small" else 4)
    sd, target, flipped = _io_state_dicts(shapes, world)
    ck = Path(root) / "ck"
    hp.save(sd, checkpoint_id=ck)
    out: dict[str, list[float]] = {f"{op}.{clock}": [] for op in ("load", "resh", "save") for clock in ("wall", "cpu")}

    def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        out[name + ".cpu"].append(time.process_time() - cpu)
        out[name + ".wall"].append(time.perf_counter() - wall)

    def load(dest: dict) -> None:
        hp.load(dest, storage_reader=FileSystemReader(ck))

    load(target)  # the first load of each layout pays one-time costs
    load(flipped)
    for _ in range(reps):
        timed("load", lambda: load(target))
        timed("resh", lambda: load(flipped))
        timed("save", lambda: hp.save(sd, checkpoint_id=ck))
        wait_for_removals()
    return out


if __name__ == "__main__":
    from hyper_parallel_dcp.core.testing import run_distributed

    kind, size, reps, root = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    Path(root).mkdir(parents=True, exist_ok=True)
    res = run_distributed(worker, 2, kind, size, reps, root, timeout=600)
    merged = {key: [max(a, b) if key.endswith("wall") else a + b for a, b in zip(res[0][key], res[1][key])]
              for key in res[0]}
    print(json.dumps({key: [round(x * 1e3, 2) for x in values] for key, values in merged.items()}))
