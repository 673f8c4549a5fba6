"""What the command-line scripts share: one-line errors with exit code 2 for bad input (flags, paths and
files too), exit code 1 for a failure of MegEngine itself, and 130 for Ctrl-C."""
import contextlib
import math
import os
import sys

from absl import flags

from megdiffusion.errors import MegdiffusionError
from megdiffusion import environment


class UsageError(MegdiffusionError):
    """Bad command-line input; the message is one line that says what to fix."""


# absl.app's debugging flags (listed by --helpfull), which would write files outside a command's outputs or stop in a
# debugger: refused, with what to use instead.
ABSL_DEBUG_FLAGS = {"run_with_profiling": "python -m cProfile -o FILE -m megdiffusion.scripts.NAME ...",
                    "profile_file": "python -m cProfile -o FILE -m megdiffusion.scripts.NAME ...",
                    "use_cprofile_for_profiling": "python -m cProfile -o FILE -m megdiffusion.scripts.NAME ...",
                    "run_with_pdb": "python -m pdb -m megdiffusion.scripts.NAME ...",
                    "pdb_post_mortem": "python -m pdb -m megdiffusion.scripts.NAME ...",
                    "pdb": "python -m pdb -m megdiffusion.scripts.NAME ..."}
# Image i of a run draws its noise from image_seed(seed, i) = (seed << 32) + i (``generation``): distinct for
# i < 2**32 only, so no command makes more images than that.
MAX_IMAGES = 2 ** 32
# Bounds of the scripts' flags that are not ``TrainConfig`` fields (a flag named like a field takes the field's
# bounds, ``config.field_bounds``), checked for every script when its flags are parsed (``parse_into``).
SCRIPT_BOUNDS = {"num_images": {"min": 1, "max": MAX_IMAGES}, "num_reference": {"min": 2, "max": MAX_IMAGES},
                 "images": {"min": 1, "max": MAX_IMAGES}, "minutes": {"above": 0, "max": 7 * 24 * 60},
                 "kid_subsets": {"min": 1, "max": 10000},
                 "kid_subset_size": {"min": 2}, "workers": {"min": 0, "max": 256},
                 # guidance: 1 is none, papers use 1.5 to 10; far above, float32 overflows
                 "guidance": {"min": 1, "max": 100},
                 "kid_seed": {"min": 0, "max": 2 ** 32 - 1}}  # numpy's RandomState


def error_line(message):
    """The one line that reports ``message``: ``error: `` and its text with every control character (a line
    break in a path, say) escaped as ``repr`` writes it, so that it stays on one line and means one thing."""
    text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(message))
    return f"error: {text}"


def _clear_progress_bars():
    """Erase every progress bar still drawn (tqdm's), so that an error line starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.leave = False
        bar.close()


def fail(message, code=2):
    """Clear any progress bar, print ``error_line(message)`` to stderr and exit with ``code``."""
    _clear_progress_bars()
    print(error_line(message), file=sys.stderr, flush=True)
    sys.exit(code)


@contextlib.contextmanager
def one_line_errors():
    """Report a ``MegdiffusionError`` raised in the block as one ``error:`` line and exit with its code; an
    ``OSError`` (a path that cannot be read or written) likewise with code 2, and Ctrl-C with 130."""
    try:
        yield
    except MegdiffusionError as err:
        fail(err, err.exit_code)
    except OSError as err:
        fail(f"{err.filename}: {err.strerror}" if err.filename and err.strerror else err)
    except KeyboardInterrupt:
        fail("interrupted; every file written so far is complete", 130)


@contextlib.contextmanager
def megengine_failures(how_to_continue):
    """Turn an error MegEngine raised into one ``error:`` line (its first cause, what was kept, then
    ``how_to_continue``) and exit code 1, instead of a C++ backtrace."""
    from megdiffusion.compat import EngineFailure, is_megengine_error, megengine_error_cause

    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, EngineFailure):
            fail(f"{exc}; {how_to_continue}", code=1)
        if not is_megengine_error(exc):
            raise
        fail(f"MegEngine failed: {megengine_error_cause(exc)}; {how_to_continue}", code=1)


def check_flagfiles(args, including=()):
    """``UsageError`` for a ``--flagfile`` in ``args`` that is not text (a checkpoint, say) or that includes itself,
    directly or through the flagfiles it names; a missing one is left to absl's own message. ``including``: the
    flagfiles (real paths) whose lines ``args`` are."""
    named = [arg.split("=", 1)[1] for arg in args if arg.startswith(("--flagfile=", "-flagfile="))]
    named += [value for flag, value in zip(args, args[1:]) if flag in ("--flagfile", "-flagfile")]
    for path in named:
        real = os.path.realpath(path)
        if real in including:
            raise UsageError(f"flagfile {path} includes itself (through {' -> '.join(including)}); remove that "
                             "--flagfile line")
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except UnicodeDecodeError:
            raise UsageError(f"--flagfile {path} is not a text file of flags; give a flagfile such as a run's "
                             "flags.cfg (a checkpoint is read with --ckpt, --init_from or --resume)") from None
        except OSError:
            continue
        check_flagfiles(lines, including + (real,))


def parse_into(flag_values, argv):
    """Parse ``argv`` into ``flag_values``; ``UsageError`` for a bad flag, a missing flagfile, a number that is
    not finite (every float flag of every script), a number outside its flag's bounds (``SCRIPT_BOUNDS``, or
    the ``TrainConfig`` field of the same name) or one of ``ABSL_DEBUG_FLAGS``. Returns the positional
    arguments."""
    from megdiffusion.training.config import ConfigError, check_bounds, field_bounds

    check_flagfiles(argv[1:])
    try:
        rest = flag_values(argv)
    except flags.Error as err:
        raise UsageError(str(err).removeprefix("ERROR:: ")) from None
    for name in flag_values:
        flag = flag_values[name]
        if name in ABSL_DEBUG_FLAGS and flag.present:
            raise UsageError(f"--{name} is absl's debugging flag, which megdiffusion does not support; run "
                             f"{ABSL_DEBUG_FLAGS[name]} instead")
        value = flag.value
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{name} must be a finite number, got {value}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                check_bounds(name, value, SCRIPT_BOUNDS.get(name) or field_bounds(name))
            except ConfigError as err:
                raise UsageError(str(err)) from None
    return rest


def parse_flags(argv):
    """absl's flag parsing for ``app.run(..., flags_parser=parse_flags)``: a bad flag is one line, exit 2."""
    with one_line_errors():
        environment.check()
        return parse_into(flags.FLAGS, argv)


