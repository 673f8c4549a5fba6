"""The CPU fast path: the UNet's training step and sampling calls outside MegEngine.

- ``native``: the network's forward and backward of ``Trainer.step`` (the loss between them is the diffusion's) and
  every eval-mode call, in fixed groups of samples on one worker process per core (``group_workers``),
  bit-identical on any core count;
- ``numpy_unet``: the UNet's forward and backward in numpy, channels last, its convolutions on oneDNN;
- ``onednn``: oneDNN's JIT convolutions through its C API (training primitives for the UNet, inference ones for
  the FID Inception);
- ``conv``: the ``Conv2d`` layer whose CPU forward and backward use those kernels where MegEngine's autodiff runs;
- ``batch_threads``: numpy work split over one thread per core.

MegEngine's own kernels (``MEGDIFFUSION_FAST_CONV=0``, ``MEGDIFFUSION_NATIVE_STEP=0``) stay the reference every
result here is tested against.
"""
