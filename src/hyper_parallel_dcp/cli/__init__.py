"""``hp-dcp``: inspect, verify, explain, diff, find, list and clean checkpoints; convert to/from Hugging Face.

Exit codes: 0 nothing wrong, 1 a problem found, 2 usage error.  The commands are one table,
:data:`COMMANDS`, each module imported when it runs.  Exports :func:`build_parser` and :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Optional, Sequence

from . import target_spec
from ._common import CLEAN_GRACE_S, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, UsageError

__all__ = ["COMMANDS", "build_parser", "main"]

_EXIT_CODES = "exit codes: 0 ok, 1 problem found, 2 usage error"

Argument = tuple[tuple[str, ...], dict[str, Any]]
_CKPT: Argument = (("checkpoint",), {"metavar": "CKPT", "help": "checkpoint directory or s3:// URL"})
_ROOT: Argument = (("root",), {"metavar": "ROOT", "help": "directory or s3:// prefix holding step_N subdirectories"})
_JSON: Argument = (("--json",), {"action": "store_true", "help": "print one JSON object"})
_GRACE: Argument = (("--grace",), {"type": float, "default": CLEAN_GRACE_S, "metavar": "SECONDS",
                                   "help": f"leave anything modified in the last SECONDS alone (default "
                                           f"{CLEAN_GRACE_S:g}; 0 once the job is gone)"})


@dataclass(frozen=True)
class Command:
    """One sub-command: its parser text and arguments, and ``module:function`` (in this
    package) that runs it with the parsed arguments and returns the exit code."""

    name: str
    run: str
    help: str
    description: str
    example: str
    exit_note: str
    arguments: tuple[Argument, ...]
    epilog_head: str = ""


COMMANDS: tuple[Command, ...] = (
    Command(
        "inspect", "inspect_ckpt:run",
        "list tensors, objects, files per rank; say whether the checkpoint is complete",
        "Show a checkpoint's format version, whether it is complete (and why not), every tensor FQN with its "
        "global shape, dtype, number of stored chunks and bytes, the non-tensor objects, and the files and bytes "
        "each rank wrote.  Reads metadata only.",
        "hp-dcp inspect /ckpt/step_1000 --json", " (1: not complete)",
        (_CKPT, (("--json",), {"action": "store_true", "help": "print one JSON object instead of tables"}),
         (("--chunks",), {"action": "store_true",
                          "help": "also list every stored chunk (offsets, sizes, file, byte offset, checksum)"}))),
    Command(
        "verify", "inspect_ckpt:run_verify", "check completeness and every stored checksum",
        "Check that the checkpoint is complete (metadata readable, every file present with its recorded size) "
        "and read every stored chunk and object once, comparing its xxh3-64 checksum with the one recorded at "
        "save time.  Names the file, FQN and chunk of every problem.",
        "hp-dcp verify /ckpt/step_1000", " (1: incomplete or corrupt)", (_CKPT, _JSON)),
    Command(
        "explain", "explain:run",
        "dry-run a resharded load into a target layout: bytes and files per rank, problems",
        "Simulate loading CKPT into the layout described by --target with the planner code of "
        "hyper_parallel_dcp.load, without processes or accelerators: per rank the bytes needed, read and "
        "broadcast and the files opened (with and without read-once + broadcast), the over-read factor, and the "
        "keys that are missing, mismatched or not covered by the stored chunks.",
        "hp-dcp explain /ckpt/step_1000 --target tp2.json", "",
        (_CKPT, (("--target", "-t"), {"metavar": "SPEC", "required": True,
                                      "help": "target layout file (.json, .yaml)"}),
         _JSON, (("--keys",), {"action": "store_true", "help": "also list the placements chosen for every key"})),
        epilog_head=target_spec.format_help()),
    Command(
        "diff", "diff:run", "per-tensor max abs / relative difference between two checkpoints",
        "Compare two checkpoints key by key, whatever their layouts: per tensor the max absolute and relative "
        "(|a-b|/max(|a|,|b|)) difference and how many elements differ by more than atol + rtol*|b|; objects by "
        "value; keys in only one.  Tensors are streamed in row blocks.",
        "hp-dcp diff /ckpt/step_1000 /ckpt/step_1000_resumed --rtol 1e-6", " (1: they differ)",
        ((("a",), {"metavar": "A", "help": "first checkpoint (directory or s3:// URL)"}),
         (("b",), {"metavar": "B", "help": "second checkpoint (directory or s3:// URL)"}),
         (("--atol",), {"type": float, "default": 0.0, "help": "absolute tolerance (default 0: exact)"}),
         (("--rtol",), {"type": float, "default": 0.0, "help": "relative tolerance (default 0: exact)"}),
         (("--all",), {"action": "store_true", "help": "list equal keys too, not only those that differ"}),
         (("--block-mib",), {"type": float, "default": 256.0,
                             "help": "read tensors in blocks of at most this many MiB per side (default 256)"}),
         _JSON)),
    Command(
        "latest", "roots:run_latest", "print the newest complete checkpoint under a root of step directories",
        "Print the path of the complete subdirectory of ROOT with the highest step in its name (step_100, "
        "global_step2000, 300; only step_N ones when ROOT has any).  Incomplete saves are skipped.",
        "CKPT=$(hp-dcp latest /ckpt) && echo resuming from $CKPT", " (1: no complete checkpoint)",
        ((("root",), {"metavar": "ROOT",
                      "help": "directory (or s3:// prefix) holding one subdirectory per saved step"}), _JSON)),
    Command(
        "ls", "roots:run_ls", "list the steps of a CheckpointManager root: complete or not, size, age, metrics",
        "List every step_N directory under ROOT, complete or not, with its size, age and metrics; then what "
        "dead saves left behind (what 'hp-dcp clean --dry-run' lists with the same --grace); with --local, the "
        "steps of a LocalTier directory too (which ranks' copies are committed there).  Changes nothing.",
        "hp-dcp ls /ckpt --local /dev/shm/hp-dcp/run1 --json", "",
        (_ROOT, _GRACE, _JSON, (("--local",), {"action": "append", "default": [], "metavar": "DIR",
                                               "help": "a node-local LocalTier directory to list too (repeatable)"}))),
    Command(
        "clean", "roots:run_clean", "remove what dead saves left under a CheckpointManager root",
        "Remove what saves that died left under ROOT: hidden .step_N.hp-dcp-staging-*/-old-* directories, lock "
        "files nobody holds, async-save mailbox files, and step_N directories without .metadata older than the "
        "newest complete step.  A running save (it holds its lock), anything modified in the last --grace "
        "seconds and anything that is not a step_N directory or one of those names are never touched.  On an "
        "s3:// root: incomplete step_N/ prefixes and lock objects not renewed (HP_DCP_OBJECT_LOCK_STALE_AFTER).",
        "hp-dcp clean /ckpt --dry-run", " (1: something was in use and kept)",
        (_ROOT, (("--dry-run", "-n"), {"action": "store_true", "help": "only list what would be removed"}),
         _GRACE, _JSON)),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hp-dcp``: one sub-command per :data:`COMMANDS` entry, plus
    ``convert`` (which :func:`main` forwards to ``hp-dcp-convert`` before parsing)."""
    from hyper_parallel_dcp import __version__  # type: ignore[attr-defined]  # namespace package seen by mypy

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="hp-dcp", formatter_class=raw,
        description="Tools for hyper-parallel-dcp checkpoints (directories or s3:// URLs written by "
                    "hyper_parallel_dcp.save).",
        epilog="run 'hp-dcp COMMAND --help' for the options of a command\n"
               "a checkpoint to try them on:  python -m hyper_parallel_dcp --keep /tmp/hp-demo  "
               "(then: hp-dcp inspect /tmp/hp-demo/step_1000)\n" + _EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"hp-dcp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.description, formatter_class=raw,
                           epilog=f"{command.epilog_head}example:  {command.example}\n{_EXIT_CODES}{command.exit_note}")
        for flags, options in command.arguments:
            p.add_argument(*flags, **options)
    convert = sub.add_parser(
        "convert", help="Hugging Face <-> checkpoint conversion (same as hp-dcp-convert)", add_help=False,
        description="Runs hp-dcp-convert with the remaining arguments: 'hp-dcp convert hf-to-dcp SRC DST' or "
                    "'hp-dcp convert dcp-to-hf SRC DST'; 'hp-dcp convert --help' shows its options.")
    convert.add_argument("convert_args", nargs=argparse.REMAINDER, help="arguments of hp-dcp-convert")
    return parser


def _convert(argv: Sequence[str]) -> int:
    """``hp-dcp convert``: ``argv`` to ``offline_transform.cli.main``; 2 when that package is missing."""
    try:
        from hyper_parallel_dcp.offline_transform.cli import main as convert_main
    except ImportError:
        print("hp-dcp convert needs the conversion package: pip install hyper-parallel-dcp-hf-convert",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(convert_main(list(argv)) or 0)
    except SystemExit as exc:  # argparse inside the converter exits
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``hp-dcp`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code (a checkpoint
    error or ``OSError`` of a command is printed and exits 1; a :class:`UsageError` exits 2)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "convert":
        return _convert(args_list[1:])
    try:
        args = build_parser().parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    module, function = next(c.run for c in COMMANDS if c.name == args.command).split(":")
    try:
        return getattr(import_module(f"{__name__}.{module}"), function)(args)
    except UsageError as exc:
        print(f"hp-dcp {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. head, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - a checkpoint the command cannot read is a problem found
        from hyper_parallel_dcp.core.errors import CheckpointError

        if not isinstance(exc, (CheckpointError, OSError)):
            raise
        print(f"hp-dcp {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
