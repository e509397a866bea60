"""Training frameworks' checkpointing through :mod:`hyper_parallel_dcp.torch_compat` (SPEC §15).

One module per framework, each needing its optional extra (``hyper-parallel-dcp[lightning]``,
...); nothing here is imported by the rest of the library.  docs/integrations.md shows the
lines a user changes.
"""
