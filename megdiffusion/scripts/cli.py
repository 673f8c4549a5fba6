"""What the command-line scripts share: one-line errors with exit code 2 for bad input (flags, paths and
files too), exit code 1 for a failure of MegEngine itself, 130 for Ctrl-C and 143 for SIGTERM; flag parsing, with
every flagfile read once, the command line winning over it, and every number held to its flag's bounds."""
import contextlib
import math
import os
import signal
import sys

from absl import app, flags

from megdiffusion.errors import MegdiffusionError
from megdiffusion import environment


class UsageError(MegdiffusionError):
    """Bad command-line input; the message is one line that says what to fix."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, as Ctrl-C raises ``KeyboardInterrupt``: every cleanup of an interrupt
    (a partial file removed, a checkpoint saved) runs for it too."""


def _raise_terminated(signum, frame):
    raise Terminated


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
# Flag name -> the bounds it was defined with (``define_integer``, ``define_float``); a training flag's are its
# config field's (``flag_bounds``).
BOUNDS = {}


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
    except KeyboardInterrupt as interrupt:
        how, code = ("SIGTERM", 143) if isinstance(interrupt, Terminated) else ("SIGINT", 130)
        fail(f"stopped by {how}; every file written so far is complete", code)


def run_command(main, first=None):
    """Run a script's ``main`` under absl with ``parse_flags``: SIGTERM raises ``Terminated``, and an interrupt
    anywhere ends the command in one line (exit 130 or 143). ``first``: called before the flags are parsed."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    with one_line_errors():
        if first is not None:
            first()
        app.run(main, flags_parser=parse_flags)


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


FLAGFILE_FLAGS = ("--flagfile", "-flagfile")


def expand_flagfiles(args, including=(), source=None):
    """``args`` with every ``--flagfile`` read once (so a pipe works) and in its place, by absl's rules (blank lines
    and lines starting with # or // skipped, nested flagfiles expanded where they stand, nothing expanded after
    ``--``): ``(from_files, command_line)``, each a list of (argument, the flagfile it came from or None).
    ``UsageError`` for a flagfile that cannot be read, is not text (a checkpoint, say), or includes itself.
    ``including``: the flagfiles (real paths) whose lines ``args`` are, the last named ``source``."""
    from_files, command_line = [], []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--" and not including:
            command_line += [(a, None) for a in [arg, *rest]]
            break
        if arg in FLAGFILE_FLAGS:
            if not rest:
                raise UsageError(f"{arg} needs a file name: {arg}=FILE")
            path = rest.pop(0)
        elif arg.startswith(tuple(f"{flag}=" for flag in FLAGFILE_FLAGS)):
            path = arg.split("=", 1)[1].strip()
        else:
            (from_files if including else command_line).append((arg, source))
            continue
        if path:
            from_files += _flagfile_arguments(os.path.expanduser(path), including)
    return from_files, command_line


def _flagfile_arguments(path, including):
    """The arguments of flagfile ``path`` (``expand_flagfiles``), each with the flagfile it came from."""
    real = os.path.realpath(path)
    if real in including:
        chain = " -> ".join([*including, real])
        raise UsageError(f"flagfile {path} includes itself (through {chain}); remove that --flagfile line")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise UsageError(f"--flagfile {path} is not a text file of flags; give a flagfile such as a run's "
                         "flags.cfg (a checkpoint is no flagfile)") from None
    except OSError as err:
        raise UsageError(f"cannot open flagfile {path}: {err.strerror or err}; give an existing flagfile") from None
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("#", "//"))]
    return expand_flagfiles(lines, including + (real,), path)[0]


def define_integer(name, default, help_text, flag_values=flags.FLAGS, **bounds):
    """absl's ``DEFINE_integer`` for a flag held to ``bounds`` (``config.rule``'s keys), which its help states."""
    _define(flags.DEFINE_integer, name, default, help_text, flag_values, bounds)


def define_float(name, default, help_text, flag_values=flags.FLAGS, **bounds):
    """absl's ``DEFINE_float`` for a flag held to ``bounds`` (``config.rule``'s keys), which its help states."""
    _define(flags.DEFINE_float, name, default, help_text, flag_values, bounds)


def _define(define, name, default, help_text, flag_values, bounds):
    from megdiffusion.training.config import rule

    BOUNDS[name] = bounds
    define(name, default, help_text + (f" Must be {rule(bounds)}." if bounds else ""), flag_values=flag_values)


def flag_bounds(flag_values, name):
    """The bounds flag ``--name`` of ``flag_values`` is held to: its ``TrainConfig`` field's for a training flag,
    else those it was defined with (``BOUNDS``)."""
    from megdiffusion.training import config

    if flag_values.find_module_defining_flag(name) == config.__name__:  # made by ``config.define_flags``
        return config.field_bounds(name)
    return BOUNDS.get(name, {})


def parse_into(flag_values, argv):
    """Parse ``argv`` into ``flag_values``: the flagfiles' flags first (``expand_flagfiles``), made the defaults
    (so ``--help`` shows them), then the command line's, which win wherever they stand. ``UsageError`` for a bad
    flag (naming the flagfile that set it), a flagfile that cannot be read, a number that is not finite (every
    float flag of every script), a number outside its flag's bounds (``flag_bounds``) or one of
    ``ABSL_DEBUG_FLAGS``. Returns the positional arguments."""
    from megdiffusion.training.config import ConfigError, check_bounds

    from_files, command_line = expand_flagfiles(argv[1:])
    origin = {_flag_name(arg, flag_values): source for arg, source in from_files}
    positional = []
    if from_files:
        positional += _parse(flag_values, argv[0], from_files)
        for name in flag_values:
            if flag_values[name].present:
                flag_values.set_default(name, flag_values[name].value)
    positional += _parse(flag_values, argv[0], command_line)
    given = given_on_command_line(flag_values, [arg for arg, _ in command_line])
    for name in flag_values:
        flag = flag_values[name]
        where = f" (set in flagfile {origin[name]})" if name in origin and name not in given else ""
        if name in ABSL_DEBUG_FLAGS and flag.present:
            raise UsageError(f"--{name} is absl's debugging flag, which megdiffusion does not support; run "
                             f"{ABSL_DEBUG_FLAGS[name]} instead{where}")
        value = flag.value
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{name} must be a finite number, got {value}{where}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                check_bounds(name, value, flag_bounds(flag_values, name))
            except ConfigError as err:
                raise UsageError(f"{err}{where}") from None
    return [argv[0], *positional]


def _parse(flag_values, program, arguments):
    """absl's parse of ``arguments`` (argument, flagfile) into ``flag_values``: the positional arguments."""
    try:
        return flag_values([program, *(arg for arg, _ in arguments)])[1:]
    except flags.Error as err:
        raise UsageError(_flag_error(err, arguments, flag_values)) from None


