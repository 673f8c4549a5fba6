"""The fast-path switches under their earlier name: the CPU convolutions now live in ``megdiffusion.cpu.conv``;
scripts that turn the fast path on or off from here (e.g. ``../shared/peer``'s PyTorch comparison) keep working."""
from megdiffusion.cpu.conv import fast_conv_enabled, set_fast_conv  # noqa: F401
