"""Sample images from a trained checkpoint (EMA weights by default), DDPM, DDIM or an ODE/SDE solver, resumable.

    python -m megdiffusion.scripts.sample --ckpt runs/demo --output runs/demo/samples --num_images 1000 \\
        --sampler ddim --steps 50

Image i depends only on (--seed, i); a rerun into the same --output continues where it stopped, and
``--num_gpus N`` spreads the images over N GPUs (one spawned process each) with the same result.
``--guide_ckpt EARLIER_CKPT --guidance 2.5`` guides the model with a weaker version of itself (autoguidance).
A class-conditional model draws image i of class i mod its number of classes, or every image of ``--class_label``.
"""
from absl import flags

from megdiffusion.scripts import cli, shared_flags
from megdiffusion.scripts.cli import (MAX_IMAGES, UsageError, define_integer, megengine_failures, one_line_errors,
                                      reject_arguments)
from megdiffusion.training.config import field_bounds

FLAGS = flags.FLAGS
shared_flags.define_model_flags()
shared_flags.define_sampler_flags()
shared_flags.define_respacing_flag()
shared_flags.define_eta_flag()
shared_flags.define_guidance_flags()
shared_flags.define_batch_flags()
define_integer("num_images", 64, "How many images to write (000000.png ...).", min=1, max=MAX_IMAGES)
flags.DEFINE_string("output", None, "Output directory: PNGs, grid.png, samples.npz, manifest.json.")
flags.DEFINE_bool("npz", True, "Also write samples.npz (uint8 NHWC under arr_0) once all images exist.")
define_integer("num_gpus", 1, "Spread the images over this many GPUs (megengine.distributed).",
               **field_bounds("num_gpus"))
flags.DEFINE_integer("class_label", None, "A class-conditional model (trained with --num_classes): every image of "
                     "this class. Default: image i of class i mod num_classes.")
flags.adopt_module_key_flags(cli)  # so that --help lists the flags defined there and in shared_flags
flags.adopt_module_key_flags(shared_flags)


def main(argv):
    reject_arguments(argv)
    from megdiffusion import sampling

    with one_line_errors(), \
            megengine_failures("the images written so far are kept: rerun the same command to continue"):
        if not FLAGS.ckpt or not FLAGS.output:
            raise UsageError("--ckpt and --output are required")
        job = sampling.SampleJob(FLAGS.ckpt, FLAGS.output, FLAGS.num_images, FLAGS.seed,
                                 shared_flags.sampler_settings(FLAGS, "sample"), FLAGS.batch_size, FLAGS.ema,
                                 npz=FLAGS.npz, guide_ckpt=FLAGS.guide_ckpt, guidance=FLAGS.guidance,
                                 class_label=FLAGS.class_label, guide_unconditional=FLAGS.guide_unconditional)
        step = sampling.run_job(job, FLAGS.num_gpus)
    guided = f", guided by {FLAGS.guide_ckpt} with w={FLAGS.guidance:g}" if FLAGS.guide_ckpt else ""
    print(f"{FLAGS.num_images} images in {FLAGS.output} (grid.png{', samples.npz' if FLAGS.npz else ''}), "
          f"from {FLAGS.ckpt} step {step}, {'EMA' if FLAGS.ema else 'raw'} weights{guided}")


def run():
    cli.run_command(main)


if __name__ == "__main__":
    run()
