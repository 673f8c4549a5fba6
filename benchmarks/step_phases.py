"""Seconds per phase of ``Trainer.step`` on the fast CPU path, MegEngine's update vs the flat numpy update.

Phases, with ``megengine._full_sync()`` before and after each so that MegEngine's asynchronous work is
counted where it is queued: ``forward`` (the training loss), ``backward``, then the update:

- ``megengine`` (MegEngine's ``clip_grad_norm``, ``Adam.step``, the EMA of ``Trainer._update_ema``; the
  path with ``MEGDIFFUSION_FAST_CONV=0`` or on GPU): ``clip``, ``adam``, ``ema``;
- ``flat`` (``megdiffusion.training.flat_update``, the fast CPU path): ``norm`` (gathering the gradients
  and their norm), ``update`` (clip, Adam and EMA in numpy, the parameters written back into MegEngine).

``total`` is the whole step; ``<phase>_cpu`` the CPU seconds of all threads (steadier than wall seconds
on a loaded machine). Convolutions take the fast CPU path in both; the update path is chosen by replacing
``trainer.fast_conv_enabled`` for the update only, alternating in rounds (the first step after each switch
is not timed), so machine load hits both alike. Prints one JSON line per step, then per model the median
of each phase and the ratio of the update phases' sums (megengine / flat).

    python benchmarks/step_phases.py --models cpu,cifar --rounds 2 --steps 2
"""
import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.train_step import cifar_shaped, cpu_recipe  # noqa: E402
from megdiffusion.compat import quiet_megengine  # noqa: E402

mge = quiet_megengine()
from megdiffusion.cpu.conv import set_fast_conv  # noqa: E402
from megdiffusion.training import flat_update  # noqa: E402
from megdiffusion.training import trainer as trainer_module  # noqa: E402
from megdiffusion.training.trainer import Trainer  # noqa: E402

UPDATE_PHASES = {"megengine": ("clip", "adam", "ema"), "flat": ("norm", "update")}


class PhaseTimer:
    """Wraps the functions a step calls so that each records its synchronised wall seconds under a phase
    name, and its CPU seconds (all threads of the process) under ``<name>_cpu``."""

    def __init__(self):
        self.seconds = {}

    def wrap(self, name, function):
        def timed(*args, **kwargs):
            mge._full_sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            result = function(*args, **kwargs)
            mge._full_sync()
            for key, value in ((name, time.perf_counter() - start), (f"{name}_cpu", time.process_time() - start_cpu)):
                self.seconds[key] = self.seconds.get(key, 0.0) + value
            return result
        return timed


def instrument(trainer, timer):
    """Route ``trainer``'s phases through ``timer`` (instance and module attributes of this process only)."""
    trainer.diffusion.training_loss = timer.wrap("forward", trainer.diffusion.training_loss)
    trainer.grad_manager.backward = timer.wrap("backward", trainer.grad_manager.backward)
    trainer_module.clip_grad_norm = timer.wrap("clip", trainer_module.clip_grad_norm)
    trainer._optimizer.step = timer.wrap("adam", trainer._optimizer.step)
    trainer._update_ema = timer.wrap("ema", trainer._update_ema)
    flat_update.FlatUpdate.gradient_norm = timer.wrap("norm", flat_update.FlatUpdate.gradient_norm)
    flat_update.FlatUpdate.step = timer.wrap("update", flat_update.FlatUpdate.step)


def run(name, cfg, x0, rounds, steps):
    set_fast_conv(True)
    trainer, timer = Trainer(cfg), PhaseTimer()
    instrument(trainer, timer)
    phases = defaultdict(lambda: defaultdict(list))
    for round_index in range(rounds):
        for path in ("megengine", "flat"):
            trainer_module.fast_conv_enabled = lambda: path == "flat"
            trainer.step(x0)  # not timed: the first step after a switch hands the state over
            for _ in range(steps):
                timer.seconds = {}
                start, start_cpu = time.perf_counter(), time.process_time()
                trainer.step(x0)
                record = {**timer.seconds, "total": time.perf_counter() - start,
                          "total_cpu": time.process_time() - start_cpu}
                for phase, seconds in record.items():
                    phases[path][phase].append(seconds)
                print(json.dumps({"model": name, "path": path, "round": round_index,
                                  **{k: round(v, 4) for k, v in record.items()}}), flush=True)
    medians = {path: {phase: round(statistics.median(values), 4) for phase, values in by_phase.items()}
               for path, by_phase in phases.items()}
    update = {path: sum(medians[path][phase] for phase in UPDATE_PHASES[path]) for path in medians}
    print(json.dumps({"model": name, "summary": True, "batch": len(x0), "tensors": len(trainer.params),
                      "parameters": sum(p.size for p in trainer.params), **medians,
                      "update_ratio": round(update["megengine"] / update["flat"], 1),
                      "total_ratio": round(medians["megengine"]["total"] / medians["flat"]["total"], 3)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cpu,cifar", help="comma-separated: cpu, cifar")
    parser.add_argument("--rounds", type=int, default=2, help="megengine/flat pairs per model")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per path and round")
    args = parser.parse_args()
    models = args.models.split(",")
    if sorted(set(models) - {"cpu", "cifar"}) or min(args.rounds, args.steps) < 1:
        parser.error("--models takes cpu and/or cifar; --rounds and --steps must be >= 1")
    for name in models:
        cfg, x0 = cpu_recipe() if name == "cpu" else cifar_shaped(16, 1)
        run(name, cfg, x0, args.rounds, args.steps)


if __name__ == "__main__":
    main()
