"""Convert a published DDPM checkpoint: ``python -m megdiffusion.scripts.convert SRC OUT [--format auto|...] [--ema]``.

SRC: a diffusers ``UNet2DModel`` directory, pesser/pytorch_diffusion's (and ddim's) ``model-*.ckpt``,
pytorch-ddpm's ``ckpt.pt``, a MegEngine/MegDiffusion ``.pkl`` or an improved-diffusion ``.pt`` (its model or EMA
files, e.g. ``cifar10_uncond_50M_500K.pt``); the format is read from the content
(``megdiffusion.formats.convert``). OUT: a megdiffusion checkpoint with its config inside, for
``scripts.sample --ckpt``, ``scripts.fid --ckpt`` and ``scripts.train --init_from``. Every tensor maps onto one
parameter and every parameter is filled, or nothing is written. Bad input: one ``error:`` line, exit code 2.
"""
from absl import flags

from megdiffusion.diffusion.choices import VAR_TYPES
from megdiffusion.diffusion.schedules import SCHEDULES
from megdiffusion.files.disk import check_not_input, check_writable
from megdiffusion.formats import CHANNEL_ORDERS, FORMATS
from megdiffusion.scripts import cli, shared_flags
from megdiffusion.scripts.cli import UsageError, define_integer, megengine_failures, one_line_errors
from megdiffusion.training.config import field_bounds

FLAGS = flags.FLAGS
flags.DEFINE_enum("format", "auto", ("auto",) + FORMATS, "The checkpoint's format; auto: read from the content.")
shared_flags.define_overwrite_flag()
# Its own --ema, --image_size, ... (shared_flags.OWN_FLAGS): a published file's weights and network, bounded like the
# training config's fields they become.
flags.DEFINE_bool("ema", False, "Convert the EMA weights of a file that holds raw and EMA weights (pytorch-ddpm's "
                  "ckpt.pt, the MegEngine port's ckpt.pkl); default: the raw ones.")
define_integer("image_size", None, "Image size, for networks whose file does not record it and that are not a "
               "published model.", **field_bounds("image_size"))
define_integer("norm_groups", None, "GroupNorm groups, for files that do not record it (default 32, what pesser's, "
               "ddim's and pytorch-ddpm's code use).", **field_bounds("norm_groups"))
flags.DEFINE_enum("var_type", None, VAR_TYPES, "Sampling variance, for networks whose files do not record it and "
                  "that are not a published model.")
define_integer("num_heads", None, "Attention heads, for improved-diffusion networks that are not a published model.",
               **field_bounds("num_heads"))
define_integer("num_timesteps", None, "Diffusion steps T, for files that do not record it and are not a published "
               "model (default 1000).", **field_bounds("num_timesteps"))
flags.DEFINE_enum("beta_schedule", None, SCHEDULES, "Beta schedule, for improved-diffusion files that are not a "
                  "published model (default linear).")
flags.DEFINE_enum("channel_order", None, CHANNEL_ORDERS, "The channel order the network takes (converted to RGB); "
                  "needed for MegEngine-port files other than its hub's.")
flags.adopt_module_key_flags(cli)  # so that --help lists the flags defined there and in shared_flags
flags.adopt_module_key_flags(shared_flags)


def main(argv):
    from megdiffusion.formats.convert import convert
    from megdiffusion.training import checkpoint

    with one_line_errors(), megengine_failures("nothing was written; rerun the same command"):
        if len(argv) != 3:
            raise UsageError(f"expected two arguments, SRC OUT; got {len(argv) - 1}")
        src, out = argv[1:]
        check_not_input(out, "OUT", src)
        check_writable(out, "OUT", directory=False, overwrite=FLAGS.overwrite)  # before the conversion, not after it
        cfg, weights, record = convert(src, FLAGS.format, FLAGS.ema, FLAGS.image_size, FLAGS.norm_groups,
                                       FLAGS.var_type, FLAGS.channel_order, FLAGS.num_heads, FLAGS.num_timesteps,
                                       FLAGS.beta_schedule)
        checkpoint.save_checkpoint(out, checkpoint.weights_snapshot(cfg, weights, record))
    count = sum(array.size for array in weights.values())
    print(f"wrote {out}: {record['format']} {record['weights']} of {src} ({record['channel_order'].upper()}), "
          f"{count:,} parameters, {cfg.image_size}x{cfg.image_size}x{cfg.image_channels}; "
          f"{cfg.beta_schedule} betas, T={cfg.num_timesteps}, {cfg.mean_type}, {cfg.var_type}"
          f"{', rescaled timesteps' if cfg.rescale_timesteps else ''}; downsample padding {cfg.downsample_padding}, "
          f"time embedding {cfg.time_embedding}, GroupNorm {cfg.norm_groups} groups eps {cfg.norm_eps:g}, "
          f"{cfg.num_heads} attention head{'s' if cfg.num_heads > 1 else ''}"
          f"{', scale-shift norm' if cfg.use_scale_shift_norm else ''}")


def run():
    """Console entry point (``megdiffusion-convert``)."""
    cli.run_command(main)


if __name__ == "__main__":
    run()
