"""Rebuild the EMA of any length from a run's post-hoc EMA snapshots (Karras et al. 2024, EDM2, Algorithm 3):
``python -m megdiffusion.scripts.posthoc_ema LOGDIR --sigma_rel 0.03,0.07,0.15 [--step S] --output DIR``.

LOGDIR: a run trained with ``--ema_profiles`` and ``--snapshot_every``. For each ``--sigma_rel`` the weights are the
least-squares combination of every snapshot up to step S whose power-function profiles best match that length's
(``training.posthoc_ema.coefficients``), written to ``DIR/ema_<sigma_rel>.pkl`` (e.g. ``ema_0.070.pkl``): a checkpoint
for ``scripts.sample --ckpt``, ``scripts.fid --ckpt`` and ``scripts.train --init_from``. It prints each combination's
condition number, and warns of a length outside the tracked profiles' span (extrapolated, so less exact). Bad input:
one ``error:`` line, exit code 2, nothing written.
"""
import sys

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


def _targets():
    """``--sigma_rel`` as floats, checked."""
    from megdiffusion.training.posthoc_ema import parse_sigma_rels

    if not FLAGS.sigma_rel:
        raise UsageError("give --sigma_rel, the EMA lengths to rebuild (e.g. --sigma_rel 0.03,0.07,0.15)")
    try:
        return parse_sigma_rels(FLAGS.sigma_rel, "--sigma_rel")
    except ValueError as err:
        raise UsageError(str(err)) from None


def main(argv):
    from megdiffusion.files.disk import check_writable
    from megdiffusion.training.checkpoint import rebuild_ema, rebuilt_path

    with one_line_errors():
        if len(argv) != 2:
            raise UsageError(f"expected one argument, LOGDIR (a run trained with --ema_profiles and --snapshot_every); "
                             f"got {len(argv) - 1}")
        targets = _targets()
        if not FLAGS.output:
            raise UsageError("give --output DIR, the directory of the rebuilt checkpoints")
        check_writable(FLAGS.output, "--output")
        for target in targets:
            check_writable(rebuilt_path(FLAGS.output, target), "--output", directory=False, overwrite=FLAGS.overwrite)
        rebuilt = rebuild_ema(argv[1], targets, FLAGS.output, FLAGS.step)
    for r in rebuilt:
        tracked = r["tracked"]
        print(f"wrote {r['path']}: sigma_rel {r['sigma_rel']:g} at step {r['step']:,} ({r['t']:,} images) from "
              f"{r['snapshots']} snapshots of sigma_rel {', '.join(f'{s:g}' for s in tracked)}; condition number "
              f"{r['condition_number']:.3g}, sum of |coefficients| {r['coefficient_abs_sum']:.3g}")
        if not tracked[0] <= r["sigma_rel"] <= tracked[-1]:
            print(f"warning: sigma_rel {r['sigma_rel']:g} lies outside the tracked profiles' span ({tracked[0]:g} to "
                  f"{tracked[-1]:g}): extrapolated, so less exact than a length between them", file=sys.stderr)


def run():
    """Console entry point (``megdiffusion-posthoc-ema``)."""
    cli.run_command(main)


if __name__ == "__main__":
    run()