def given_on_command_line(flag_values, args=None):
    """The names of the flags written on the command line (``args``, default ``sys.argv[1:]``), not through a
    flagfile: a recipe may set what a command line may not ask for in vain."""
    given = set()
    for arg in sys.argv[1:] if args is None else args:
        name = arg.lstrip("-").split("=", 1)[0] if arg.startswith("-") else ""
        if name.startswith("no") and name not in flag_values and name[2:] in flag_values:
            name = name[2:]
        if name in flag_values:
            given.add(name)
    return given


def check_flags_matter(flag_values, rules, given=None):
    """``UsageError`` for a flag written on the command line (``given_on_command_line``, unless ``given``) that does
    nothing in the combination given: ``rules`` maps a flag's name to (whether it matters, given the flags; what it
    needs, as the user would write it)."""
    given = given_on_command_line(flag_values) if given is None else given
    for name, (matters, needs) in rules.items():
        if name in given and not matters(flag_values):
            raise UsageError(f"--{name} does nothing without {needs}; drop it, or add {needs}")


def reject_arguments(argv):
    """Fail in one line when a script that takes only flags got positional arguments."""
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; flags look like --name=value")


def define_solver_flags():
    """--spacing and --order (``diffusion.solvers``) for the scripts that sample."""
    from absl import flags

    from megdiffusion.diffusion.solvers import DEFAULT_SPACING, SPACINGS

    flags.DEFINE_enum("spacing", None, SPACINGS, "Where the --steps noise levels lie: leading (range(0, T, T // "
                      "steps), the ddpm and ddim default), linspace, trailing (diffusers' conventions), karras (Karras "
                      f"et al. 2022, rho 7) or logsnr (uniform log-SNR); the solvers' default is {DEFAULT_SPACING}. "
                      "ddpm and ddim take the first three.")
    flags.DEFINE_integer("order", None, "unipc: the solver's order, 2 (default) or 3. The other solvers' names say "
                         "theirs (dpmpp_2m, dpmpp_3m).")


def define_guidance_flags():
    """--guide_ckpt, --guidance and --guide_unconditional (autoguidance and classifier-free guidance,
    ``generation.Autoguidance``) for the sampling and FID scripts."""
    from absl import flags

    flags.DEFINE_string("guide_ckpt", None, "Autoguidance (Karras et al. 2024): a weaker model to guide the sampled "
                        "one with, such as an earlier checkpoint of the same run (file or logdir); each step then "
                        "calls both networks.")
    flags.DEFINE_float("guidance", 1.0, "With --guide_ckpt: the guidance weight w, prediction = guide + w (model - "
                       "guide); 1 is no guidance. The demo uses 2.5 with the checkpoint 40% of the way through its "
                       "training.")
    flags.DEFINE_bool("guide_unconditional", False, "With --guide_ckpt: the guide predicts without a class (a "
                      "class-conditional run trained with --class_dropout). With the sampled checkpoint itself as "
                      "--guide_ckpt this is classifier-free guidance (Ho & Salimans 2022).")


def config_from_flagfile(path, **overrides):
    """``config_from_flags`` for a flagfile plus overrides (flag name -> value): ``(cfg, images)``."""
    from megdiffusion.training.config import as_flag, config_from_flags, define_flags

    flag_values = flags.FlagValues()
    define_flags(flag_values)
    parse_into(flag_values, ["megdiffusion", f"--flagfile={path}"] + [as_flag(name, value)
                                                                      for name, value in overrides.items()])
    return config_from_flags(flag_values)
