"""An infinite, seeded, rank-sharded stream of training batches.

Epoch ``e`` visits the images in the order ``default_rng([seed, 0, e]).permutation(N)``, one global
batch at a time; a last partial global batch is dropped. Each rank takes its contiguous slice of the
global batch, so N ranks together see exactly the batches one process would. Flips are drawn per
global batch from ``default_rng([seed, 1, e, position])``. The whole state is ``(epoch, position)``.
"""
import numpy as np

from megdiffusion.errors import MegdiffusionError
from megdiffusion.files.images import to_float


class LoaderError(MegdiffusionError):
    """A batch size that cannot be served; the message is one line."""


def per_rank_batch(global_batch, world_size):
    """This rank's share of the global batch; ``LoaderError`` when it does not split evenly."""
    if global_batch % world_size:
        raise LoaderError(f"global batch size {global_batch} is not divisible by world size {world_size}")
    return global_batch // world_size


class BatchLoader:
    """Batches of ``images`` (uint8 NHWC: an array, prepared images, or anything indexed by an index array that has
    ``shape``, e.g. ``datasets.ImageFolder``) as float32 NCHW in [-1, 1], with their class ``labels`` (int, (N,)) when
    given, for one rank of ``world_size``."""

    def __init__(self, images, batch_size, seed, world_size=1, rank=0, random_flip=True, labels=None):
        if not 0 <= rank < world_size:
            raise LoaderError(f"rank {rank} is outside world size {world_size}")
        if batch_size > len(images):
            raise LoaderError(f"batch size {batch_size} is larger than the dataset ({len(images)} images)")
        self.images = images
        self.labels = labels
        self.batch_size = batch_size
        self.local_batch = per_rank_batch(batch_size, world_size)
        self.seed = seed
        self.rank = rank
        self.random_flip = random_flip
        self.epoch = 0
        self.position = 0
        self._order = None  # permutation of the current epoch, built lazily

    def state_dict(self):
        """The position in the stream; restoring it continues with exactly the same batches."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None

    def next_indices(self):
        """Dataset indices of this rank's next batch, and whether each is flipped; advances the stream."""
        if self.position + self.batch_size > len(self.images):
            self.epoch += 1
            self.position = 0
            self._order = None
        if self._order is None:
            self._order = np.random.default_rng([self.seed, 0, self.epoch]).permutation(len(self.images))
        flips = np.zeros(self.batch_size, dtype=bool)
        if self.random_flip:
            flip_rng = np.random.default_rng([self.seed, 1, self.epoch, self.position])
            flips = flip_rng.random(self.batch_size) < 0.5
        batch = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        mine = slice(self.rank * self.local_batch, (self.rank + 1) * self.local_batch)
        return batch[mine], flips[mine]

    def next_batch(self):
        """This rank's next batch: (float32 NCHW in [-1, 1], its labels or None)."""
        indices, flips = self.next_indices()
        return batch_images(self.images, indices, flips), None if self.labels is None else self.labels[indices]


def batch_images(images, indices, flips):
    """The float32 NCHW batch in [-1, 1] of ``images[indices]`` (an array, prepared images or a folder),
    mirrored left-right where ``flips``."""
    batch = np.asarray(images[indices])
    batch[flips] = batch[flips, :, ::-1]
    return to_float(batch)
