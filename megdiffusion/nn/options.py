"""The UNet options in which published DDPM networks differ, with Ho et al.'s choices as defaults.

Imports no MegEngine: the training config offers these names as flag choices.
"""

NORM_GROUPS = 32  # GroupNorm groups and eps: TensorFlow's group_norm defaults, which Ho's code uses
NORM_EPS = 1e-6

# The stride-2 downsample convolution's padding: "bottom_right" is TF's "SAME" for even sizes (one row and
# column of zeros at the bottom and right; Ho, pesser, diffusers), "symmetric" one on every side (pytorch-ddpm,
# and every megdiffusion checkpoint written before the option existed).
DOWNSAMPLE_PADDINGS = ("bottom_right", "symmetric")
DOWNSAMPLE_PADDING = "bottom_right"

# The sinusoidal timestep embedding: "ho" is [sin | cos] with frequencies exp(-ln(1e4) i / (half - 1));
# "pytorch_ddpm" interleaves sin and cos, with frequencies exp(-ln(1e4) 2i / dim); "iddpm" (improved-diffusion)
# is [cos | sin] with frequencies exp(-ln(1e4) i / half).
TIME_EMBEDDINGS = ("ho", "pytorch_ddpm", "iddpm")
TIME_EMBEDDING = "ho"

# The class label of "no class": it adds no class embedding, so a class-conditional network trained with some labels
# dropped (``--class_dropout``) predicts unconditionally for it (classifier-free guidance).
NO_CLASS = -1
