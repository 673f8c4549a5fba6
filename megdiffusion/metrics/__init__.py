"""Evaluation metrics: FID with the TF-2015 Inception network.

``megdiffusion.metrics.fid`` holds preprocessing, statistics and distances; ``megdiffusion.metrics.inception``
the network and its torch-free weight reader (imported lazily: it imports MegEngine).
"""
