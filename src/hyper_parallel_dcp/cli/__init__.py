"""``hp-dcp``: inspect, verify, explain, diff, find, list and clean checkpoints; convert to/from Hugging Face.

Exit codes: 0 nothing wrong, 1 a problem was found (incomplete or corrupt checkpoint, a
load that would fail, checkpoints that differ, no complete checkpoint), 2 usage error.
Human-readable output by default; ``--json`` prints one JSON object on stdout.  Progress
bars go to stderr, and only when it is a terminal.  Importing this module imports nothing
heavy; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ._common import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, UsageError

__all__ = ["build_parser", "main"]

_EXIT_CODES = "exit codes: 0 ok, 1 problem found, 2 usage error"
_RAW = argparse.RawDescriptionHelpFormatter

_EXPLAIN_EPILOG = """\
The target spec is a JSON (or YAML, with PyYAML) file describing the layout to load into:

  {
    "mesh": {"dp": 2, "tp": 2},                       # or "mesh": [2, 2]; world size = 4
    "default": ["Replicate", "Shard(0)"],             # one placement per mesh dimension
    "rules": [                                        # first matching FQN pattern wins
      {"match": "*.bias", "placements": ["Replicate", "Replicate"]},
      {"match": "*.o_proj.weight", "placements": {"tp": "Shard(1)"}},
      {"match": "optim.*", "skip": true}              # not loaded
    ],
    "expect": {"lm_head.weight": {"shape": [32000, 4096]}}   # optional checks
  }

Placements: "Replicate", "Shard(d)", "_StridedShard(d, split_factor=k)".  Rank r sits at
the row-major mesh coordinate of r.  A Shard(d) in "default" that does not fit a tensor
(d >= its number of dims) falls back to Replicate; a rule's placements must fit.
Optional keys: "world_size" (must equal the mesh size), "mesh_dim_names",
"load" (FQN patterns of the keys the target holds; default all).

Reports per rank: bytes its targets need, bytes it reads from storage and files it opens
(when every rank reads for itself, and with read-once + broadcast), broadcast bytes sent
and received; the over-read factor (bytes read by all ranks / bytes stored); keys that
are missing, mismatched or not covered by the stored chunks.  Bytes are counted as
FileSystemReader.bytes_read counts them (a column slice spans the rows it touches).

example:  hp-dcp explain /ckpt/step_1000 --target tp2.json

""" + _EXIT_CODES


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hp-dcp`` (sub-commands inspect, verify, explain, diff, latest, ls, clean, convert)."""
    from hyper_parallel_dcp import __version__  # type: ignore[attr-defined]  # namespace package seen by mypy

    parser = argparse.ArgumentParser(
        prog="hp-dcp",
        description="Tools for hyper-parallel-dcp checkpoints (directories or s3:// URLs written by "
                    "hyper_parallel_dcp.save).",
        epilog="run 'hp-dcp COMMAND --help' for the options of a command\n"
               "a checkpoint to try them on:  python -m hyper_parallel_dcp --keep /tmp/hp-demo  "
               "(then: hp-dcp inspect /tmp/hp-demo/step_1000)\n" + _EXIT_CODES,
        formatter_class=_RAW,
    )
    parser.add_argument("--version", action="version", version=f"hp-dcp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in (_add_inspect, _add_verify, _add_explain, _add_diff, _add_latest, _add_ls, _add_clean,
                        _add_convert):
        add_command(sub)
    return parser


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", help="list tensors, objects, files per rank; say whether the checkpoint is complete",
        description="Show a checkpoint's format version, whether it is complete (and why not), every tensor "
                    "FQN with its global shape, dtype, number of stored chunks and bytes, the non-tensor objects, "
                    "and the files and bytes each rank wrote.  Reads metadata only.",
        epilog="example:  hp-dcp inspect /ckpt/step_1000 --json\n" + _EXIT_CODES + " (1: not complete)",
        formatter_class=_RAW)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or s3:// URL")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--chunks", action="store_true",
                   help="also list every stored chunk (offsets, sizes, file, byte offset, checksum)")


def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check completeness and every stored checksum",
        description="Check that the checkpoint is complete (metadata readable, every file present with its "
                    "recorded size) and read every stored chunk and object once, comparing its xxh3-64 checksum "
                    "with the one recorded at save time.  Names the file, FQN and chunk of every problem.",
        epilog="example:  hp-dcp verify /ckpt/step_1000\n" + _EXIT_CODES + " (1: incomplete or corrupt)",
        formatter_class=_RAW)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or s3:// URL")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_explain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain", help="dry-run a resharded load into a target layout: bytes and files per rank, problems",
        description="Simulate loading CKPT into the layout described by --target, without processes or "
                    "accelerators, using the same planner code as hyper_parallel_dcp.load.",
        epilog=_EXPLAIN_EPILOG, formatter_class=_RAW)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or s3:// URL")
    p.add_argument("--target", "-t", metavar="SPEC", required=True, help="target layout file (.json, .yaml)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--keys", action="store_true", help="also list the placements chosen for every key")


