"""torch DCP ⇄ hyper-parallel-dcp conversion: time and peak memory growth.

Saves one checkpoint with ``torch.distributed.checkpoint`` (``--tensors`` fp32 tensors of
``--mib`` MiB each, one process), then runs in fresh subprocesses ``torch-dcp-to-dcp`` and
``dcp-to-torch-dcp`` (on the result) with ``--batch-mib`` blocks, and for reference
torch's ``dcp_to_torch_save`` (a full state dict in one process).  Reports wall time,
throughput and the growth of peak RSS over the process's baseline (high-water mark reset
after imports), which for ours should stay within about one batch::

    python packages/dcp-hf-convert/benchmarks/bench_torch_dcp.py --tensors 8 --mib 32 --batch-mib 16
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import textwrap
import warnings
from pathlib import Path

import torch
from bench_convert import run_child  # this folder is on sys.path when the script runs

_CHILD = textwrap.dedent(
    """
    import json, sys, time, warnings
    warnings.simplefilter("ignore")
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from hyper_parallel_dcp.offline_transform.torch_dcp import convert_dcp_to_torch_dcp, convert_torch_dcp_to_dcp

    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    case, src, dst, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    base = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    if case == "ours:torch_dcp_to_dcp":
        convert_torch_dcp_to_dcp(src, dst, batch_bytes=batch)
    elif case == "ours:dcp_to_torch_dcp":
        convert_dcp_to_torch_dcp(src, dst, batch_bytes=batch)
    elif case == "torch:dcp_to_torch_save":
        dcp_to_torch_save(src, dst)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_growth_kib": kib("VmHWM") - base}))
    """
)


def _run(case: str, src: Path, dst: Path, batch: int) -> dict:
    return run_child(_CHILD, case, src, dst, str(batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--mib", type=int, default=32, help="size of each fp32 tensor in MiB")
    parser.add_argument("--batch-mib", type=int, default=16, help="conversion batch (largest block) in MiB")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (the best is reported)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's dcp_to_torch_save reference")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    import torch.distributed.checkpoint as tdcp

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-torch-dcp-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = args.mib * 1024 * 1024 // 4 // 1024
    src = work / "torch_dcp"
    if not (src / ".metadata").exists():
        gen = torch.Generator().manual_seed(0)
        sd = {f"layers.{i}.weight": torch.randn(rows, 1024, generator=gen) for i in range(args.tensors)}
        sd["step"] = 1000
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tdcp.save(sd, checkpoint_id=str(src), no_dist=True)
        del sd
    total = args.tensors * args.mib * 1024 * 1024
    batch = args.batch_mib * 1024 * 1024
    cases = [("ours:torch_dcp_to_dcp", src, work / "ours"), ("ours:dcp_to_torch_dcp", work / "ours", work / "back")]
    if not args.no_torch:
        cases.append(("torch:dcp_to_torch_save", src, work / "full.pt"))
    print(f"checkpoint: {args.tensors} x {args.mib} MiB fp32 = {total / 2**20:.0f} MiB; batch {args.batch_mib} MiB")
    print(f"{'case':28} {'seconds':>8} {'MiB/s':>8} {'peak RSS growth':>16}")
    for case, s, d in cases:
        best = min((_run(case, s, d, batch) for _ in range(args.repeat)), key=lambda r: r["seconds"])
        mib_s = total / 2**20 / best["seconds"]
        print(f"{case:28} {best['seconds']:8.2f} {mib_s:8.1f} {best['peak_growth_kib'] / 1024:13.1f} MiB")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
