"""Sample images from a trained checkpoint (EMA weights by default), DDPM or DDIM, resumable.

    python -m megdiffusion.scripts.sample --ckpt runs/demo --output runs/demo/samples --num_images 1000 \\
        --sampler ddim --steps 50

Image i depends only on (--seed, i); a rerun into the same --output continues where it stopped, and
``--num_gpus N`` spreads the images over N GPUs (one spawned process each) with the same result.
``--guide_ckpt EARLIER_CKPT --guidance 2.5`` guides the model with a weaker version of itself (autoguidance).
A class-conditional model draws image i of class i mod its number of classes, or every image of ``--class_label``.
"""
from absl import app, flags

from megdiffusion.scripts.cli import (UsageError, define_guidance_flags, define_solver_flags, megengine_failures,
                              one_line_errors, parse_flags, reject_arguments)
from megdiffusion.compat import quiet_megengine
from megdiffusion.diffusion.choices import SAMPLERS

FLAGS = flags.FLAGS
flags.DEFINE_string("ckpt", None, "Checkpoint file, or a logdir whose newest valid checkpoint is used.")
flags.DEFINE_bool("ema", True, "Use the EMA weights (--noema: the raw training weights).")
flags.DEFINE_enum("sampler", "ddpm", SAMPLERS, "Ancestral DDPM (respaced for fewer steps), DDIM, or a solver of "
                  "the probability-flow ODE: euler, heun (two network calls per step), dpmpp_2m, dpmpp_3m, unipc "
                  "(DPM-Solver++ and UniPC, one call per step); dpmpp_2m_sde adds noise.")
flags.DEFINE_integer("steps", None, "Denoising steps (default: T for ddpm and ddim, 20 for the solvers). Fewer steps "
                     "use range(0, T, T // steps) (see --spacing).")
flags.DEFINE_string("respacing", None, "Instead of --steps: improved-diffusion's timestep respacing, 'N' (N steps "
                    "evenly spaced, the first and last kept), 'a,b,c' (a, b and c steps in three equal sections) or "
                    "'ddimN' (the smallest stride that gives N).")
flags.DEFINE_float("eta", 0.0, "DDIM eta: 0 is deterministic DDIM, 1 adds DDPM-like noise.")
flags.DEFINE_integer("num_images", 64, "How many images to write (000000.png ...).")
flags.DEFINE_integer("batch_size", 64, "Images per denoising batch (per GPU).")
flags.DEFINE_integer("seed", 0, "Image i depends only on (seed, i).")
flags.DEFINE_string("output", None, "Output directory: PNGs, grid.png, samples.npz, manifest.json.")
flags.DEFINE_bool("npz", True, "Also write samples.npz (uint8 NHWC under arr_0) once all images exist.")
flags.DEFINE_integer("num_gpus", 1, "Spread the images over this many GPUs (megengine.distributed).")
flags.DEFINE_integer("class_label", None, "A class-conditional model (trained with --num_classes): every image of "
                     "this class. Default: image i of class i mod num_classes.")
define_solver_flags()
define_guidance_flags()


def main(argv):
    reject_arguments(argv)
    quiet_megengine()
    from megdiffusion import sampling

    with one_line_errors(), \
            megengine_failures("the images written so far are kept: rerun the same command to continue"):
        if not FLAGS.ckpt or not FLAGS.output:
            raise UsageError("--ckpt and --output are required")
        job = sampling.SampleJob(FLAGS.ckpt, FLAGS.output, FLAGS.num_images, FLAGS.seed, FLAGS.sampler, FLAGS.steps,
                                 FLAGS.respacing, FLAGS.eta, FLAGS.batch_size, FLAGS.ema, npz=FLAGS.npz,
                                 guide_ckpt=FLAGS.guide_ckpt, guidance=FLAGS.guidance, class_label=FLAGS.class_label,
                                 guide_unconditional=FLAGS.guide_unconditional, spacing=FLAGS.spacing,
                                 order=FLAGS.order)
        step = sampling.run_job(job, FLAGS.num_gpus)
    guided = f", guided by {FLAGS.guide_ckpt} with w={FLAGS.guidance:g}" if FLAGS.guide_ckpt else ""
    print(f"{FLAGS.num_images} images in {FLAGS.output} (grid.png{', samples.npz' if FLAGS.npz else ''}), "
          f"from {FLAGS.ckpt} step {step}, {'EMA' if FLAGS.ema else 'raw'} weights{guided}")


def run():
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
