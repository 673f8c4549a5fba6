"""Sample images from a trained checkpoint (EMA weights by default), DDPM or DDIM, resumable.

    python -m megdiffusion.scripts.sample --ckpt runs/demo --output runs/demo/samples --num_images 1000 \\
        --sampler ddim --steps 50

Image i depends only on (--seed, i); a rerun into the same --output continues where it stopped.
"""
import os

from absl import app, flags

from megdiffusion.cli import parse_flags
from megdiffusion.compat import quiet_megengine
from megdiffusion.diffusion.choices import SAMPLERS

FLAGS = flags.FLAGS
flags.DEFINE_string("ckpt", None, "Checkpoint file, or a logdir whose newest valid checkpoint is used.")
flags.DEFINE_bool("ema", True, "Use the EMA weights (--noema: the raw training weights).")
flags.DEFINE_enum("sampler", "ddpm", SAMPLERS, "Ancestral DDPM (respaced for fewer steps) or DDIM.")
flags.DEFINE_integer("steps", None, "Denoising steps (default: T). Fewer steps use range(0, T, T // steps).")
flags.DEFINE_float("eta", 0.0, "DDIM eta: 0 is deterministic DDIM, 1 adds DDPM-like noise.")
flags.DEFINE_integer("num_images", 64, "How many images to write (000000.png ...).")
flags.DEFINE_integer("batch_size", 64, "Images per denoising batch (per GPU).")
flags.DEFINE_integer("seed", 0, "Image i depends only on (seed, i).")
flags.DEFINE_string("output", None, "Output directory: PNGs, grid.png, samples.npz, manifest.json.")
flags.DEFINE_bool("npz", True, "Also write samples.npz (uint8 NHWC under arr_0) once all images exist.")
flags.DEFINE_integer("num_gpus", 1, "Spread the images over this many GPUs (megengine.distributed).")


def load():
    """The model, diffusion, image shape (C, H, W) and output settings of the flags' checkpoint."""
    from megdiffusion import sampling

    model, diffusion, cfg, step = sampling.load_model(FLAGS.ckpt, ema=FLAGS.ema)
    sampling.check_sampler(diffusion, FLAGS.sampler, FLAGS.steps, FLAGS.eta)
    image_shape = cfg.image_shape
    settings = {"checkpoint": os.path.abspath(FLAGS.ckpt), "step": step, "ema": FLAGS.ema,
                "sampler": FLAGS.sampler, "steps": FLAGS.steps, "eta": FLAGS.eta, "seed": FLAGS.seed}
    return model, diffusion, image_shape, settings


def sample_share(loaded, rank=0, world_size=1):
    """Write this rank's share of the missing images into --output."""
    from megdiffusion.sampling import sample_to_directory

    model, diffusion, image_shape, _ = loaded
    sample_to_directory(model, diffusion, image_shape, FLAGS.output, FLAGS.num_images, FLAGS.seed,
                        FLAGS.sampler, FLAGS.steps, FLAGS.eta, FLAGS.batch_size, rank, world_size)


def _distributed_share():
    import megengine.distributed as dist

    sample_share(load(), dist.get_rank(), dist.get_world_size())


def main(argv):
    del argv
    quiet_megengine()
    from megdiffusion import sampling
    from megdiffusion.cli import UsageError, megengine_failures, one_line_errors
    from megdiffusion.compat import cuda_available

    with one_line_errors(), \
            megengine_failures("the images written so far are kept: rerun the same command to continue"):
        if not FLAGS.ckpt or not FLAGS.output:
            raise UsageError("--ckpt and --output are required")
        if FLAGS.num_images < 1 or FLAGS.batch_size < 1 or FLAGS.num_gpus < 1:
            raise UsageError("--num_images, --batch_size and --num_gpus must be positive")
        if FLAGS.num_gpus > 1 and not cuda_available():
            raise UsageError(f"--num_gpus {FLAGS.num_gpus} needs CUDA GPUs, but MegEngine sees none; "
                             "use --num_gpus 1")
        loaded = load()
        settings = loaded[3]
        sampling.prepare_output(FLAGS.output, settings)  # checked once, before any worker writes
    if FLAGS.num_gpus == 1:
        sample_share(loaded)
    else:
        import megengine.distributed as dist

        dist.launcher(_distributed_share, n_gpus=FLAGS.num_gpus)()
    sampling.write_summaries(FLAGS.output, FLAGS.num_images, npz=FLAGS.npz)
    print(f"{FLAGS.num_images} images in {FLAGS.output} (grid.png{', samples.npz' if FLAGS.npz else ''}), "
          f"from {FLAGS.ckpt} step {settings['step']}, {'EMA' if FLAGS.ema else 'raw'} weights")


def run():
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
