"""Negative log-likelihood in bits per dimension: ``python -m megdiffusion.scripts.nll --ckpt RUN PATH``.

The variational bound of each image of PATH under a trained model (EMA weights by default): the prior term plus
one term per timestep, the KL of each reverse step and the discretized-Gaussian decoder at t = 0 (Ho et al. eq. 5;
improved-diffusion's ``calc_bpd_loop``), over all T timesteps or those ``--steps``/``--respacing`` keep (fewer
steps give a looser bound). PATH: what ``scripts.fid`` reads (a directory of images, an npz of uint8 NHWC images,
``fashion_mnist``, ``cifar10:DIR``), images of the model's size and channels. Image i's noise depends only on
(--seed, i). Bad input: one ``error:`` line, exit code 2.
"""
import math

import numpy as np
from absl import flags

from megdiffusion.scripts import cli, shared_flags
from megdiffusion.scripts.cli import MAX_IMAGES, UsageError, define_integer, megengine_failures, one_line_errors

FLAGS = flags.FLAGS
shared_flags.define_model_flags()
shared_flags.define_batch_flags()
define_integer("num_images", None, "Evaluate the first N images of PATH (default: all).", min=1, max=MAX_IMAGES)
flags.DEFINE_integer("steps", None, "Timesteps of the bound (default: T); fewer use range(0, T, T // steps).")
shared_flags.define_respacing_flag()
shared_flags.define_progress_flag()
flags.adopt_module_key_flags(cli)  # so that --help lists the flags defined there and in shared_flags
flags.adopt_module_key_flags(shared_flags)


def _images(spec, image_shape, num_images):
    """The first ``num_images`` images of ``spec``, checked to have the model's (C, H, W)."""
    from megdiffusion.data.spec import DataSpec

    images = DataSpec.parse(spec).images()
    count = len(images) if num_images is None else num_images
    if count > len(images):
        raise UsageError(f"{spec} has {len(images)} images, fewer than --num_images={num_images}")
    selected = images[:count] if isinstance(images, np.ndarray) else [images[i] for i in range(count)]
    channels, size = image_shape[0], image_shape[1]
    for index, image in enumerate(selected):
        if image.shape != (size, size, channels):
            raise UsageError(f"image {index} of {spec} is {'x'.join(map(str, image.shape))} (HxWxC); the model "
                             f"takes {size}x{size}x{channels}")
    return selected


def main(argv):
    from megdiffusion.progress import progress_bar
    from megdiffusion.sampling.jobs import SamplingError
    from megdiffusion.sampling.model import open_model
    from megdiffusion.training.config import build_diffusion

    with one_line_errors(), megengine_failures("rerun the same command"):
        if len(argv) != 2:
            raise UsageError(f"expected one argument, the images PATH; got {len(argv) - 1}")
        if not FLAGS.ckpt:
            raise UsageError("--ckpt is required (a checkpoint file or a run's logdir)")
        opened = open_model(FLAGS.ckpt, ema=FLAGS.ema)
        cfg, step = opened.config, opened.step
        if cfg.num_classes:
            raise UsageError(f"{FLAGS.ckpt} is class-conditional (trained with --num_classes {cfg.num_classes}); "
                             "the bound needs each image's class, which scripts.nll does not read: use an "
                             "unconditional model")
        try:
            build_diffusion(cfg, chain_only=True).respaced(FLAGS.steps, FLAGS.respacing)  # before MegEngine
        except ValueError as err:
            raise SamplingError(str(err)) from None
        images = _images(argv[1], cfg.image_shape, FLAGS.num_images)
        from megdiffusion.metrics.evaluate import bits_per_dim  # MegEngine's, once the input is checked

        model = opened.build()
        diffusion, chain = model.diffusion, model.diffusion.respaced(FLAGS.steps, FLAGS.respacing)
        with progress_bar(total=len(images), unit="img", desc="bits/dim", disable=not FLAGS.progress,
                          bar_format="{l_bar}{bar}| {n:.1f}/{total} [{elapsed}<{remaining}]") as bar:
            result = bits_per_dim(model.network, chain, images, FLAGS.seed, FLAGS.batch_size, progress=bar)
    total = result["total_bpd"]
    error = total.std(ddof=1) / math.sqrt(len(total)) if len(total) > 1 else float("nan")
    print(f"NLL: {total.mean():.4f} bits/dim (standard error {error:.4f}; {len(total)} images of {argv[1]}, "
          f"{'EMA' if FLAGS.ema else 'raw'} weights of {FLAGS.ckpt} step {step}, {chain.num_timesteps} of "
          f"T={diffusion.num_timesteps} timesteps); prior term {result['prior_bpd'].mean():.4f}, decoder term (t = 0) "
          f"{result['vb'][:, 0].mean():.4f}")


def run():
    """Console entry point (``megdiffusion-nll``)."""
    cli.run_command(main)


if __name__ == "__main__":
    run()
