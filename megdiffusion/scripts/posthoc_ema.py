"""Rebuild the EMA of any length from a run's post-hoc EMA snapshots (Karras et al. 2024, EDM2, Algorithm 3):
``python -m megdiffusion.scripts.posthoc_ema LOGDIR --sigma_rel 0.03,0.07,0.15 [--step S] --output DIR``.

LOGDIR: a run trained with ``--ema_profiles`` and ``--snapshot_every``. For each ``--sigma_rel`` the weights are the
least-squares combination of every snapshot up to step S whose power-function profiles best match that length's
(``training.posthoc_ema.coefficients``), written to ``DIR/ema_<sigma_rel>.pkl`` (e.g. ``ema_0.070.pkl``): a checkpoint
for ``scripts.sample --ckpt``, ``scripts.fid --ckpt`` and ``scripts.train --init_from``. It prints each combination's
condition number, and warns of a length outside the tracked profiles' span (extrapolated, so less exact). Bad input:
one ``error:`` line, exit code 2, nothing written.
"""
import os
import sys

import numpy as np
from absl import flags

from megdiffusion.scripts import cli, shared_flags
from megdiffusion.scripts.cli import UsageError, define_integer, one_line_errors

FLAGS = flags.FLAGS
flags.DEFINE_list("sigma_rel", None, "The EMA lengths to rebuild, as relative standard deviations, comma-separated, "
                  "each in (0, 0.28] (EDM2's best were 0.03 to 0.15 by model).")
define_integer("step", None, "Rebuild the EMA at this step, one with snapshots; default: the newest snapshot's.", min=1)
flags.DEFINE_string("output", None, "Directory of the rebuilt checkpoints, DIR/ema_<sigma_rel>.pkl (made if "
                    "missing).")
shared_flags.define_overwrite_flag()
flags.adopt_module_key_flags(cli)  # so that --help lists the flags defined there and in shared_flags
flags.adopt_module_key_flags(shared_flags)


def output_name(sigma_rel):
    """The file a rebuilt EMA of ``sigma_rel`` is written to, in the output directory."""
    return f"ema_{sigma_rel:.3f}.pkl"


def _targets():
    """``--sigma_rel`` as floats, checked."""
    from megdiffusion.training.posthoc_ema import MAX_SIGMA_REL

    if not FLAGS.sigma_rel:
        raise UsageError("give --sigma_rel, the EMA lengths to rebuild (e.g. --sigma_rel 0.03,0.07,0.15)")
    try:
        targets = [float(text) for text in FLAGS.sigma_rel]
    except ValueError:
        raise UsageError(f"--sigma_rel must be numbers, comma-separated; got {','.join(FLAGS.sigma_rel)}") from None
    wrong = [t for t in targets if not 0 < t <= MAX_SIGMA_REL]
    if wrong:
        raise UsageError(f"--sigma_rel {wrong[0]:g} is outside (0, {MAX_SIGMA_REL}]: a profile beyond it weights the "
                         "first images most, which no EMA does")
    return targets


def _snapshots(logdir, step):
    """The snapshot dicts of ``logdir`` up to ``step`` (default: all), and the step."""
    from megdiffusion.training.checkpoint import list_snapshots, load_snapshot

    found = list_snapshots(logdir)
    if not found:
        raise UsageError(f"{logdir} holds no post-hoc EMA snapshots (ema_snapshots/snapshot_*.pkl): train with "
                         "--ema_profiles 0.05,0.10 --snapshot_every N")
    steps = [s for s, _ in found]
    step = steps[-1] if step is None else step
    if step not in steps:
        raise UsageError(f"--step {step} has no snapshot in {logdir}; its {len(steps)} snapshots are at steps "
                         f"{steps[0]} to {steps[-1]}: give one of those")
    return [load_snapshot(path) for s, path in found if s <= step], step


def main(argv):
    from megdiffusion.files.disk import check_writable
    from megdiffusion.training import checkpoint
    from megdiffusion.training.config import TrainConfig
    from megdiffusion.training.posthoc_ema import coefficients

    with one_line_errors():
        if len(argv) != 2:
            raise UsageError(f"expected one argument, LOGDIR (a run trained with --ema_profiles and --snapshot_every); "
                             f"got {len(argv) - 1}")
        targets = _targets()
        if not FLAGS.output:
            raise UsageError("give --output DIR, the directory of the rebuilt checkpoints")
        check_writable(FLAGS.output, "--output")
        for target in targets:
            check_writable(os.path.join(FLAGS.output, output_name(target)), "--output", directory=False,
                           overwrite=FLAGS.overwrite)
        snapshots, step = _snapshots(argv[1], FLAGS.step)
        profiles = [(snap["t"], s) for snap in snapshots for s in snap["sigma_rel"]]
        weights = [w for snap in snapshots for w in snap["profiles"]]
        tracked = sorted({s for _, s in profiles})
        t = snapshots[-1]["t"]
        cfg = TrainConfig.from_dict(snapshots[-1]["config"])
        os.makedirs(FLAGS.output, exist_ok=True)
        for target in targets:
            mix, condition = coefficients(profiles, (t, target))
            rebuilt = {name: np.einsum("i,i...->...", mix, np.stack([w[name].astype(np.float64) for w in weights]))
                       .astype(np.float32) for name in weights[0]}
            source = {"format": "post-hoc EMA", "weights": f"EMA of sigma_rel {target:g}", "sigma_rel": f"{target:g}",
                      "tracked": ",".join(f"{s:g}" for s in tracked), "run": os.path.abspath(argv[1]),
                      "step": str(step)}
            path = os.path.join(FLAGS.output, output_name(target))
            checkpoint.save_checkpoint(path, checkpoint.weights_snapshot(cfg, rebuilt, source, step))
            print(f"wrote {path}: sigma_rel {target:g} at step {step:,} ({t:,} images) from {len(snapshots)} "
                  f"snapshots of sigma_rel {', '.join(f'{s:g}' for s in tracked)}; condition number {condition:.3g}, "
                  f"sum of |coefficients| {np.abs(mix).sum():.3g}")
            if not tracked[0] <= target <= tracked[-1]:
                print(f"warning: sigma_rel {target:g} lies outside the tracked profiles' span ({tracked[0]:g} to "
                      f"{tracked[-1]:g}): extrapolated, so less exact than a length between them", file=sys.stderr)


def run():
    """Console entry point (``megdiffusion-posthoc-ema``)."""
    cli.run_command(main)


if __name__ == "__main__":
    run()
