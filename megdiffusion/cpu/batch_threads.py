"""Numpy work on a batch, split into contiguous chunks that run on one thread per core.

Used by the CPU convolutions (``megdiffusion.cpu.conv``) and the numpy route of the FID Inception.
OpenBLAS (or MKL) is held to one thread while the chunks run: coarse-grained parallelism that also
covers the copies around each matmul, and that does not stall when another thread (MegEngine's)
takes a core for a moment, as OpenBLAS's own threads did. Each chunk writes its own slice of
preallocated outputs, so results do not depend on the number of threads.

Chunks must only run numpy code: MegEngine's dispatch (tensors, ``Module.__call__``) is not usable
from other threads. For the same reason Python's cyclic garbage collector is paused while chunks run:
a collection triggered by a chunk thread would free MegEngine tensors from that thread.
"""
import gc
import os
from concurrent.futures import ThreadPoolExecutor

from threadpoolctl import ThreadpoolController

# The cores this process may run on.
THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

_pool = None
_blas = None


def one_blas_thread():
    """Context manager that holds the BLAS library numpy uses to one thread."""
    global _blas
    if _blas is None:
        _blas = ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas")


def for_batch_chunks(n, work, max_chunk=None):
    """Call ``work(batch_slice)`` on contiguous chunks of a batch of ``n``, in parallel on ``THREADS``.

    One chunk per thread (fewer for small batches), each of at most ``max_chunk`` samples when given
    (to bound temporary buffers). An exception raised by any chunk is raised here.
    """
    global _pool
    size = -(-n // THREADS)
    if max_chunk is not None:
        size = max(1, min(size, max_chunk))
    chunks = [slice(start, min(start + size, n)) for start in range(0, n, size)]
    with one_blas_thread():
        if len(chunks) == 1:
            work(chunks[0])
            return
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="megdiffusion-batch")
        collecting = gc.isenabled()
        gc.disable()
        try:
            for _ in _pool.map(work, chunks):
                pass
        finally:
            if collecting:
                gc.enable()
