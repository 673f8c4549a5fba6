"""Prepare a dataset for training: ``python -m megdiffusion.scripts.prepare SRC DEST --image_size N``.

SRC: a folder of images (recursive; ``--labels subfolders`` makes its first-level subfolders the classes), LSUN's
LMDB (needs ``pip install 'megdiffusion[lmdb]'``), CIFAR-10's python batches, an npz of uint8 NHWC images
(``arr_0``, labels ``arr_1``), Fashion-MNIST's idx files, or ``fashion_mnist`` (the embedded split). DEST: one file
of uint8 images at the training resolution, centre-cropped and resized (``data.prepared``), with the labels and a
record of what it holds; ``train --data_path DEST`` reads it image by image. Images are decoded in worker processes
(every core by default), with a progress bar; DEST is written atomically. Bad input: one ``error:`` line, exit
code 2, nothing written.
"""
import os

from absl import flags

from megdiffusion.data.sources import ArraySource
from megdiffusion.files.disk import check_not_input
from megdiffusion.scripts import cli, shared_flags
from megdiffusion.scripts.cli import UsageError, define_integer, one_line_errors

FLAGS = flags.FLAGS
shared_flags.define_image_size_flag()  # the training resolution; images of many sizes need it
flags.DEFINE_enum("labels", "auto", ("auto", "subfolders", "none"), "Class labels: auto keeps the source's "
                  "(CIFAR-10's, an npz's arr_1, Fashion-MNIST's; a folder has none), subfolders takes a folder's "
                  "first-level subfolder names (sorted) as classes 0, 1, ..., none writes no labels.")
define_integer("workers", None, "Processes that decode images (default: one per core; 0: this process).", min=0,
               max=256)
flags.DEFINE_bool("skip_bad", False, "Leave out images that cannot be read, counted and listed in DEST's record "
                  "(default: stop at the first with one error line naming it).")
shared_flags.define_overwrite_flag()
shared_flags.define_progress_flag()
flags.adopt_module_key_flags(cli)  # so that --help lists the flags defined there and in shared_flags
flags.adopt_module_key_flags(shared_flags)


def main(argv):
    from megdiffusion.data.prepared import prepare
    from megdiffusion.data.spec import DataSpec

    with one_line_errors():
        if len(argv) != 3:
            raise UsageError(f"expected two arguments, SRC DEST; got {len(argv) - 1}")
        src, dest = argv[1:]
        check_not_input(dest, "DEST", src)
        source = DataSpec.parse(src).source(FLAGS.labels)
        size = FLAGS.image_size or _one_size(source)
        if not size:
            raise UsageError(f"give --image_size (the training resolution) to prepare {src}: its images are decoded "
                             "one by one and may differ in size")
        record = prepare(source, dest, size, FLAGS.workers, FLAGS.skip_bad, FLAGS.overwrite, FLAGS.progress)
    classes = f", {len(record['classes'])} classes" if record["classes"] else \
        (", labelled" if record["has_labels"] else ", no labels")
    skipped = f"; {len(record['skipped'])} unreadable images skipped (listed in its record)" \
        if record["skipped"] else ""
    print(f"wrote {dest}: {record['count']:,} images of {size}x{size}x{record['channels']}{classes} from "
          f"{record['source']} ({os.path.getsize(dest) / 2 ** 20:,.1f} MiB){skipped}; train with "
          f"--data_path {dest}")


def _one_size(source):
    """The side of an array source's square images, or None (images of many sizes, or not square)."""
    if not isinstance(source, ArraySource):
        return None
    _, height, width, _ = source.images.shape
    return height if height == width else None


def run():
    """Console entry point (``megdiffusion-prepare``)."""
    cli.run_command(main)


if __name__ == "__main__":
    run()
