"""Stress the fast CPU path: training steps and eval-mode sampling calls, alternating, for a time budget.

Each run is a fresh child process (a MegEngine abort cannot take the harness down, and each run starts
from the same state) that trains the CPU recipe (configs/fashion_mnist_cpu.cfg, its batch, real images)
and, every ``--sample_every`` steps, samples a batch with the EMA model (DDIM). It prints one JSON line
per run: steps, sampling calls, seconds, and the first error line (null when none), and at the end the
totals. Exit status 1 when any run failed.

Factors, one at a time (each applies to every run of the invocation):
  --eval_numpy          sampling calls with numpy convolutions too (eval mode keeps MegEngine's forward,
                        which is faster for sampling; this stresses the numpy forward as sampling once
                        used it)
  --async_level N       megengine.config.async_level (2: MegEngine's default; 0: every op synchronous)
  --spin N|default|megengine
                        MGB_WORKER_MAX_SPIN: megdiffusion's cap (1000 on CPU-only machines), a number,
                        or MegEngine's own calibrated spin
  --threads N           threads of megdiffusion.cpu.batch_threads (1: chunks run in the calling thread)
  --no_gc_pause         keep Python's garbage collector enabled while batch chunks run
  --native              MegEngine's own convolutions (MEGDIFFUSION_FAST_CONV=0)
  --dtr_threshold BYTES MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE (megdiffusion keeps MegEngine's DTR candidate list
                        empty; 1048576, MegEngine's default, is how it ran before the fix)

    python benchmarks/stress.py --minutes 10 --runs 3
    python benchmarks/stress.py --minutes 5 --runs 2 --dtr_threshold 1048576   # as before the fix
    python benchmarks/stress.py --minutes 5 --runs 2 --async_level 0
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(args):
    """One stress run in this process; prints its JSON result line."""
    if args.spin == "megengine":
        import megengine  # noqa: F401 -- imported first, megdiffusion leaves MegEngine's spin as it is
    elif args.spin != "default":
        os.environ["MGB_WORKER_MAX_SPIN"] = args.spin
    os.environ["MEGDIFFUSION_FAST_CONV"] = "0" if args.native else "1"
    if args.dtr_threshold is not None:
        os.environ["MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE"] = str(args.dtr_threshold)
    sys.path.insert(0, ROOT)
    from megdiffusion.compat import is_megengine_error, megengine_error_cause, quiet_megengine

    mge = quiet_megengine()
    mge.config.async_level = args.async_level
    from megdiffusion.cpu import batch_threads
    from megdiffusion.files.images import to_float
    from megdiffusion.cpu import conv
    from megdiffusion.diffusion.generation import generate_images
    from megdiffusion.diffusion.sampler_settings import SamplerSettings
    from megdiffusion.training.config import CPU_RECIPE
    from megdiffusion.scripts.cli import config_from_flagfile
    from megdiffusion.training.trainer import Trainer

    if args.threads:
        batch_threads.THREADS = args.threads
    if args.no_gc_pause:
        batch_threads.gc.disable = lambda: None
    if args.eval_numpy:
        conv.Conv2d.train = lambda self, mode=True, recursive=True: None  # stays in training mode: numpy forward

    cfg, images = config_from_flagfile(CPU_RECIPE, seed=args.seed)
    trainer = Trainer(cfg)
    result = {"steps": 0, "sample_calls": 0, "error": None}
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    try:
        while time.monotonic() < deadline:
            first = (result["steps"] * cfg.batch_size) % (len(images) - cfg.batch_size)
            trainer.step(to_float(images[first:first + cfg.batch_size]))
            result["steps"] += 1
            if result["steps"] % args.sample_every == 0:
                with trainer.state() as state:
                    generate_images(state.ema, trainer.diffusion, cfg.image_shape, range(args.sample_batch),
                                    args.seed, SamplerSettings("ddim", args.sample_steps),
                                    batch_size=args.sample_batch)
                result["sample_calls"] += 1
    except Exception as error:  # noqa: BLE001 -- the harness reports whatever MegEngine raised
        result["error"] = (megengine_error_cause(error) if is_megengine_error(error)
                           else f"{type(error).__name__}: {str(error).strip().splitlines()[0]}")
    result["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(result), flush=True)
    os._exit(0)  # skip MegEngine's atexit handlers: after an error they raise again


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget of each run")
    parser.add_argument("--runs", type=int, default=1, help="runs, each a fresh process")
    parser.add_argument("--sample_every", type=int, default=10, help="training steps between sampling calls")
    parser.add_argument("--sample_batch", type=int, default=64, help="images per sampling call")
    parser.add_argument("--sample_steps", type=int, default=10, help="DDIM steps per sampling call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_numpy", action="store_true")
    parser.add_argument("--async_level", type=int, default=2, choices=(0, 1, 2))
    parser.add_argument("--spin", default="default")
    parser.add_argument("--threads", type=int, default=0, help="0: one per core")
    parser.add_argument("--no_gc_pause", action="store_true")
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--dtr_threshold", type=int, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.minutes <= 0 or args.runs < 1 or args.sample_every < 1 or args.sample_batch < 1:
        parser.error("--minutes, --runs, --sample_every and --sample_batch must be positive")
    if args.child:
        child(args)
    factors = {k: v for k, v in vars(args).items() if k not in ("runs", "child")}
    failed = steps = calls = 0
    seconds = 0.0
    for run in range(args.runs):
        argv = [sys.executable, os.path.abspath(__file__), "--child"] + sys.argv[1:]
        proc = subprocess.run(argv, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {"steps": None, "sample_calls": None, "error": None}
        if proc.returncode != 0 or not lines:
            tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
            result["error"] = result["error"] or f"exit {proc.returncode}: {' | '.join(tail)}"
        worker_errors = [line.strip() for line in proc.stderr.splitlines()
                         if "assert" in line or "Error" in line][:3]
        result.update(run=run, worker_stderr=worker_errors)
        print(json.dumps(result), flush=True)
        failed += result["error"] is not None
        steps += result["steps"] or 0
        calls += result["sample_calls"] or 0
        seconds += result.get("seconds", 0.0)
    print(json.dumps({"summary": True, "runs": args.runs, "failed": failed, "steps": steps,
                      "sample_calls": calls, "minutes": round(seconds / 60, 1), **factors}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
