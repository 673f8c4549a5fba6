"""Model files written by other code: published DDPM checkpoints and the archives they come in.

``convert`` recognises a checkpoint's format from its content, reads the network it describes and maps every tensor
onto megdiffusion's UNet (``scripts.convert`` writes the result as a checkpoint). The parts: ``names`` (how each
format names the UNet's tensors), ``networks`` (the network a state dict's shapes describe), ``diffusers`` (its
config files), ``published`` (the published networks and what their files do not record); ``safetensors_file`` (and
``megdiffusion.files.torch_archive``, which reads checkpoints and datasets too) read the files without torch.

The formats (``FORMATS``), each Ho et al.'s network under its own names (``LAYOUTS``), but the last:

- ``diffusers``: a ``UNet2DModel`` directory: ``config.json`` and ``diffusion_pytorch_model.safetensors`` or
  ``.bin``, attention under current or pre-0.17 names; ``scheduler_config.json`` beside it (or in
  ``../scheduler/``) gives the schedule. The config must describe Ho's network (``check_diffusers_config``).
- ``pesser``: a torch state dict of pesser/pytorch_diffusion's ``Model`` (the layout ermongroup/ddim loads).
- ``pytorch_ddpm``: w86763777/pytorch-ddpm's ``ckpt.pt`` (``net_model``, ``ema_model``). Its network pads the
  downsample on every side, uses GroupNorm eps 1e-5 and an interleaved sinusoid table, recorded as model options.
- ``megengine_port``: a pickle of MegEngine/MegDiffusion's UNet state dict (its hub ``.pkl`` files) or its
  training ``ckpt.pkl`` (``model``, ``ema_model``). The stored time table tells which model code made it.
- ``improved_diffusion``: a torch state dict of openai/improved-diffusion's ``UNetModel`` (Nichol & Dhariwal 2021), or
  the MegEngine port's pickle of one (its ``iddpm_*_converted.pkl``, biases (1, C, 1, 1) and (1, C, 1)):
  symmetric downsample padding, GroupNorm eps 1e-5, its [cos | sin] time embedding, scale-shift norm and a
  learned variance read from the shapes, a fused qkv projection split into q, k and v per head. Its files record
  neither the image size, the head count nor the diffusion: published networks are recognised (``PUBLISHED``).

Reading files and naming keys import no MegEngine; ``convert.describe`` and ``convert.convert`` build the diffusion
and network.
"""
from megdiffusion.errors import MegdiffusionError

FORMATS = ("diffusers", "pesser", "pytorch_ddpm", "megengine_port", "improved_diffusion")
CHANNEL_ORDERS = ("rgb", "bgr")
# What a trained model exports to (``Model.export``): a diffusers pipeline, a MegEngine graph, an ONNX graph.
EXPORT_TARGETS = ("diffusers", "mge", "onnx")


class ConvertError(MegdiffusionError):
    """A checkpoint that cannot be converted faithfully; the message is one line that says why."""
