"""The flags several commands take, each defined here once: a function per group, called by every command that takes
the group, so that a flag has one default, one bound and one help text wherever it appears. A command whose flag of
a shared name does another job says why in ``OWN_FLAGS``; tests/test_flag_help.py holds every command to this."""
from absl import flags

from megdiffusion.diffusion.choices import ANCESTRAL, SAMPLERS
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.diffusion.solvers import DEFAULT_SPACING, DEFAULT_STEPS, SPACINGS
from megdiffusion.scripts.cli import define_float, define_integer
from megdiffusion.training.config import field_bounds

# The sampler to try first: on the demo's model it scores near guided DDPM-100 at a quarter of the network calls
# (docs/sampling.md, benchmarks/README.md "FID against network calls"). Not the default: it needs its spacing and
# steps, and the commands' defaults reproduce published figures (``ANCESTRAL_STEPS``).
RECOMMENDED = "--sampler dpmpp_2m_sde --steps 25 --spacing logsnr"
# ddpm's and ddim's steps without --steps in each command that samples (None: all T): the protocol of the figures it
# reproduces, Ho et al.'s full chain, the FID figures' DDIM-50 (benchmarks/README.md) and the demo's DDPM-100.
ANCESTRAL_STEPS = {"sample": None, "fid": 50, "demo": 100}
# (command, flag) -> why that command's flag of a shared name has another default or help. Never another bound: a
# name that is a training config field takes the field's bounds in every command.
OWN_FLAGS = {
    ("fid", "sampler"): "DDIM(-50) is the protocol of the FID figures in benchmarks/README.md",
    ("nll", "steps"): "the bound's timesteps, not a sampler's: all T by default, the exact bound",
    ("fid", "num_images"): "a seeded random draw of each image source, or with --ckpt the samples scored",
    ("nll", "num_images"): "the first N images of PATH",
    ("demo", "num_images"): "the samples of the demo's protocol (500)",
    ("demo", "batch_size"): "the batch the demo's figures were measured at (100)",
    ("demo", "guidance"): "the demo guides with its own earlier checkpoint, at its protocol's weight (2.5)",
    ("demo", "output"): "the demo's own directory (default runs/demo); sample's must be given",
    ("posthoc_ema", "output"): "a directory of checkpoints, not of images",
    ("demo", "resume"): "continues the demo's training and scores again",
    ("demo", "snapshot_every"): "the demo always tracks post-hoc EMA profiles, to choose its EMA length",
    ("export", "batch_size"): "the batch the .mge graph is traced at (it runs at any batch)",
    ("convert", "ema"): "picks the weights of a file that holds two sets; most published files hold one, so raw",
    **{("convert", name): "describes a published file's network where the file does not (default: read from it)"
       for name in ("image_size", "num_timesteps", "norm_groups", "num_heads", "var_type", "beta_schedule")},
    **{("train", name): "a field of the training config, stored in every checkpoint"
       for name in ("batch_size", "seed", "image_size", "num_gpus")},
}


def define_model_flags():
    """--ckpt and --ema: the model a command samples or scores."""
    flags.DEFINE_string("ckpt", None, "The model: a checkpoint file (a converted published one too), or a run's "
                        "logdir, whose newest checkpoint that loads is used; or a .mge graph of scripts.export, or any "
                        "checkpoint scripts.convert reads (converted in memory).")
    define_ema_flag()


def define_ema_flag():
    """--ema: which weights of a checkpoint."""
    flags.DEFINE_bool("ema", True, "Use the EMA weights (--noema: the raw training weights).")


def define_sampler_flags(sampler="ddpm"):
    """--sampler (default ``sampler``: only fid's differs, ``OWN_FLAGS``), --steps, --spacing and --order."""
    flags.DEFINE_enum("sampler", sampler, SAMPLERS, "Ancestral DDPM (respaced for fewer steps), DDIM, or a solver of "
                      "the probability-flow ODE: euler, heun (two network calls per step), dpmpp_2m, dpmpp_3m, unipc "
                      "(DPM-Solver++ and UniPC, one call per step); dpmpp_2m_sde adds noise. For a quick good sample "
                      f"try {RECOMMENDED} (docs/sampling.md).")
    ancestral = ", ".join(f"{'all T' if steps is None else steps} in {command}"
                          for command, steps in ANCESTRAL_STEPS.items())
    flags.DEFINE_integer("steps", None, f"Sampling steps; default {DEFAULT_STEPS} for the solvers, and for ddpm and "
                         f"ddim {ancestral}. Fewer than T use range(0, T, T // steps) (see --spacing).")
    flags.DEFINE_enum("spacing", None, SPACINGS, "Where the --steps noise levels lie: leading (range(0, T, T // "
                      "steps), the ddpm and ddim default), linspace, trailing (diffusers' conventions), karras (Karras "
                      f"et al. 2022, rho 7) or logsnr (uniform log-SNR); the solvers' default is {DEFAULT_SPACING}. "
                      "ddpm and ddim take the first three.")
    flags.DEFINE_integer("order", None, "unipc: the solver's order, 2 (default) or 3. The other solvers' names say "
                         "theirs (dpmpp_2m, dpmpp_3m).")


