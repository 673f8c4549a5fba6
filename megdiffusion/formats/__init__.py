"""Model files written by other code: published DDPM checkpoints and the archives they come in.

- ``convert``: recognise a checkpoint's format from its content, read the network it describes and map every
  tensor onto megdiffusion's UNet (``scripts.convert``);
- ``torch_archive``: torch's zip and legacy pickle formats read without torch (a restricted unpickler);
- ``safetensors_file``: safetensors read with numpy.
"""
