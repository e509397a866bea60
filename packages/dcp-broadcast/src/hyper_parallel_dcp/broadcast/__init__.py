"""hyper_parallel_dcp.broadcast"""
from .__about__ import __version__

__all__ = ["__version__"]
