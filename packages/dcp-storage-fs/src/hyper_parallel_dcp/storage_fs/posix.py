"""The project's operating-system calls beyond ``os`` (the one place for ``ctypes`` libc):
mapping, :func:`dont_need`, :func:`exchange`, :func:`drop_cache`, :func:`malloc_trim` and the reads
(:func:`pread_exact`, :func:`readv_exact`); each answers ``None``/``False`` where lacking."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

from hyper_parallel_dcp.core.errors import CorruptCheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["MAPPING", "cached", "dont_need", "drop_cache", "exchange", "malloc_trim", "map_file", "populate_read",
           "pread_exact", "readv_exact", "reserve", "tensor_bytes", "unmap"]

#: bytes per ``preadv`` call (Linux caps one call near 2 GiB)
PREADV_MAX_BYTES = 1 << 30
#: buffers per ``preadv`` / ``writev`` call (below Linux's ``IOV_MAX`` of 1024)
IOV_MAX_BUFFERS = 512

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 1, 2, 0x10, 0x20, 0x4000
_MADV_DONTNEED, _MADV_POPULATE_READ = 4, 22  # POPULATE_READ: Linux 5.14+
_SYS_CACHESTAT = 451  # one number on every architecture (Linux 6.5+)
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100
_MAP_FAILED = ctypes.c_void_p(-1).value
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _bind(name: str, restype: Any, *argtypes: Any) -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # absent from this C library (malloc_trim outside glibc)
        return None
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_mmap = _bind("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
              ctypes.c_int64)
_munmap = _bind("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_madvise = _bind("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_renameat2 = _bind("renameat2", ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint)
_malloc_trim = _bind("malloc_trim", ctypes.c_int, ctypes.c_size_t)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_cachestat = _bind("syscall", ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.POINTER(_Range),
                   ctypes.POINTER(_Cachestat), ctypes.c_uint)

#: whether files can be mapped here (:func:`map_file`, :func:`reserve`)
MAPPING = _mmap is not None and _munmap is not None and _madvise is not None


def _map(at: Optional[int], size: int, prot: int, flags: int, fd: int) -> Optional[int]:
    if not MAPPING:
        return None
    addr = _mmap(at, size, prot, flags | (_MAP_FIXED if at is not None else 0), fd, 0)
    return None if addr is None or addr == _MAP_FAILED or (at is not None and addr != at) else addr


def map_file(fd: int, size: int, at: Optional[int] = None) -> Optional[int]:
    """Map ``size`` bytes of the file ``fd`` read-only and shared (at ``at``, over what is
    there, when given): the address, or ``None`` when refused."""
    return _map(at, size, _PROT_READ, _MAP_SHARED, fd)


def reserve(size: int, at: Optional[int] = None) -> Optional[int]:
    """Reserve ``size`` bytes of address space (at ``at`` when given): the address, or ``None``."""
    return _map(at, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1)


def unmap(addr: int, size: int) -> None:
    _munmap(addr, size)


def populate_read(addr: int, length: int) -> bool:
    """Map every page of ``[addr, addr + length)`` in one call (``MADV_POPULATE_READ``);
    ``False`` where refused (before Linux 5.14)."""
    return _madvise is not None and _madvise(addr, length, _MADV_POPULATE_READ) == 0


def dont_need(addr: int, length: int) -> bool:
    """Drop the resident pages of ``[addr, addr + length)``, widened to whole pages
    (``MADV_DONTNEED``): only for a *file mapping*, which a later access reads again (on
    ordinary memory it zeroes data); ``False`` where refused."""
    first = addr - addr % _PAGE
    end = -(-(addr + length) // _PAGE) * _PAGE
    return _madvise is not None and _madvise(first, end - first, _MADV_DONTNEED) == 0


def cached(fd: int, start: int, length: int) -> bool:
    """Whether the file's bytes ``[start, start + length)`` are all in the page cache;
    ``False`` where the kernel cannot tell (``cachestat``: Linux 6.5+)."""
    global _cachestat
    call = _cachestat
    if call is None:
        return False
    stat = _Cachestat()
    if call(_SYS_CACHESTAT, fd, ctypes.byref(_Range(start, length)), ctypes.byref(stat), 0) != 0:
        _cachestat = None  # ENOSYS (an older kernel) or refused (seccomp): not asked again
        return False
    return stat.nr_cache >= (start + length + _PAGE - 1) // _PAGE - start // _PAGE


def exchange(a: os.PathLike, b: os.PathLike) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``); ``False`` where there is
    no such call, ``OSError`` for any other failure."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def drop_cache(path: os.PathLike) -> None:
    """Drop the clean page cache of file ``path`` (``POSIX_FADV_DONTNEED``), where it can."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def malloc_trim() -> bool:
    """Hand the C heap's free pages back to the system (glibc); ``False`` without glibc."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable zero-copy byte view of a contiguous host tensor."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from the file at ``offset``; :class:`CorruptCheckpointError` naming ``path`` if it ends first."""
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done:done + PREADV_MAX_BYTES]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path} is truncated: needed {total} bytes at offset {offset}, the file ends after {done}")
        done += n


def readv_exact(fd: int, buffers: list[memoryview], offset: int, path: str) -> None:
    """Fill ``buffers`` in turn from the file's bytes at ``offset``; raises as :func:`pread_exact`."""
    total = sum(map(len, buffers))
    done = os.preadv(fd, buffers, offset) if total <= PREADV_MAX_BYTES else 0
    if done == total:
        return
    for view in buffers:  # a short read (a signal, a huge batch): the rest one by one
        if done >= len(view):
            done -= len(view)
        else:
            pread_exact(fd, view[done:], offset + done, path)
            done = 0
        offset += len(view)
