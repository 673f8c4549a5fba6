"""Bytes on disk: atomic writes, npz files and checks of paths (``disk``), image files and grids (``images``), torch
archives and pickles read without torch (``torch_archive``)."""