def _flag_name(arg, flag_values):
    """The flag an argument such as ``--name=value`` or ``--noname`` sets (its bare name otherwise)."""
    name = arg.lstrip("-").split("=", 1)[0]
    return name[2:] if name.startswith("no") and name not in flag_values and name[2:] in flag_values else name


def _flag_error(err, arguments, flag_values):
    """absl's error ``err`` for ``arguments`` (argument, flagfile) as one line that names the flagfile that set the
    flag, and for a training flag in another command's flagfile, what that flagfile is for."""
    from megdiffusion.training.config import define_flags

    text = str(err).removeprefix("ERROR:: ")
    named = getattr(err, "flagname", None)  # absl names the flag of an unknown one; of a bad value, in its text

    def sets_it(arg):
        name = _flag_name(arg, flag_values)
        return name == named if named else f"--{name}=" in text

    source = next((source for arg, source in arguments if source and arg.startswith("-") and sets_it(arg)), None)
    if source is None:
        return text
    if isinstance(err, flags.UnrecognizedFlagError):
        training = flags.FlagValues()
        define_flags(training)
        if named in training:
            use = " (which reads a run with --ckpt RUN)" if "ckpt" in flag_values else ""
            return (f"--{named}, set in flagfile {source}, is a training flag, not one of this command{use}: "
                    f"{source} is a flagfile of megdiffusion.scripts.train")
        return f"--{named}, set in flagfile {source}, is not a flag of this command; remove that line"
    return f"{text} (set in flagfile {source})"


def parse_flags(argv):
    """absl's flag parsing for ``app.run(..., flags_parser=parse_flags)``: a bad flag is one line, exit 2."""
    with one_line_errors():
        environment.check()
        return parse_into(flags.FLAGS, argv)


def given_on_command_line(flag_values, args=None):
    """The names of the flags written on the command line (``args``, default ``sys.argv[1:]``), not through a
    flagfile: a recipe may set what a command line may not ask for in vain."""
    args = sys.argv[1:] if args is None else args
    return {_flag_name(arg, flag_values) for arg in args if arg.startswith("-")} & set(flag_values)


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
        fail(f"unexpected arguments {argv[1:]}; flags look like --NAME=VALUE")


def config_from_flagfile(path, **overrides):
    """``config_from_flags`` for a flagfile plus overrides (flag name -> value): ``(cfg, images)``."""
    from megdiffusion.training.config import as_flag, config_from_flags, define_flags

    flag_values = flags.FlagValues()
    define_flags(flag_values)
    parse_into(flag_values, ["megdiffusion", f"--flagfile={path}"] + [as_flag(name, value)
                                                                      for name, value in overrides.items()])
    return config_from_flags(flag_values)
