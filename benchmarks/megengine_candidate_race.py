"""MegEngine alone (no megdiffusion, no numpy threads): the interpreter race behind the fast path's crashes.

MegEngine 1.13's imperative interpreter registers every produced tensor larger than
``dtr_evictee_minimum_size`` (1 MiB by default) in a "DTR candidate" vector, whether or not DTR is enabled.
The worker thread inserts into and erases from that vector as it produces and frees tensors. ``Tensor.numpy()``
(``ChannelImpl::get_value``) also edits it, from the calling thread: it "pins" the tensor (erase from the
vector, swapping the last entry into its place) and "unpins" it (push_back) around the wait, under a lock the
worker does not take. When the worker is still busy with earlier ops, both threads change the vector at once:
entries get the wrong ``cand_index``, freed entries stay in it, and the heap is corrupted. What that looks
like varies: ``insert_candidate: got wrong candidate index``, then "an input tensor is unusable due to
previous error"; glibc aborts (``realloc(): invalid old size``, ``corrupted size vs. prev_size``); segfaults.

This script queues ops that produce and free 2 MiB tensors, and calls ``.numpy()`` on another 2 MiB tensor
while the worker runs them. Each run is a fresh process; one JSON line per run, then a summary.

    python benchmarks/megengine_candidate_race.py --runs 5 --seconds 20
    MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE=4611686018427387904 python benchmarks/megengine_candidate_race.py
    MEGENGINE_INTERP_ASYNC_LEVEL=0 python benchmarks/megengine_candidate_race.py

The second command keeps the candidate vector empty (what ``import megdiffusion`` does), the third makes every
op synchronous, so the worker is idle whenever ``.numpy()`` runs; neither fails.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time


def child(seconds):
    """The race, in this process; prints the number of rounds, or the error MegEngine raised."""
    import numpy as np

    import megengine

    big = megengine.tensor(np.ones((512, 1024), np.float32))  # 2 MiB: a candidate
    fetched = big + 1.0
    fetched.numpy()
    rounds = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for k in range(20):
                product = big * float(k)  # the worker produces these and frees the previous one
            for _ in range(200):
                fetched.numpy()  # pin + unpin of a candidate while the worker works
            product.numpy()  # let the worker catch up: the queue stays short
            rounds += 1
        print(json.dumps({"rounds": rounds, "error": None}), flush=True)
    except Exception as error:  # noqa: BLE001 -- report whatever MegEngine raised
        print(json.dumps({"rounds": rounds, "error": str(error).strip().splitlines()[0]}), flush=True)
    os._exit(0)  # MegEngine's exit handlers would raise the stored error again


def describe(returncode, stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    if returncode is None:
        return {"rounds": None, "error": "process hung"}
    name = signal.Signals(-returncode).name if returncode < 0 else f"exit {returncode}"
    return {"rounds": None, "error": f"process died: {name}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.seconds)
    failed = 0
    for run in range(args.runs):
        argv = [sys.executable, os.path.abspath(__file__), "--child", "--seconds", str(args.seconds)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.seconds * 3 + 60)
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess(argv, None, "", "")
        result = describe(proc.returncode, proc.stdout)
        glibc = [line.strip() for line in proc.stderr.splitlines() if "free()" in line or "corrupted" in line
                 or "realloc()" in line or "candidate" in line]
        result.update(run=run, stderr=glibc[:2])
        failed += result["error"] is not None
        print(json.dumps(result), flush=True)
    settings = {name: os.environ.get(name) for name in ("MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE",
                                                       "MEGENGINE_INTERP_ASYNC_LEVEL", "MGB_WORKER_MAX_SPIN")}
    print(json.dumps({"summary": True, "runs": args.runs, "failed": failed, "seconds": args.seconds, **settings}))


if __name__ == "__main__":
    main()