def _add_diff(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff", help="per-tensor max abs / relative difference between two checkpoints",
        description="Compare two checkpoints key by key (they may have been saved with different layouts).  "
                    "For each tensor: the max absolute difference, the max relative difference "
                    "|a-b|/max(|a|,|b|), and how many elements differ by more than atol + rtol*|b|; objects "
                    "are compared by value; keys present in only one are listed.  Tensors are streamed in "
                    "row blocks, never both checkpoints in memory.",
        epilog="example:  hp-dcp diff /ckpt/step_1000 /ckpt/step_1000_resumed --rtol 1e-6\n"
               + _EXIT_CODES + " (1: they differ)",
        formatter_class=_RAW)
    p.add_argument("a", metavar="A", help="first checkpoint (directory or s3:// URL)")
    p.add_argument("b", metavar="B", help="second checkpoint (directory or s3:// URL)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    p.add_argument("--all", action="store_true", help="list equal keys too, not only those that differ")
    p.add_argument("--block-mib", type=float, default=256.0,
                   help="read tensors in blocks of at most this many MiB per side (default 256)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_latest(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "latest", help="print the newest complete checkpoint under a root of step directories",
        description="Among the subdirectories of ROOT whose names end in an integer step (step_100, "
                    "global_step2000, 300), print the path of the one with the highest step that is complete.  "
                    "When ROOT has step_N subdirectories (a CheckpointManager root) only those count, so a "
                    "sibling directory such as fsdp4 is not taken for step 4.  Incomplete (interrupted) saves "
                    "are skipped.",
        epilog="example:  CKPT=$(hp-dcp latest /ckpt) && echo resuming from $CKPT\n"
               + _EXIT_CODES + " (1: no complete checkpoint)",
        formatter_class=_RAW)
    p.add_argument("root", metavar="ROOT", help="directory (or s3:// prefix) holding one subdirectory per saved step")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_ls(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ls", help="list the steps of a CheckpointManager root: complete or not, size, age, metrics",
        description="List every step_N directory under ROOT (as written by CheckpointManager), complete "
                    "(.metadata committed) or not, with its size on disk, its age and the metrics saved with it; "
                    "then what interrupted saves left behind (see 'hp-dcp clean').  Reads only; changes nothing.",
        epilog="example:  hp-dcp ls /ckpt --json\n" + _EXIT_CODES,
        formatter_class=_RAW)
    p.add_argument("root", metavar="ROOT", help="directory or s3:// prefix holding step_N subdirectories")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_clean(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "clean", help="remove what dead saves left under a CheckpointManager root",
        description="Remove what saves that died left under ROOT: hidden staging and old directories "
                    "(.step_N.hp-dcp-staging-*, .step_N.hp-dcp-old-*), lock files nobody holds, async-save mailbox "
                    "files, and step directories without .metadata older than the newest complete step.  A save "
                    "that is still running (it holds its lock) is never touched, nor anything modified in the last "
                    "--grace seconds, nor any file or directory that is not a checkpoint's.  On an s3:// root: "
                    "step_N/ prefixes without .metadata older than the newest complete step, and lock objects "
                    "not renewed for HP_DCP_OBJECT_LOCK_STALE_AFTER seconds (or whose holder ran here and is gone).",
        epilog="example:  hp-dcp clean /ckpt --dry-run\n" + _EXIT_CODES + " (1: something was in use and kept)",
        formatter_class=_RAW)
    p.add_argument("root", metavar="ROOT", help="directory or s3:// prefix holding step_N subdirectories")
    p.add_argument("--dry-run", "-n", action="store_true", help="only list what would be removed")
    p.add_argument("--grace", type=float, default=60.0, metavar="SECONDS",
                   help="leave anything modified in the last SECONDS alone (default 60; 0 once the job is gone)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="Hugging Face <-> checkpoint conversion (same as hp-dcp-convert)", add_help=False,
        description="Runs hp-dcp-convert with the remaining arguments: 'hp-dcp convert hf-to-dcp SRC DST' or "
                    "'hp-dcp convert dcp-to-hf SRC DST'; 'hp-dcp convert --help' shows its options.")
    p.add_argument("convert_args", nargs=argparse.REMAINDER, help="arguments of hp-dcp-convert")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``hp-dcp`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # 'convert' forwards everything after it verbatim, its own --help included.
    if args_list and args_list[0] == "convert":
        from .convert import run_convert

        return run_convert(args_list[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    from importlib import import_module

    module = {"inspect": "inspect_ckpt", "verify": "verify", "explain": "explain", "diff": "diff",
              "latest": "latest", "ls": "ls", "clean": "clean"}[args.command]
    try:
        return import_module(f"{__name__}.{module}").run(args)
    except UsageError as exc:
        print(f"hp-dcp {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. head, which stopped reading
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - a checkpoint the command cannot read is a problem found
        from hyper_parallel_dcp.core.errors import CheckpointError

        if not isinstance(exc, (CheckpointError, OSError)):
            raise
        print(f"hp-dcp {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
