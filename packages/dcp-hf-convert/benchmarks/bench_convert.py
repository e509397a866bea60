"""Offline conversion side by side with ``torch.distributed.checkpoint.format_utils``.

Builds one full checkpoint (``--tensors`` fp32 tensors of ``--mib`` MiB each) as a
``torch.save`` file and as Hugging Face safetensors, then runs each conversion in a fresh
subprocess and reports wall time, throughput and the growth of peak RSS over the
process's baseline (high-water mark reset after imports)::

    python packages/dcp-hf-convert/benchmarks/bench_convert.py --tensors 16 --mib 32

Rows: torch_save_to_dcp vs ours (torch file → DCP, HF → DCP); dcp_to_torch_save vs ours
(DCP → HF safetensors).  Both writers fsync their DCP files (torch's FileSystemWriter
default); ``dcp_to_torch_save`` does not fsync, so ours runs with and without it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    from hyper_parallel_dcp.offline_transform import convert_dcp_to_huggingface, convert_full_checkpoint_to_dcp

    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))

    case, src, dst = sys.argv[1:4]
    base = kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    if case == "torch:torch_save_to_dcp":
        torch_save_to_dcp(src, dst)
    elif case == "torch:dcp_to_torch_save":
        dcp_to_torch_save(src, dst)
    elif case == "ours:torch_file_to_dcp":
        convert_full_checkpoint_to_dcp(src, dst, src_platform="torch")
    elif case == "ours:hf_to_dcp":
        convert_full_checkpoint_to_dcp(src, dst)
    elif case == "ours:dcp_to_hf":
        convert_dcp_to_huggingface(src, dst, max_shard_size="5GB")
    elif case == "ours:dcp_to_hf_nosync":
        convert_dcp_to_huggingface(src, dst, max_shard_size="5GB", sync_files=False)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_growth_kib": kib("VmHWM") - base}))
    """
)


def run_child(child: str, case: str, src: Path, dst: Path, *extra: str) -> dict:
    """Run ``case`` of the script ``child`` in a fresh interpreter (``dst`` removed first);
    returns the JSON line it prints last."""
    if dst.exists():
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    proc = subprocess.run([sys.executable, "-c", child, case, str(src), str(dst), *extra], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(case: str, src: Path, dst: Path) -> dict:
    return run_child(_CHILD, case, src, dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--mib", type=int, default=32, help="size of each fp32 tensor in MiB")
    parser.add_argument("--repeat", type=int, default=2, help="runs per case (the best is reported)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()

    from safetensors.torch import save_file

    work = Path(args.workdir or tempfile.mkdtemp(prefix="hp-dcp-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    cols = 1024
    rows = args.mib * 1024 * 1024 // 4 // cols
    sd = {f"model.layers.{i}.weight": torch.randn(rows, cols) for i in range(args.tensors)}
    total = sum(t.nbytes for t in sd.values())
    torch.save(sd, work / "full.pt")
    (work / "hf").mkdir(exist_ok=True)
    save_file(sd, work / "hf" / "model.safetensors", metadata={"format": "pt"})
    del sd

    # torch's DCP of the same checkpoint, as input for its own dcp_to_torch_save
    _run("torch:torch_save_to_dcp", work / "full.pt", work / "torch_dcp")
    _run("ours:hf_to_dcp", work / "hf", work / "our_dcp")
    cases = [
        ("torch:torch_save_to_dcp", work / "full.pt", work / "out_torch_dcp"),
        ("ours:torch_file_to_dcp", work / "full.pt", work / "out_our_dcp_from_pt"),
        ("ours:hf_to_dcp", work / "hf", work / "out_our_dcp_from_hf"),
        ("torch:dcp_to_torch_save", work / "torch_dcp", work / "out_torch.pt"),
        ("ours:dcp_to_hf", work / "our_dcp", work / "out_hf"),
        ("ours:dcp_to_hf_nosync", work / "our_dcp", work / "out_hf_nosync"),
    ]
    print(f"checkpoint: {args.tensors} x {args.mib} MiB fp32 = {total / 2**20:.0f} MiB; best of {args.repeat}")
    print(f"{'case':28s} {'seconds':>8s} {'MiB/s':>8s} {'peak RSS growth MiB':>20s}")
    for case, src, dst in cases:
        runs = [_run(case, src, dst) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["seconds"])
        peak = max(r["peak_growth_kib"] for r in runs) / 1024
        print(f"{case:28s} {best['seconds']:8.2f} {total / 2**20 / best['seconds']:8.0f} {peak:20.0f}")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
