"""Making images from a model.

- ``generation``: images from a network and its diffusion, image i from the seed of (seed, i), whatever the batch;
  autoguidance by an earlier checkpoint.
- ``jobs``: a trained run's checkpoint as a network (``load_model``), resumable output directories of numbered
  PNGs with their grid and npz, on one device or one process per GPU (``run_job``).
- ``evaluate``: a model's FID, KID and precision/recall against a reference (``model_scores``), and its NLL bound
  in bits per dimension (``bits_per_dim``).

The public names of ``jobs`` are also this package's (``megdiffusion.sampling.load_model``), loaded on first use:
``jobs`` imports the training package, whose sample grids import ``generation``.
"""
JOBS = ("SamplingError", "SampleJob", "run_job", "sample_share", "load_model", "load_guidance", "check_sampler",
        "image_path", "prepare_output", "missing_indices", "sample_to_directory", "read_samples", "write_summaries")

__all__ = list(JOBS)


def __getattr__(name):
    if name in JOBS:
        from megdiffusion.sampling import jobs

        return getattr(jobs, name)
    raise AttributeError(f"module 'megdiffusion.sampling' has no attribute {name!r}")
