"""``hp-dcp-convert``: ``hf-to-dcp``, ``dcp-to-hf``, ``torch-dcp-to-dcp``, ``dcp-to-torch-dcp`` from the shell.

Exit codes: 0 done, 1 the conversion failed, 2 usage error (bad arguments, or a non-empty DST
without ``--overwrite``, left untouched).  ``main(argv)`` also serves ``hp-dcp convert``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["build_parser", "main"]

PROG = "hp-dcp-convert"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_TORCH_DCP = ("torch-dcp-to-dcp", "dcp-to-torch-dcp")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The argument parser of ``hp-dcp-convert`` (the four sub-commands above)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Convert between Hugging Face safetensors, torch.distributed.checkpoint and "
                    "hyper-parallel-dcp checkpoints, streaming (memory holds about one tensor or one batch, "
                    "not the model).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(
        ("hf-to-dcp", "dcp-to-hf", *_TORCH_DCP)) + "}")

    def command(name: str, help_text: str, renames: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("src", metavar="SRC")
        p.add_argument("dst", metavar="DST")
        p.add_argument("--overwrite", action="store_true",
                       help="replace what DST holds (default: refuse a non-empty DST)")
        if renames:
            p.add_argument("--strip-prefix", action="append", default=[], metavar="PREFIX",
                           help="remove PREFIX from tensor names that start with it (repeatable, applied in order), "
                                "e.g. --strip-prefix _orig_mod.")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
        return p

    command("hf-to-dcp", "Hugging Face safetensors (or a torch.save file) -> checkpoint directory").add_argument(
        "--src-platform", choices=("huggingface", "torch"), default="huggingface",
        help="huggingface: a directory with model.safetensors(.index.json) or a .safetensors file; "
             "torch: a full PyTorch checkpoint file (torch.save, loaded with weights_only=True)")
    to_hf = command("dcp-to-hf", "checkpoint directory -> Hugging Face safetensors (weights and index only)")
    to_hf.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                       help="largest output file, as bytes or e.g. 500MB, 5GB, 2GiB (default 5GB)")
    to_hf.add_argument("--dtype", default=None, metavar="DTYPE",
                       help="cast floating-point tensors to bf16, fp16 or fp32 on export")
    selection = to_hf.add_mutually_exclusive_group()
    selection.add_argument("--only", action="append", default=[], metavar="PREFIX",
                           help="export only tensors whose name starts with PREFIX (repeatable; applied before "
                                "--strip-prefix), e.g. --only model.embed")
    selection.add_argument("--all", action="store_true",
                           help="export every tensor of the checkpoint (default for a trainer checkpoint, a "
                                "'model.' subtree beside optimizer state and other objects: the model's weights "
                                "only, with 'model.' stripped)")
    for name, help_text in zip(_TORCH_DCP, ("torch.distributed.checkpoint directory -> checkpoint directory",
                                            "checkpoint directory -> torch.distributed.checkpoint directory")):
        command(name, help_text, renames=False).add_argument(
            "--batch-size", default="256MB", metavar="SIZE",
            help="largest block read and written at once, as bytes or e.g. 64MB, 1GiB (default 256MB); "
                 "memory holds one block")
    return parser


def _check_destination(src: Any, dst: Any, overwrite: bool) -> None:
    """Raise ``ValueError`` (a usage error) for a DST the conversion must not write into."""
    from hyper_parallel_dcp.core.backends import url_scheme
    from hyper_parallel_dcp.storage_fs.files import as_checkpoint_files

    remote = url_scheme(str(dst)) != "file"
    if not remote and dst.exists() and not dst.is_dir():
        raise ValueError(f"DST {dst} exists and is not a directory")
    if not remote and isinstance(src, Path) and src.exists() and dst.exists() and os.path.samefile(src, dst):
        raise ValueError(f"SRC and DST are the same path ({dst})")
    if not overwrite and (as_checkpoint_files(str(dst)).exists() if remote else dst.is_dir() and any(dst.iterdir())):
        raise ValueError(f"DST {dst} is not empty; pass --overwrite to replace it (nothing was written)")


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    """Run the tool with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    if not logging.getLogger().handlers:
        # the user guide's format, so that HP_LOG_CONFIG=DCP:INFO prints its per-phase lines as it shows them
        logging.basicConfig(level=logging.WARNING, format="[%(levelname)s] [HP-DCP]: %(message)s")
    # Imported after parsing: --help and usage errors answer without loading torch.
    from hyper_parallel_dcp.core.backends import url_scheme
    from hyper_parallel_dcp.core.errors import CheckpointError

    from .from_dcp import convert_dcp_to_huggingface
    from .keymap import KeyMapping, only_prefixes, strip_prefixes
    from .options import parse_dtype, parse_size
    from .to_dcp import convert_full_checkpoint_to_dcp
    from .torch_dcp import convert_dcp_to_torch_dcp, convert_torch_dcp_to_dcp

    # a URL (s3://bucket/x) stays a string: Path() would fold its '//'
    src, dst = (a if url_scheme(a) != "file" else Path(a) for a in (args.src, args.dst))
    try:  # the values argparse cannot check are usage errors too
        _check_destination(src, dst, args.overwrite)
        if args.command in _TORCH_DCP:
            batch_bytes = parse_size(args.batch_size)
        elif args.command == "dcp-to-hf":
            parse_size(args.max_shard_size)
            parse_dtype(args.dtype)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    show = not args.quiet
    mapping: KeyMapping = strip_prefixes(*args.strip_prefix) if getattr(args, "strip_prefix", None) else None
    try:
        if args.command in _TORCH_DCP:
            convert = convert_torch_dcp_to_dcp if args.command == _TORCH_DCP[0] else convert_dcp_to_torch_dcp
            report = convert(src, dst, batch_bytes=batch_bytes, progress=show)
        elif args.command == "hf-to-dcp":
            report = convert_full_checkpoint_to_dcp(src, dst, args.src_platform, key_mapping=mapping, progress=show)
        else:
            report = convert_dcp_to_huggingface(
                src, dst, args.max_shard_size, dtype=args.dtype,
                key_mapping=only_prefixes(args.only, mapping) if args.only else mapping,
                model_only=False if args.all or args.only else None, progress=show)
    except (CheckpointError, OSError, ValueError, TypeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if not args.quiet:
        print(f"{prog}: {args.command}: {report.summary()}")
    return EXIT_OK
