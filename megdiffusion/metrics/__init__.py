"""Evaluation metrics on the features of the TF-2015 Inception network.

- ``inception``: the network (pool3 features) and its torch-free weight reader; imports MegEngine, so the others
  load it only when they run it;
- ``fid``: preprocessing, the features and statistics of image sets, the Frechet distance, statistics files and
  image sources;
- ``kid_pr``: KID and precision/recall of two feature sets (torch-fidelity's conventions);
- ``scores``: the metrics a command asks for, computed and printed alike by the fid script, training and the demo.
"""
INPUT_SIZE = 299  # the Inception's input side, in pixels
FEATURE_DIM = 2048  # its pool3 features: FID statistics are mu (2048,) and sigma (2048, 2048)
