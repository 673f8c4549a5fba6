"""Noise schedules: the betas of the forward process, as float64 numpy arrays."""
import numpy as np

SCHEDULES = ("linear", "cosine")


def make_beta_schedule(name, num_timesteps):
    """Betas (float64, shape (num_timesteps,)) of the named schedule.

    - "linear" (Ho et al. 2020): evenly spaced from 1e-4 to 0.02 for T = 1000; for other T both ends are
      scaled by 1000 / T, so the chain keeps the same overall amount of noise.
    - "cosine" (Nichol & Dhariwal 2021): alpha_bar(t) = cos((t / T + s) / (1 + s) * pi / 2)^2 with
      s = 0.008, beta_t = 1 - alpha_bar(t + 1) / alpha_bar(t), capped at 0.999.
    """
    if int(num_timesteps) != num_timesteps or num_timesteps < 2:
        raise ValueError(f"num_timesteps must be an integer >= 2, got {num_timesteps}")
    num_timesteps = int(num_timesteps)
    if name == "linear":
        scale = 1000.0 / num_timesteps
        if scale * 0.02 >= 1.0:
            raise ValueError(f"the linear schedule needs num_timesteps > 20 (its last beta would be "
                             f"{scale * 0.02:g}); got {num_timesteps}")
        return np.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=np.float64)
    if name == "cosine":
        s = 0.008
        steps = np.arange(num_timesteps + 1, dtype=np.float64) / num_timesteps
        alpha_bar = np.cos((steps + s) / (1 + s) * np.pi / 2) ** 2
        return np.minimum(1.0 - alpha_bar[1:] / alpha_bar[:-1], 0.999)
    raise ValueError(f"unknown beta schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
