"""hyper_parallel_dcp.offline_transform: Hugging Face safetensors ⇄ checkpoint, in one process,
streaming (memory holds about one tensor or one batch)."""

from .__about__ import __version__
from .from_dcp import convert_dcp_to_huggingface, dcp_to_full_state_dict, save_state_dict_as_huggingface_format
from .hf_source import parse_checkpoint_from_huggingface, scan_huggingface_checkpoint
from .hf_writer import plan_huggingface_shards
from .keymap import prefix_rules, strip_prefixes
from .options import parse_size
from .progress import ConversionReport
from .to_dcp import convert_full_checkpoint_to_dcp, full_state_dict_to_dcp_format

__all__ = [
    "ConversionReport",
    "__version__",
    "convert_dcp_to_huggingface",
    "convert_full_checkpoint_to_dcp",
    "dcp_to_full_state_dict",
    "full_state_dict_to_dcp_format",
    "parse_checkpoint_from_huggingface",
    "parse_size",
    "plan_huggingface_shards",
    "prefix_rules",
    "save_state_dict_as_huggingface_format",
    "scan_huggingface_checkpoint",
    "strip_prefixes",
]
