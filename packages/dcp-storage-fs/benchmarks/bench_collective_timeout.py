"""Overhead of the collective arrival check (HP_DCP_COLLECTIVE_TIMEOUT) on gloo ranks.

Times ``DistWrapper.all_gather_object`` and a small collective save with the check on
(default timeout) and off (``HP_DCP_COLLECTIVE_TIMEOUT=0``), over a TCPStore (as under
torchrun) and a FileStore.  Prints medians per rank 0.

    python packages/dcp-storage-fs/benchmarks/bench_collective_timeout.py --ranks 2
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _bench(rank: int, world: int, init: str, iters: int, out_dir: str, queue) -> None:
    import torch.distributed as dist

    from hyper_parallel_dcp import save
    from hyper_parallel_dcp.core.collectives import DistWrapper

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    state = {f"t{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB replicated
    res = {}
    for label, value in (("off", "0"), ("on", "1800"), ("off", "0"), ("on", "1800")):
        os.environ["HP_DCP_COLLECTIVE_TIMEOUT"] = value
        dw = DistWrapper(None, use_dist=True)
        dist.barrier()
        times = []
        for i in range(iters):
            t = time.perf_counter()
            dw.all_gather_object({"rank": rank, "i": i})
            times.append(time.perf_counter() - t)
        res.setdefault(f"gather_{label}", []).extend(times)
        saves = []
        for i in range(5):
            dist.barrier()
            t = time.perf_counter()
            save(state, checkpoint_id=os.path.join(out_dir, f"c{label}{i % 2}"))
            saves.append(time.perf_counter() - t)
        res.setdefault(f"save_{label}", []).extend(saves)
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in res.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for kind in ("tcp", "file"):
        with tempfile.TemporaryDirectory() as tmp:
            if kind == "tcp":
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                init = f"tcp://127.0.0.1:{port}"
            else:
                init = f"file://{tmp}/store"
            q = ctx.Queue()
            procs = [ctx.Process(target=_bench, args=(r, args.ranks, init, args.iters, tmp, q))
                     for r in range(args.ranks)]
            for p in procs:
                p.start()
            res = q.get(timeout=600)
            for p in procs:
                p.join()
        g_off, g_on = res["gather_off"] * 1e6, res["gather_on"] * 1e6
        s_off, s_on = res["save_off"] * 1e3, res["save_on"] * 1e3
        print(f"{kind:4s} store, {args.ranks} ranks: all_gather_object {g_off:7.0f} us -> {g_on:7.0f} us "
              f"(+{g_on - g_off:.0f} us); save of 8 MiB {s_off:6.1f} ms -> {s_on:6.1f} ms "
              f"({(s_on - s_off) / s_off * 100:+.1f} %)")


if __name__ == "__main__":
    main()
