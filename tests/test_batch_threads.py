"""batch_threads.for_batch_chunks: contiguous chunks, errors raised in the caller, BLAS at one thread."""
import gc
import threading

import pytest
from threadpoolctl import ThreadpoolController

from megdiffusion.cpu import batch_threads


def blas_threads():
    return [info["num_threads"] for info in ThreadpoolController().select(user_api="blas").info()]


@pytest.mark.parametrize("threads,n,max_chunk,expected", [
    (2, 4, None, [(0, 2), (2, 4)]),
    (3, 5, None, [(0, 2), (2, 4), (4, 5)]),
    (4, 2, None, [(0, 1), (1, 2)]),  # never an empty chunk
    (2, 7, 2, [(0, 2), (2, 4), (4, 6), (6, 7)]),
    (2, 3, 0, [(0, 1), (1, 2), (2, 3)]),  # a bound below one sample still makes progress
])
def test_chunks_cover_the_batch_once(threads, n, max_chunk, expected, monkeypatch):
    monkeypatch.setattr(batch_threads, "THREADS", threads)
    seen = []
    lock = threading.Lock()

    def work(chunk):
        with lock:
            seen.append((chunk.start, chunk.stop))

    batch_threads.for_batch_chunks(n, work, max_chunk)
    assert sorted(seen) == expected


def test_blas_runs_on_one_thread_inside_and_is_restored_after(monkeypatch):
    monkeypatch.setattr(batch_threads, "THREADS", 2)
    before = blas_threads()
    inside = []
    batch_threads.for_batch_chunks(2, lambda chunk: inside.append(blas_threads()))
    assert inside == [[1] * len(before)] * 2
    assert blas_threads() == before


def test_a_failing_chunk_raises_in_the_caller(monkeypatch):
    monkeypatch.setattr(batch_threads, "THREADS", 2)

    def work(chunk):
        if chunk.start:
            raise RuntimeError("chunk failed")

    with pytest.raises(RuntimeError, match="chunk failed"):
        batch_threads.for_batch_chunks(4, work)
    batch_threads.for_batch_chunks(4, lambda chunk: None)  # the pool still works afterwards


def test_no_garbage_collection_while_chunks_run(monkeypatch):
    """A collection in a chunk thread could free MegEngine tensors from that thread."""
    monkeypatch.setattr(batch_threads, "THREADS", 2)
    enabled = []
    batch_threads.for_batch_chunks(2, lambda chunk: enabled.append(gc.isenabled()))
    assert enabled == [False, False]
    assert gc.isenabled()
