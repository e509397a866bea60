"""Benchmarks: hyper-parallel-dcp side by side with ``torch.distributed.checkpoint``.

``python -m hyper_parallel_dcp.benchmarks`` runs save / load / resharded load / async save
/ read-once + broadcast / HF conversion against the physical references measured in the
same run (raw write+fsync, raw read warm and cold, host memcpy), plus planning at scale by
simulation (:mod:`.planning_sim`), and writes JSON, a markdown table and PNG plots.
Imports nothing heavy: the modules are loaded by the command.
"""

__all__: list[str] = []
