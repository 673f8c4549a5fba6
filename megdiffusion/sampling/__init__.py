"""A trained model as a Python object (``model``: ``megdiffusion.load``), and a trained run's images (``jobs``): its
checkpoint as a network (``load_model``), resumable output directories of
numbered PNGs with their grid and npz, on one device or one process per GPU (``run_job``). Its public names are this
package's (``megdiffusion.sampling.load_model``).

Images from a network and its diffusion are ``diffusion.generation``'s; a model's scores, ``metrics.evaluate``'s.
"""
from megdiffusion.sampling.jobs import (SampleJob, SamplingError, check_sampler, image_path, open_checked,  # noqa: F401
                                        load_model, missing_indices, prepare_output, read_samples, run_job,
                                        sample_share, sample_to_directory, write_summaries)
from megdiffusion.sampling.model import LoadError, Model, load  # noqa: F401
