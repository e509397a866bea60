"""Streaming: converting a checkpoint of N× its largest tensor keeps peak RSS near one
tensor, in both directions, measured in fresh subprocesses against a measured baseline
(the same process loading the whole checkpoint into memory)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

ROWS, COLS, N = 1024, 4096, 16  # 16 MiB fp32 tensors, 256 MiB in all
TENSOR_BYTES = ROWS * COLS * 4
TOTAL_BYTES = N * TENSOR_BYTES

_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from hyper_parallel_dcp.offline_transform import (
        convert_dcp_to_huggingface, convert_full_checkpoint_to_dcp, parse_checkpoint_from_huggingface)

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    mode, src, dst, warm_src, warm_dst = sys.argv[1:6]
    # warm up on a tiny checkpoint so imports and allocator pools are in the baseline
    convert_full_checkpoint_to_dcp(warm_src, warm_dst)
    convert_dcp_to_huggingface(warm_dst, warm_dst + "_hf")
    baseline = status_kib("VmRSS")
    # reset the high-water mark so that start-up transients do not count
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if mode == "hf-to-dcp":
        convert_full_checkpoint_to_dcp(src, dst)
    elif mode == "dcp-to-hf":
        convert_dcp_to_huggingface(src, dst, max_shard_size="10GB")  # one output shard holds everything
    else:
        held = parse_checkpoint_from_huggingface(src)
    peak = status_kib("VmHWM")
    print(json.dumps({"baseline_kib": baseline, "peak_kib": peak}))
    """
)


def _peak_growth(mode: str, src, dst, warm_src, warm_dst) -> int:
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode, str(src), str(dst), str(warm_src), str(warm_dst)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    return (probe["peak_kib"] - probe["baseline_kib"]) * 1024


@pytest.mark.slow
def test_peak_memory_stays_near_one_tensor_in_both_directions(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard in range(2):  # two shards and an index, as transformers writes them
        name = f"model-{shard + 1:05d}-of-00002.safetensors"
        tensors = {f"layers.{shard * N // 2 + i}.weight": torch.randn(ROWS, COLS, generator=gen) for i in range(N // 2)}
        save_file(tensors, src / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": TOTAL_BYTES}, "weight_map": weight_map}))
    warm = tmp_path / "warm"
    warm.mkdir()
    save_file({"w": torch.randn(64, 64)}, warm / "model.safetensors", metadata={"format": "pt"})

    whole = _peak_growth("load-all", src, tmp_path / "unused", warm, tmp_path / "w0")
    to_dcp = _peak_growth("hf-to-dcp", src, tmp_path / "dcp", warm, tmp_path / "w1")
    to_hf = _peak_growth("dcp-to-hf", tmp_path / "dcp", tmp_path / "out", warm, tmp_path / "w2")
    report = (f"growth of peak RSS: load everything {whole / 2**20:.0f} MiB, hf-to-dcp {to_dcp / 2**20:.0f} MiB, "
              f"dcp-to-hf {to_hf / 2**20:.0f} MiB (checkpoint {TOTAL_BYTES / 2**20:.0f} MiB, "
              f"largest tensor {TENSOR_BYTES / 2**20:.0f} MiB)")
    print(report)
    assert whole > TOTAL_BYTES * 0.9, report  # the baseline really holds the model
    for growth in (to_dcp, to_hf):
        assert growth < 4 * TENSOR_BYTES, report
        assert growth < whole / 4, report
    # and the streamed conversions are complete and exact
    from safetensors.torch import load_file

    out = load_file(tmp_path / "out" / "model.safetensors")
    original = {**load_file(src / "model-00001-of-00002.safetensors"), **load_file(src / "model-00002-of-00002.safetensors")}
    assert out.keys() == original.keys() and all(torch.equal(out[k], original[k]) for k in original)
