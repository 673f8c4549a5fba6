"""The training batch stream: seeded order, exact state round trip, rank sharding, flips."""
import numpy as np
import pytest

from megdiffusion.data.loader import BatchLoader, LoaderError, per_rank_batch
from megdiffusion.files.images import to_float


def numbered_images(n, size=4):
    """uint8 NHWC images whose pixel (0, 0) is the index and whose columns differ (to see flips)."""
    images = np.zeros((n, size, size, 1), np.uint8)
    images[:, :, :, 0] = np.arange(size, dtype=np.uint8) * 10  # column ramp: flips reverse it
    images[:, 0, 0, 0] = np.arange(n)
    return images


def test_one_epoch_is_a_permutation_and_next_epoch_differs():
    loader = BatchLoader(numbered_images(24), batch_size=6, seed=3, random_flip=False)
    first = np.concatenate([loader.next_indices()[0] for _ in range(4)])
    second = np.concatenate([loader.next_indices()[0] for _ in range(4)])
    assert sorted(first) == list(range(24)) and sorted(second) == list(range(24))
    assert not np.array_equal(first, second)
    assert loader.state_dict() == {"epoch": 1, "position": 24}


def test_order_depends_on_seed_only():
    def order(seed):
        loader = BatchLoader(numbered_images(20), batch_size=5, seed=seed)
        return np.concatenate([loader.next_indices()[0] for _ in range(7)])

    assert np.array_equal(order(1), order(1))
    assert not np.array_equal(order(1), order(2))


def test_partial_last_batch_is_dropped():
    loader = BatchLoader(numbered_images(10), batch_size=4, seed=0, random_flip=False)
    loader.next_indices(), loader.next_indices()
    assert loader.state_dict() == {"epoch": 0, "position": 8}
    loader.next_indices()  # only 2 images left: the epoch ends
    assert loader.state_dict() == {"epoch": 1, "position": 4}


def test_state_round_trip_continues_with_identical_batches():
    """Over epochs and a resume, the same batches; each image with its own label."""
    images = numbered_images(30, size=6)
    labels = np.arange(30, dtype=np.int32) + 100
    straight = BatchLoader(images, batch_size=8, seed=5, labels=labels)
    expected = [straight.next_batch() for _ in range(9)]

    first = BatchLoader(images, batch_size=8, seed=5, labels=labels)
    got = [first.next_batch() for _ in range(4)]
    resumed = BatchLoader(images, batch_size=8, seed=5, labels=labels)
    resumed.load_state_dict(dict(first.state_dict()))
    got += [resumed.next_batch() for _ in range(5)]
    probe = BatchLoader(images, batch_size=8, seed=5)
    for (x, y), (x2, y2) in zip(expected, got):
        assert np.array_equal(x, x2) and np.array_equal(y, y2)
        np.testing.assert_array_equal(y, labels[probe.next_indices()[0]])


def test_two_ranks_are_disjoint_cover_the_epoch_and_match_one_process():
    images = numbered_images(32)
    single = BatchLoader(images, batch_size=8, seed=7)
    ranks = [BatchLoader(images, batch_size=8, seed=7, world_size=2, rank=r) for r in range(2)]
    seen = [[], []]
    for _ in range(4):
        whole, whole_flips = single.next_indices()
        parts = [loader.next_indices() for loader in ranks]
        assert np.array_equal(np.concatenate([p[0] for p in parts]), whole)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), whole_flips)
        for r in range(2):
            seen[r].extend(parts[r][0])
    assert len(seen[0]) == len(seen[1]) == 16
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(32))


def test_batches_are_scaled_nchw_and_flips_mirror_width():
    images = numbered_images(16, size=4)
    loader = BatchLoader(images, batch_size=16, seed=0, random_flip=True)
    indices, flips = BatchLoader(images, batch_size=16, seed=0).next_indices()
    batch, labels = loader.next_batch()
    assert batch.shape == (16, 1, 4, 4) and batch.dtype == np.float32 and labels is None
    assert 0 < flips.sum() < 16
    for x, source, flipped in zip(batch, to_float(images[indices]), flips):
        np.testing.assert_array_equal(x, source[:, :, ::-1] if flipped else source)


def test_without_flip_images_are_unchanged():
    images = numbered_images(8)
    loader = BatchLoader(images, batch_size=8, seed=0, random_flip=False)
    indices, flips = BatchLoader(images, batch_size=8, seed=0, random_flip=False).next_indices()
    assert not flips.any()
    np.testing.assert_array_equal(loader.next_batch()[0], to_float(images[indices]))


def test_bad_batch_sizes():
    assert per_rank_batch(12, 3) == 4
    with pytest.raises(LoaderError, match="not divisible by world size 4"):
        per_rank_batch(10, 4)
    with pytest.raises(LoaderError, match="larger than the dataset"):
        BatchLoader(numbered_images(4), batch_size=8, seed=0)
    with pytest.raises(LoaderError, match="rank 2 is outside world size 2"):
        BatchLoader(numbered_images(8), batch_size=4, seed=0, world_size=2, rank=2)
