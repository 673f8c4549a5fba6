"""Every environment variable megdiffusion reads or sets, in one table, parsed the same way everywhere.

Booleans take the usual spellings (1/0, true/false, yes/no, on/off, any case). The commands check every variable
that is set when they parse their flags (``check``), so a bad value is one ``error:`` line before any work; the
code that uses a variable reads it through ``boolean``/``integer``/``path`` (a bad value there falls back to the
default: ``check`` has already reported it where a command runs).
"""
import os

from megdiffusion.errors import MegdiffusionError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# name: (kind, what it does). Kinds: "boolean", "boolean or auto" (auto or empty: None), "integer" (>= 0),
# "absolute path".
VARIABLES = {
    "MEGDIFFUSION_FAST_CONV": ("boolean or auto", "the CPU engine (cpu/choice.py): the UNet's steps, update, "
                                                  "sampling calls and convolutions outside MegEngine's kernels; "
                                                  "default on where MegEngine sees no GPU"),
    "MEGDIFFUSION_NATIVE_STEP": ("boolean", "the CPU engine's numpy pass of the network (training steps and "
                                            "sampling calls); off: MegEngine's engine with the CPU convolutions; "
                                            "default on"),
    "MEGDIFFUSION_NUMBA": ("boolean", "the compiled GroupNorm, SiLU and softmax kernels; default on"),
    "MEGDIFFUSION_ONEDNN": ("boolean", "oneDNN's convolutions and products on the CPU; default on"),
    "MEGDIFFUSION_VERBOSE": ("boolean", "keep MegEngine's start-up banner and log lines; default off"),
    "MGB_WORKER_MAX_SPIN": ("integer", "MegEngine's worker spin count; megdiffusion sets it when unset"),
    "MGB_WORKER_NO_SLEEP": ("integer", "MegEngine's workers spin instead of sleeping; when set, megdiffusion leaves "
                                       "the spin count alone"),
    "MEGENGINE_DTR_EVICTEE_MINIMUM_SIZE": ("integer", "MegEngine's DTR candidate threshold in bytes; megdiffusion "
                                                      "sets it when unset (the interpreter race guard)"),
    "XDG_CACHE_HOME": ("absolute path", "where the FID Inception weights are cached; default ~/.cache"),
}


class EnvironmentVariableError(MegdiffusionError):
    """An environment variable with a value megdiffusion cannot use; the message is one line."""


def _parse(name, text):
    kind, _ = VARIABLES[name]
    value = text.strip()
    if kind == "boolean or auto" and value.lower() in ("", "auto"):
        return None
    if kind in ("boolean", "boolean or auto"):
        if value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
    elif kind == "integer":
        if value.isdigit():
            return int(value)
    elif os.path.isabs(value):
        return value
    raise EnvironmentVariableError(f"environment variable {name}={text!r} must be {_SPELLINGS[kind]} "
                                   f"({VARIABLES[name][1]}); set it so, or unset it")


_SPELLINGS = {"boolean": "1/0, true/false, yes/no or on/off",
              "boolean or auto": "1/0, true/false, yes/no, on/off or auto", "integer": "a whole number >= 0",
              "absolute path": "an absolute path (a relative one would follow the working directory)"}


def check(environ=None):
    """``EnvironmentVariableError`` for the first variable of ``VARIABLES`` that is set to a value it cannot take."""
    environ = os.environ if environ is None else environ
    for name in VARIABLES:
        if environ.get(name) is not None:
            _parse(name, environ[name])


def read(name, default):
    """The parsed value of variable ``name`` of ``VARIABLES``, or ``default`` when unset (or set to a bad value,
    which the commands have refused in ``check``)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return _parse(name, text)
    except EnvironmentVariableError:
        return default