def sampler_settings(values, command):
    """The ``SamplerSettings`` of a sampling command's flags: --sampler, --steps (or its default in ``command`` for
    the sampler, ``ANCESTRAL_STEPS``; none with --respacing), --eta, --respacing, --spacing and --order (a
    command without a flag leaves its setting at the default)."""
    default = SamplerSettings()
    given = {name: values[name].value if name in values else getattr(default, name)
             for name in ("steps", "eta", "respacing", "spacing", "order")}
    if given["steps"] is None and not given["respacing"]:
        given["steps"] = ANCESTRAL_STEPS[command] if values.sampler in ANCESTRAL else DEFAULT_STEPS
    return SamplerSettings(values.sampler, **given)


def define_respacing_flag():
    """--respacing: improved-diffusion's spacing of the chain, instead of --steps."""
    flags.DEFINE_string("respacing", None, "Instead of --steps: improved-diffusion's timestep respacing, 'N' (N steps "
                        "evenly spaced, the first and last kept), 'a,b,c' (a, b and c steps in three equal sections) "
                        "or 'ddimN' (the smallest stride that gives N).")


def define_eta_flag():
    """--eta: DDIM's noise (its bound: ``SamplerSettings.check``'s, with the sampler it goes with)."""
    flags.DEFINE_float("eta", 0.0, "DDIM eta: 0 is deterministic DDIM, 1 adds DDPM-like noise.")


def define_guidance_flags():
    """--guide_ckpt, --guidance and --guide_unconditional (autoguidance and classifier-free guidance,
    ``generation.Autoguidance``)."""
    flags.DEFINE_string("guide_ckpt", None, "Autoguidance (Karras et al. 2024): a weaker model to guide the sampled "
                        "one with, such as an earlier checkpoint of the same run (file or logdir); each step then "
                        "calls both networks.")
    define_guidance_weight(1.0, "With --guide_ckpt: the guidance weight w, prediction = guide + w (model - guide); 1 "
                           "is no guidance. The demo uses 2.5 with the checkpoint 40% of the way through its training.")
    flags.DEFINE_bool("guide_unconditional", False, "With --guide_ckpt: the guide predicts without a class (a "
                      "class-conditional run trained with --class_dropout). With the sampled checkpoint itself as "
                      "--guide_ckpt this is classifier-free guidance (Ho & Salimans 2022).")


def define_guidance_weight(default, help_text):
    """--guidance, bounded: 1 is none, papers use 1.5 to 10; far above, float32 overflows."""
    define_float("guidance", default, help_text, min=1, max=100)


def define_batch_flags():
    """--batch_size and --seed of a command that runs the network or Inception over images."""
    define_batch_size(64, "Images per batch, of the network (sampling, the bound) and of Inception (per GPU).")
    define_integer("seed", 0, "Image i's noise depends only on (seed, i), whatever the batch or the number of "
                   "processes; fid also draws --num_images and --floor's halves with it.", **field_bounds("seed"))


def define_batch_size(default, help_text):
    """--batch_size, bounded like the training batch."""
    define_integer("batch_size", default, help_text, **field_bounds("batch_size"))


def define_image_size_flag():
    """--image_size of a command that reads images as training does."""
    define_integer("image_size", None, "Centre-crop each image to a square and resize it to this size (PIL bicubic), "
                   "as training's data is; default: the images' own size.", **field_bounds("image_size"))


def define_progress_flag():
    """--progress."""
    flags.DEFINE_bool("progress", True, "Show progress on stderr: a bar on a terminal, else a line every few seconds.")


def define_overwrite_flag():
    """--overwrite of a command that writes one output (a file, or export's pipeline directory)."""
    flags.DEFINE_bool("overwrite", False, "Replace the output when it exists (convert's and export's OUT, prepare's "
                      "DEST, fid --save_stats's OUT.npz).")
