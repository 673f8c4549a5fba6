"""Which timesteps of a T-step chain a sampler (or an NLL evaluation) keeps. Imports no MegEngine.

Two conventions, both naming kept timesteps of the original chain in increasing order:

- ``--steps S`` (``timestep_subsequence``): the "leading" subsequence range(0, T, T // S)[:S] of DDIM's paper
  and diffusers, megdiffusion's default;
- ``--respacing SPEC`` (``space_timesteps``): improved-diffusion's ``timestep_respacing`` strings, "N" or
  "a,b,c" (even spacing within equal sections, keeping each section's first and last step) and "ddimN".
"""
import numpy as np


def timestep_subsequence(num_timesteps, steps=None):
    """The S original timesteps range(0, T, T // S)[:S] (all T when steps is None)."""
    if steps is None:
        steps = num_timesteps
    if int(steps) != steps or not 1 <= steps <= num_timesteps:
        raise ValueError(f"steps must be an integer between 1 and T={num_timesteps}, got {steps}")
    steps = int(steps)
    return np.arange(0, num_timesteps, num_timesteps // steps)[:steps]


def _counts(spec, prefix=""):
    """The step counts of respacing ``prefix + spec``: positive integers, one after "ddim"."""
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or (prefix and len(counts) != 1):
        raise ValueError(f"respacing must be 'N', 'a,b,c' (positive step counts per equal section) or 'ddimN', "
                         f"got {prefix + spec!r}")
    return counts


def space_timesteps(num_timesteps, spec):
    """improved-diffusion's ``space_timesteps``: the sorted original timesteps that ``spec`` keeps of T.

    "ddimN": range(0, T, s) for the smallest integer stride s that gives exactly N steps. "a,b,c": T is cut into
    len(sections) equal parts (the first T % len parts one step longer); a part of ``size`` steps keeping
    ``count`` takes start + round(cur), cur starting at 0.0 and growing by the float (size - 1) / (count - 1)
    per step (repeated addition and Python's round, as improved-diffusion; a count of 1 keeps the first step).
    """
    spec = str(spec).strip()
    if spec.startswith("ddim"):
        [count] = _counts(spec[len("ddim"):], "ddim")
        for stride in range(1, num_timesteps):
            if len(range(0, num_timesteps, stride)) == count:
                return list(range(0, num_timesteps, stride))
        raise ValueError(f"respacing {spec!r}: no integer stride gives exactly {count} of T={num_timesteps} steps")
    counts = _counts(spec)
    size_per, extra = divmod(num_timesteps, len(counts))
    start, kept = 0, set()
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if count > size:
            raise ValueError(f"respacing {spec!r}: a section of {size} of T={num_timesteps} steps cannot keep {count}")
        stride = (size - 1) / (count - 1) if count > 1 else 1
        cur = 0.0
        for _ in range(count):
            kept.add(start + round(cur))
            cur += stride
        start += size
    return sorted(kept)


def sampling_timesteps(num_timesteps, steps=None, respacing=None):
    """The kept original timesteps, increasing: ``space_timesteps(T, respacing)`` when a respacing is given,
    else ``timestep_subsequence(T, steps)`` (all T when both are None). ValueError for both, or a bad value."""
    if respacing:
        if steps is not None:
            raise ValueError(f"give steps or respacing, not both (got steps={steps}, respacing={respacing!r})")
        return space_timesteps(num_timesteps, respacing)
    return list(timestep_subsequence(num_timesteps, steps))
