"""Hand the C heap's free pages back to the operating system (glibc's malloc_trim).

A long segmented forward on a CPU keeps a few tensors of every segment (its output hidden
states, latents, carry) and frees the rest; glibc's heap then holds the freed space between
those survivors, and the next segment's larger blocks do not fit in it, so the heap's resident
size grows by tens of KiB per token while the live tensors grow by about 1 KiB
(docs/benchmarks.md, "Where the learner's bytes go"). `malloc_trim(0)` releases every whole free
page of the heap (not only its top) at a few milliseconds a call. Elsewhere than glibc Linux
this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import sys


def release_free_heap() -> bool:
    """malloc_trim(0) where glibc provides it -> whether any memory went back to the OS."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (has malloc_trim), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc
