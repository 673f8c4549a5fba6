"""The training step's options side by side: images/s, peak memory and the loss after the same steps, one JSON line
per configuration.

The DDPM paper's CIFAR-10 network (``configs/cifar10.cfg``: 35.7M parameters, batch 128, dropout 0 here because
``--trace`` needs it) trains ``--warmup`` untimed then ``--steps`` timed steps through ``Trainer.step`` on real images
in CIFAR-10's shape (the embedded Fashion-MNIST resized to 32x32, gray in three channels; ``--data_path`` a
CIFAR-10 batch directory instead). Every configuration starts from the same weights and sees the same batches and
draws, so their losses compare directly: ``loss_vs_fp32`` is a row's mean loss over the timed steps divided by
the fp32 row's (mixed precision should stay within ~10%, micro-batches, tracing and the training command within
float32 rounding), and ``max_loss_difference_vs_gpus1`` compares the training command on N GPUs with 1, step by step
(the same model: float32 rounding of the all-reduce).

Rows (``--rows``, comma-separated): ``fp32`` (eager float32), ``trace``, ``amp``, ``amp+trace``, ``microbatchM``
(``--microbatch M``), and ``gpus1`` / ``gpusN``: the training command's own run (``train``, spawned processes,
``megengine.distributed`` for N > 1) of the same steps, whose losses should agree step for step. Each row runs in a
process of its own, so its peak memory is its own: MegEngine's allocator statistics on a GPU
(``peak_device_mb``), the process's peak RSS everywhere (``peak_rss_mb``; on CPU also the numpy pass's worker
processes, ``peak_worker_rss_mb``, the largest of them). ``host_reads_per_step``: the host's reads of device values
during a timed step, each a synchronisation; ``--profile`` adds the kernels launched, the ops dispatched from Python
and the interpreter's waits of one eager step (MegEngine's profiler), or the operators of a traced step's two graphs.

    python benchmarks/gpu_step.py                     # on a GPU: fp32, trace, amp, amp+trace, microbatch32
    python benchmarks/gpu_step.py --rows fp32,microbatch32,microbatch8 --steps 1 --warmup 0 [--source engine]
    python benchmarks/gpu_step.py --tiny --rows fp32,amp,trace,microbatch4,gpus1   # a seconds-long check (CPU)

On a CPU, rows that need MegEngine's kernels (amp, trace) run with ``MEGDIFFUSION_FAST_CONV=0`` (slow); the others
take the fast CPU path like the training command (the numpy pass; ``--source engine``: MegEngine's autodiff, which
holds the activations as it does on a GPU, with the fast convolutions).
"""
import argparse
import contextlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megdiffusion.compat import cuda_available, quiet_megengine  # noqa: E402

mge = quiet_megengine()
from megdiffusion.data.datasets import load_dataset  # noqa: E402
from megdiffusion.data.loader import BatchLoader  # noqa: E402
from megdiffusion.training.config import TrainConfig  # noqa: E402
from megdiffusion.training.distributed import select_device  # noqa: E402

PAPER = dict(model_channels=128, channel_mult=(1, 2, 2, 2), num_res_blocks=2, attention_resolutions=(16,),
             image_size=32, batch_size=128, lr=2e-4, warmup_steps=5000, grad_clip=1.0, ema_decay=0.9999)
TINY = dict(model_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(4,), norm_groups=8,
            image_size=8, num_timesteps=40, batch_size=8, lr=2e-3, warmup_steps=0)
DEFAULT_ROWS = "fp32,trace,amp,amp+trace,microbatch32"


def row_options(name):
    """The ``TrainConfig`` changes of row ``name``; ValueError for an unknown name."""
    fixed = {"fp32": {}, "trace": {"trace": True}, "amp": {"amp": True}, "amp+trace": {"amp": True, "trace": True}}
    if name in fixed:
        return fixed[name]
    match = re.fullmatch(r"microbatch(\d+)", name) or re.fullmatch(r"gpus(\d+)", name)
    if match is None:
        raise ValueError(f"unknown row {name!r}: use fp32, trace, amp, amp+trace, microbatchM or gpusN")
    return {"microbatch": int(match[1])} if name.startswith("micro") else {"num_gpus": int(match[1])}


def needs_engine_kernels(options):
    return options.get("amp") or options.get("trace")


def images_and_config(args, logdir=None):
    """The training images (uint8 NHWC, three channels) and the ``TrainConfig`` of every row."""
    size = (TINY if args.tiny else PAPER)["image_size"]
    if args.data_path:
        images = load_dataset("cifar10", path=args.data_path, image_size=size)
    else:
        images = np.repeat(load_dataset("fashion_mnist", image_size=size)[:args.images], 3, axis=3)
    model = {**(TINY if args.tiny else PAPER), **({"batch_size": args.batch_size} if args.batch_size else {})}
    cfg = TrainConfig(**model, image_channels=3, dropout=0.0, seed=0, sample_every=0, save_every=0, log_every=1,
                      total_steps=args.warmup + args.steps, device="cpu" if args.device == "cpu" else "auto")
    return images, cfg


def run_row(args, name):
    """One configuration in this process: its JSON-ready dict."""
    from megdiffusion.training.trainer import Trainer

    options = row_options(name)
    images, cfg = images_and_config(args)
    cfg = cfg.replace(**options)
    select_device(cfg)
    # --source engine: MegEngine's autodiff (with the CPU convolutions on a CPU), as on a GPU
    trainer = Trainer(cfg, engine="megengine" if args.source == "engine" else None)
    loader = BatchLoader(images, cfg.batch_size, cfg.seed, random_flip=False)
    losses, seconds = [], []
    reads = HostReads()
    for step in range(args.warmup + args.steps):
        batch, _ = loader.next_batch()
        with reads.counted(step >= args.warmup):
            start = time.perf_counter()
            metrics = trainer.step(batch)
            seconds.append(time.perf_counter() - start)
        losses.append(metrics["loss"])
    timed = seconds[args.warmup:]
    result = {"row": name, "images_per_s": round(cfg.batch_size / statistics.median(timed), 2),
              "mean_loss": round(float(np.mean(losses[args.warmup:])), 6),
              "skipped_updates": metrics.get("skipped_updates", 0), "loss_scale": metrics.get("loss_scale"),
              "host_reads_per_step": reads.count / args.steps}
    if args.profile:
        result.update(profiled_step(trainer, loader.next_batch()[0]))
    mge._full_sync()
    device_peak = mge.device.get_max_allocated_memory()
    if device_peak:
        result["peak_device_mb"] = round(device_peak / 2 ** 20, 1)
    native_step = getattr(trainer.engine, "native_step", None)
    if native_step is not None and native_step.workers and native_step.workers.processes:
        native_step.workers.close()  # a child's peak RSS is known once it has ended
        result["peak_worker_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return result


class HostReads:
    """Counts the host's reads of device values (``Tensor.numpy``, which ``.item()`` and ``float()`` go through):
    each waits for the device to finish the work before it, a synchronisation."""

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def counted(self, on=True):
        original = mge.Tensor.numpy

        def read(tensor):
            self.count += 1
            return original(tensor)

        if on:
            mge.Tensor.numpy = read
        try:
            yield
        finally:
            mge.Tensor.numpy = original


def profiled_step(trainer, batch):
    """Eager steps: one more step under MegEngine's profiler: the kernels it launched, the ops Python dispatched and
    the interpreter's waits for a tensor. Traced steps (``--trace``): the operators of the two compiled graphs (the
    profiler cannot run around a traced backward: "no fallback implementation for PushScope")."""
    from megengine.utils.profiler import Profiler

    graphs = [getattr(trainer.engine, name, None) for name in ("gradient_graph", "update_graph")]
    if any(hasattr(graph, "_trace") for graph in graphs):
        return {"graph_operators": [len(graph._trace.ops) for graph in graphs]}
    with tempfile.TemporaryDirectory() as scratch:
        with Profiler(path=scratch):
            trainer.step(batch)
        [path] = [os.path.join(scratch, f) for f in os.listdir(scratch) if f.endswith(".json")]
        with open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    begins = [e for e in events if e.get("ph") in ("B", "X")]
    return {"kernels_per_step": sum(e.get("cat") == "Kernel" for e in begins),
            "op_dispatches_per_step": sum(e.get("name") == "OpDispatch" for e in begins),
            "interpreter_waits_per_step": sum(e.get("name") == "TensorWaitProp" for e in begins)}


def run_training(args, name):
    """Row ``gpusN``: the training command's own run on N processes: images/s and the losses of every step."""
    from megdiffusion.training.start import train

    images, cfg = images_and_config(args)
    with tempfile.TemporaryDirectory() as scratch:
        data = os.path.join(scratch, "images.npz")
        np.savez(data, images)  # launched workers load the dataset themselves
        cfg = cfg.replace(dataset="npz", data_path=data, random_flip=False, logdir=os.path.join(scratch, "run"),
                          **row_options(name))
        train(cfg, images, progress=False, use_launcher=cfg.num_gpus > 1)
        with open(os.path.join(cfg.logdir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f]
    losses = [m["loss"] for m in metrics if "loss" in m]
    speeds = [m["images_per_s"] for m in metrics[args.warmup:] if "images_per_s" in m]
    return {"row": name, "images_per_s": round(statistics.median(speeds), 2),
            "mean_loss": round(float(np.mean(losses[args.warmup:])), 6), "losses": losses}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated rows (default {DEFAULT_ROWS})")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (tracing, allocator warm-up)")
    parser.add_argument("--batch_size", type=int, default=0, help="0: the paper's 128 (the tiny model's 8)")
    parser.add_argument("--images", type=int, default=4096, help="how many embedded images to train on")
    parser.add_argument("--data_path", default=None, help="CIFAR-10 python batches instead of Fashion-MNIST")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto")
    parser.add_argument("--source", choices=("auto", "engine"), default="auto",
                        help="engine: MegEngine's autodiff even where the numpy pass would compute the gradients")
    parser.add_argument("--tiny", action="store_true", help="a 0.1M-parameter network on 8x8 images: checks the "
                        "script in seconds")
    parser.add_argument("--profile", action="store_true", help="profile one more step per row: kernels launched, ops "
                        "dispatched from Python, interpreter waits, and the traced graphs' operators")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one row in this process
    args = parser.parse_args()
    names = args.rows.split(",")
    for name in names:
        row_options(name)  # every row name is checked before the first runs
    if args.one:
        run = run_training if args.one.startswith("gpus") else run_row
        print(json.dumps(run(args, args.one)), flush=True)
        return
    common = {"model": "tiny" if args.tiny else "cifar10-paper", "source": args.source, "gpu": cuda_available(),
              "machine": os.uname().nodename, "cpus": os.cpu_count()}
    reference = {}
    for name in names:
        options = row_options(name)
        if options.get("num_gpus", 1) > 1 and mge.device.get_device_count("gpu") < options["num_gpus"]:
            print(json.dumps({"row": name, "skipped": f"needs {options['num_gpus']} GPUs", **common}), flush=True)
            continue
        env = dict(os.environ)
        if needs_engine_kernels(options) and not cuda_available():
            env["MEGDIFFUSION_FAST_CONV"] = "0"
        argv = [arg for arg in sys.argv[1:] if not arg.startswith("--one")]
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--one", name], env=env,
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(json.dumps({"row": name, "error": error, **common}), flush=True)
            continue
        result = json.loads(lines[-1])
        if "fp32" in reference:
            result["loss_vs_fp32"] = round(result["mean_loss"] / reference["fp32"]["mean_loss"], 6)
        if "gpus1" in reference and "losses" in result:
            result["max_loss_difference_vs_gpus1"] = float(
                np.max(np.abs(np.subtract(result["losses"], reference["gpus1"]["losses"]))))
        reference.setdefault(name, result)
        print(json.dumps({**{k: v for k, v in result.items() if k != "losses"}, **common}), flush=True)


if __name__ == "__main__":
    main()
