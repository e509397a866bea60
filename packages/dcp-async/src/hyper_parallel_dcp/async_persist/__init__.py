"""hyper_parallel_dcp.async_persist"""
from .__about__ import __version__

__all__ = ["__version__"]
