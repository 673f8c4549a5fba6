"""A sampler's settings as one object: what every command and the training grids hand down, checked against a
chain (``check``), resolved for manifests (``resolved``) and named in outputs (``label``)."""
import dataclasses
import math
from typing import Optional

from megdiffusion.diffusion import solvers
from megdiffusion.diffusion.choices import ANCESTRAL, SAMPLERS, check_choice
from megdiffusion.diffusion.spacing import sampling_timesteps


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """The arguments of ``GaussianDiffusion.sample`` that choose the sampler (see there)."""

    sampler: str = "ddpm"
    steps: Optional[int] = None
    eta: float = 0.0
    respacing: Optional[str] = None  # ddpm and ddim, instead of steps: improved-diffusion's ("50", "ddim50")
    spacing: Optional[str] = None  # where the steps lie (``solvers.SPACINGS``; None: the sampler's default)
    order: Optional[int] = None  # a multistep solver's order (None: its default)

    def arguments(self):
        """The keyword arguments of ``GaussianDiffusion.sample``."""
        return dataclasses.asdict(self)

    def check(self, diffusion):
        """These settings, or ValueError (one line) unless ``diffusion.sample`` accepts them."""
        sampler, steps, eta, spacing, order = self.sampler, self.steps, self.eta, self.spacing, self.order
        check_choice("sampler", sampler, SAMPLERS)
        if not (math.isfinite(eta) and eta >= 0) or (eta and sampler != "ddim"):
            raise ValueError(f"eta must be a finite number >= 0 and is only used by the ddim sampler, got eta={eta}")
        if sampler in ANCESTRAL:
            if order is not None:
                raise ValueError(f"--order is for the multistep solvers ({', '.join(solvers.MULTISTEP)}); "
                                 f"{sampler} has none")
            if spacing not in (None,) + solvers.INTEGER_SPACINGS:
                raise ValueError(f"{sampler} steps between timesteps: --spacing must be one of "
                                 f"{', '.join(solvers.INTEGER_SPACINGS)}, got {spacing!r}")
            if spacing and self.respacing:
                raise ValueError(f"give --spacing or --respacing, not both (got {spacing!r} and {self.respacing!r})")
            sampling_timesteps(diffusion.num_timesteps, steps, self.respacing)  # the step count's bounds
            return self
        if self.respacing:
            raise ValueError(f"--respacing is for ddpm and ddim; {sampler} takes --steps and --spacing")
        if diffusion.mean_type == "xprev":
            raise ValueError(f"{sampler} needs the model's x_0 prediction, which a mean_type 'xprev' model does not "
                             "give; sample it with ddpm or ddim")
        steps, spacing = solvers.with_defaults(steps, spacing)
        solvers.check_solver(sampler, steps, spacing, order)
        if not solvers.distinct_levels(diffusion.alphas_cumprod, steps, spacing, sampler):
            most = next(s for s in range(min(steps, diffusion.num_timesteps), 0, -1)
                        if solvers.distinct_levels(diffusion.alphas_cumprod, s, spacing, sampler))
            raise ValueError(f"--steps {steps} is more than --spacing {spacing} can place on this model's "
                             f"{diffusion.num_timesteps} timesteps without repeating a noise level: {sampler} takes "
                             f"at most {most} steps there")
        return self

    def resolved(self, diffusion):
        """The settings as ``diffusion.sample`` runs them, every default filled in ({"sampler", "steps",
        "respacing", "spacing", "order"}): one dict for every spelling of the same run."""
        if self.sampler in ANCESTRAL:
            if self.respacing:
                return dict(sampler=self.sampler, steps=None, respacing=self.respacing, spacing=None, order=None)
            return dict(sampler=self.sampler, steps=diffusion.num_timesteps if self.steps is None else self.steps,
                        respacing=None, spacing=self.spacing or "leading", order=None)
        steps, spacing = solvers.with_defaults(self.steps, self.spacing)
        return dict(sampler=self.sampler, steps=steps, respacing=None, spacing=spacing,
                    order=self.order or solvers.ORDERS[self.sampler][0])

    def label(self):
        """How outputs name these settings: "ddim-50", "ddpm-respacing 50", "unipc3-20 karras"."""
        return solvers.sampler_label(self.sampler, self.steps, self.respacing, self.spacing, self.order)
