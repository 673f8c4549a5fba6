"""Bad input to train, sample, fid, nll, convert and the demo, tried as a hostile new user would: every case
ends with exit code 2, one ``error:`` line that names the problem, no traceback, and every file as it was
(the case's directory, the shared files it reads, and an empty HOME)."""
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megdiffusion.compat import cuda_driver_loadable
from megdiffusion.data.prepared import prepare
from megdiffusion.data.sources import ArraySource, FolderSource
from megdiffusion.diffusion.sampler_settings import SamplerSettings
from megdiffusion.files.images import read_image, save_png
from megdiffusion.training.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from megdiffusion.training.config import CPU_RECIPE

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this runs ``open('pwned', 'w')`` in the working directory: a crafted checkpoint."""

    def __reduce__(self):
        return exec, ("open('pwned', 'w').write('ran')",)


@pytest.fixture(scope="session")
def shared(tmp_path_factory, tiny_config, tiny_images):
    """The files the cases read: one tiny trained run (made once), its samples, and damaged or crafted
    checkpoints, images, npz files and directories. Each case runs in its own copy."""
    from megdiffusion import sampling
    from megdiffusion.training.start import train

    root = tmp_path_factory.mktemp("bad_input")
    np.savez(root / "data.npz", arr_0=tiny_images(16))
    cfg = tiny_config(total_steps=2, dataset="npz", data_path=str(root / "data.npz"), logdir=str(root / "run"))
    train(cfg, tiny_images(16), progress=False)
    np.savez(root / "labelled.npz", arr_0=tiny_images(16), arr_1=np.arange(16) % 3)
    train(cfg.replace(data_path=str(root / "labelled.npz"), logdir=str(root / "conditional"), num_classes=3),
          tiny_images(16), progress=False)
    sampling.run_job(sampling.SampleJob(str(root / "run"), str(root / "samples"), 2,
                                        settings=SamplerSettings("ddim", 2), progress=False))
    shutil.copytree(root / "samples", root / "samples_truncated")
    png = (root / "samples_truncated" / "000001.png").read_bytes()
    (root / "samples_truncated" / "000001.png").write_bytes(png[: len(png) // 2])
    (root / "manifest_list").mkdir()
    (root / "manifest_list" / "manifest.json").write_text("[]\n")

    state = load_checkpoint(checkpoint_path(str(root / "run"), 2))
    crafted = {"evil.pkl": {**state, "config": Payload()},
               "mismatch.pkl": {**state, "config": {**state["config"], "model_channels": 16, "norm_groups": 4}},
               "bad_config.pkl": {**state, "config": {**state["config"], "image_size": -4}},
               "nan_config.pkl": {**state, "config": {**state["config"], "lr": float("nan")}},
               "cosine.pkl": {**state, "config": {**state["config"], "beta_schedule": "cosine"}},
               "text_weights.pkl": {**state, "ema": {name: "abc" for name in state["ema"]}},
               "a_list.pkl": [1, 2, 3]}
    for name, obj in crafted.items():
        save_checkpoint(str(root / name), obj)
    (root / "garbage.pkl").write_bytes(b"\x80\x04garbage")
    (root / "cifar_evil").mkdir()
    for i in range(1, 6):
        with open(root / "cifar_evil" / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": Payload()}, f, protocol=2)

    np.savez(root / "labels_to_11.npz", arr_0=tiny_images(16), arr_1=np.arange(16) % 12)
    np.savez(root / "three_labels.npz", arr_0=tiny_images(16), arr_1=np.arange(3))
    np.savez(root / "mu_only.npz", mu=np.zeros(2048))
    np.save(root / "array.npy", tiny_images(4))
    os.rename(root / "array.npy", root / "array.npz")
    (root / "broken.npz").write_bytes(b"PK\x03\x04broken")
    (root / "images").mkdir()
    for i in range(3):
        save_png(root / "images" / f"{i}.png", tiny_images(3)[i])
    (root / "images_broken").mkdir()
    (root / "images_broken" / "a.png").write_bytes(b"not an image")
    (root / "empty").mkdir()
    (root / "folder.npz").mkdir()
    (root / "notours").mkdir()
    (root / "notours" / "thesis.tex").write_text("keep me")
    (root / "afile.txt").write_text("keep me")
    shutil.copy(Path(__file__).parent / "fixtures" / "iddpm" / "unet_small.pt", root / "unet_small.pt")

    # malformed files: statistics, arrays, labels, links, checkpoints, safetensors headers
    np.savez(root / "stats_10.npz", mu=np.zeros(10), sigma=np.eye(10))
    np.savez(root / "five_d.npz", arr_0=np.zeros((2, 2, 8, 8, 1), np.uint8))
    np.savez(root / "float_images.npz", arr_0=tiny_images(4).astype(np.float32))
    np.savez(root / "negative_labels.npz", arr_0=tiny_images(16), arr_1=np.arange(16) % 3 - 1)
    os.symlink("nowhere", root / "dangling")
    (root / "corrupt_run" / "checkpoints").mkdir(parents=True)
    shutil.copy(root / "run" / "flags.cfg", root / "corrupt_run" / "flags.cfg")
    (root / "corrupt_run" / "checkpoints" / "ckpt_0000002.pkl").write_bytes(
        Path(checkpoint_path(str(root / "run"), 2)).read_bytes()[:100])
    (root / "huge_header.safetensors").write_bytes((2 ** 62).to_bytes(8, "little") + b'{"w": {}}')

    # prepared data files
    prepare(ArraySource(tiny_images(12), None, "tiny"), root / "p8.data", 8, workers=0)
    (root / "truncated.data").write_bytes((root / "p8.data").read_bytes()[:-100])
    prepare(ArraySource(np.repeat(tiny_images(16), 3, axis=3), None, "tiny rgb"), root / "rgb8.data", 8, workers=0)

    # sample directories of other settings, flagfiles (two GPUs, including themselves), a linked dataset
    for name, order in (("order3_out", 3), ("logsnr_out", None)):
        settings = SamplerSettings("unipc", 4, order=order, spacing="logsnr" if order is None else None)
        sampling.run_job(sampling.SampleJob(str(root / "run"), str(root / name), 2, settings=settings,
                                            progress=False))
    (root / "two_gpus.cfg").write_text(Path(CPU_RECIPE).read_text() + "--num_gpus=2\n")
    (root / "self.cfg").write_text("--batch_size=8\n--flagfile=self.cfg\n")
    (root / "a.cfg").write_text("--flagfile=b.cfg\n")
    (root / "bad_batch.cfg").write_text("# a comment\n\n--batch_size=0\n")
    (root / "b.cfg").write_text("--flagfile=a.cfg\n")
    os.symlink("data.npz", root / "data_link.npz")

    # round 4: labels int32 cannot hold, classes recorded, CIFAR-10 batches of other rows, an LMDB, another size
    np.savez(root / "labels_huge.npz", arr_0=tiny_images(16), arr_1=np.arange(16, dtype=np.int64) * 2 ** 40)
    np.savez(root / "labels_uint64.npz", arr_0=tiny_images(16), arr_1=np.full(16, 2 ** 63, np.uint64))
    for c, name in enumerate("abc"):
        (root / "classes" / name).mkdir(parents=True)
        for i in range(3):
            save_png(root / "classes" / name / f"{i}.png", tiny_images(9)[3 * c + i])
    prepare(FolderSource(root / "classes", labels=True), root / "classes3.data", 8, workers=0)
    for name, rows, label in (("cifar_short", 3000, 0), ("cifar_label_10", 3072, 10)):
        (root / name).mkdir()
        for i in range(1, 6):
            with open(root / name / f"data_batch_{i}", "wb") as f:
                pickle.dump({b"data": np.zeros((10, rows), np.uint8), b"labels": [label] * 10}, f, protocol=2)
    (root / "lsun").mkdir()
    (root / "lsun" / "data.mdb").write_bytes(b"")
    prepare(ArraySource(tiny_images(16), None, "tiny"), root / "p16.data", 16, workers=0)
    (root / "snapshots" / "ema_snapshots").mkdir(parents=True)  # one snapshot's name: its steps are listed unread
    (root / "snapshots" / "ema_snapshots" / "snapshot_00000004.pkl").write_bytes(b"")

    # statistics without features (compressed: an identity sigma of 2048 x 2048 is 32 MB)
    np.savez_compressed(root / "stats_plain.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    np.savez_compressed(root / "one_feature.npz", mu=np.zeros(2048), sigma=np.eye(2048),
                        features=np.zeros((1, 2048), np.float32))
    return root


TRAIN = ["--dataset=npz", "--data_path=data.npz", "--model_channels=32", "--channel_mult=1", "--norm_groups=8",
         "--num_res_blocks=1", "--attention_resolutions=", "--num_timesteps=40", "--batch_size=8", "--total_steps=1",
         "--sample_every=0"]
SAMPLE = ["--ckpt=run", "--output=out", "--num_images=2", "--batch_size=2", "--sampler=ddim", "--steps=2"]
RESPACED = [arg for arg in SAMPLE if arg != "--steps=2"]
IDDPM = ["unet_small.pt", "out.pkl"]
DEMO = ["--output=out", "--minutes=0.01", "--num_images=4", "--num_reference=4", "--steps=2"]

FIFOS = ("fifo.npz", "fifo.pt", "fifo.pkl", "fifo.data")  # named pipes in each case's directory, named like inputs
# (id, script, arguments, what the error line says). Later flags override earlier ones; {shared} is the shared
# directory (its samples' manifests name the shared run). Ids marked "17:" are the cases issue 17 reported broken.
CASES = [
    # round 4 (issue 58's causes): labels int32 cannot hold, classes a file records, CIFAR-10 batches checked
    ("58:prepare-labels-beyond-int32", "prepare", ["labels_huge.npz", "out.data"],
     "got 16492674416640, which does not fit 32 bits: number the classes from 0"),
    ("58:train-labels-beyond-int32", "train", [*TRAIN, "--data_path=labels_huge.npz", "--num_classes=4"],
     "which does not fit 32 bits"),
    ("58:train-labels-uint64", "train", [*TRAIN, "--data_path=labels_uint64.npz", "--num_classes=4"],
     "got 9223372036854775808, which does not fit 32 bits"),
    ("58:prepared-three-classes-as-four", "train", [*TRAIN, "--data_path=classes3.data", "--num_classes=4"],
     "classes3.data holds 3 classes (a, b, c), not --num_classes 4; set --num_classes 3"),
    ("58:folder-three-classes-as-two", "train", [*TRAIN, "--dataset=folder", "--data_path=classes", "--image_size=8",
                                                 "--num_classes=2"], "class label 2 is outside 0..1"),
    ("58:folder-three-classes-as-five", "train", [*TRAIN, "--dataset=folder", "--data_path=classes", "--image_size=8",
                                                  "--num_classes=5"], "classes holds 3 classes (a, b, c)"),
    ("58:cifar-rows-of-3000-bytes", "prepare", ["cifar_short", "out.data"],
     "cifar_short/data_batch_1 holds data uint8 (10, 3000), not rows of 3072 bytes"),
    ("58:cifar-rows-of-3000-bytes-in-training", "train", [*TRAIN, "--dataset=cifar10", "--data_path=cifar_short"],
     "not rows of 3072 bytes"),
    ("58:cifar-label-10", "prepare", ["cifar_label_10", "out.data"], "not one class 0-9 an image"),
    ("58:cifar-label-10-in-training", "train", [*TRAIN, "--dataset=cifar10", "--data_path=cifar_label_10",
                                                "--num_classes=10"], "not one class 0-9 an image"),
    # a resume past its end; messages that name the cause and a fix that can work
    ("58:resume-past-total-steps", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume",
                                             "--total_steps=1"],
     "which is at step 2, past --total_steps 1; give --total_steps above 2 to train on"),
    ("58:resume-past-total-steps-without-flagfile", "train", ["--logdir=run", "--resume", "--total_steps=1"],
     "past --total_steps 1"),
    ("58:sample-with-a-training-flagfile", "sample", [*SAMPLE, "--flagfile=run/flags.cfg"],
     "set in flagfile run/flags.cfg, is a training flag, not one of this command (which reads a run with --ckpt "
     "RUN): run/flags.cfg is a flagfile of megdiffusion.scripts.train"),
    ("58:fid-with-a-training-flagfile", "fid", ["--flagfile=run/flags.cfg", "images", "images"],
     "is a training flag, not one of this command"),
    ("58:nll-with-a-training-flagfile", "nll", ["--flagfile=run/flags.cfg", "data.npz"], "is a training flag"),
    ("58:flagfile-flag-out-of-bounds", "sample", [*(arg for arg in SAMPLE if not arg.startswith("--batch_size")),
                                                  "--flagfile=bad_batch.cfg"],
     "--batch_size must be >= 1 and <= 1048576, got 0 (set in flagfile bad_batch.cfg)"),
    ("58:flagfile-a-directory", "sample", ["--flagfile=images"], "cannot open flagfile images: Is a directory"),
    ("58:folder-dataset-of-an-lmdb", "train", [*TRAIN, "--dataset=folder", "--data_path=lsun", "--image_size=8"],
     "--data_path lsun is an LMDB database (LSUN's), not a folder of images: train with --data_path DEST after "
     "python -m megdiffusion.scripts.prepare lsun DEST --image_size N"),
    ("58:folder-dataset-of-cifar", "train", [*TRAIN, "--dataset=folder", "--data_path=cifar_short", "--image_size=8"],
     "holds cifar10's files, not a folder of images: use --dataset cifar10"),
    ("58:resume-on-a-file-of-another-size", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume",
                                                      "--data_path=p16.data"],
     "p16.data holds 16x16 images, but the run continued trains at 8x8: prepare the source again with --image_size 8"),
    ("58:world-size-without-gpus", "train", [*TRAIN, "--logdir=new", "--world_size=2"],
     "--world_size 2 needs CUDA GPUs, but MegEngine sees none on this machine; use --world_size 1"),
    # inputs that are named pipes: refused, not waited on
    ("58:fid-statistics-a-fifo", "fid", ["images", "fifo.npz"],
     "fifo.npz is a FIFO (named pipe), not a file to read; give a regular file"),
    ("58:train-data-a-fifo", "train", [*TRAIN, "--data_path=fifo.npz"], "--data_path must be an .npz file"),
    ("58:train-prepared-a-fifo", "train", [*TRAIN, "--dataset=prepared", "--data_path=fifo.data"],
     "--data_path must be a file written by megdiffusion.scripts.prepare"),
    ("58:prepare-from-a-fifo", "prepare", ["fifo.npz", "out.data"], "fifo.npz is a FIFO (named pipe)"),
    ("58:convert-a-fifo", "convert", ["fifo.pt", "out.pkl"], "fifo.pt is a FIFO (named pipe)"),
    ("58:sample-from-a-fifo", "sample", [*SAMPLE, "--ckpt=fifo.pkl"], "fifo.pkl"),
    ("58:nll-of-a-fifo", "nll", ["--ckpt=run", "fifo.npz"], "fifo.npz is a FIFO (named pipe)"),
    ("58:fid-save-stats-of-a-fifo", "fid", ["--save_stats", "fifo.data", "s.npz"], "fifo.data is a FIFO"),
    # checks before the first write
    ("58:streamed-folder-unreadable-image", "train", [*TRAIN, "--dataset=folder", "--data_path=images_broken",
                                                      "--image_size=8", "--logdir=new"],
     "cannot read image images_broken/a.png"),
    ("58:save-stats-with-kid", "fid", ["--save_stats", "--metrics=kid", "images", "s.npz"],
     "--metrics does nothing with --save_stats, which writes statistics and scores nothing; drop --metrics"),
    ("58:class-label-into-existing-samples", "sample", [*SAMPLE, "--output=order3_out", "--class_label=1"],
     "class 1 asked of an unconditional model"),
    ("58:class-label-into-new-samples", "sample", [*SAMPLE, "--output=new/deeper", "--class_label=1"],
     "class 1 asked of an unconditional model"),
    # a solver's steps bounded by the model's timesteps, in every command that samples
    ("50:euler-leading-over-T", "sample", [*SAMPLE, "--sampler=euler", "--spacing=leading", "--steps=41"],
     "--steps 41 is more than --spacing leading can place on this model's 40 timesteps without repeating a noise "
     "level: euler takes at most 40 steps there"),
    ("50:unipc-linspace-at-T", "sample", [*SAMPLE, "--sampler=unipc", "--spacing=linspace", "--steps=40"],
     "unipc takes at most 39 steps there"),
    ("50:dpmpp-trailing-over-T", "sample", [*SAMPLE, "--sampler=dpmpp_2m_sde", "--spacing=trailing", "--steps=400"],
     "dpmpp_2m_sde takes at most 40 steps there"),
    ("50:fid-heun-leading-over-T", "fid", ["--ckpt=run", "--num_images=2", "--sampler=heun", "--spacing=leading",
                                           "--steps=41", "images"], "heun takes at most 40 steps there"),
    ("50:grid-euler-over-T", "train", [*TRAIN, "--sample_every=1", "--sample_sampler=euler",
                                       "--sample_spacing=leading", "--sample_steps=41"],
     "--sample_steps 41 is more than --sample_spacing leading can place on this model's 40 timesteps"),
    ("50:demo-dpmpp-leading-over-T", "demo", [*DEMO, "--sampler=dpmpp_3m", "--spacing=leading", "--steps=2000"],
     "dpmpp_3m takes at most 1000 steps there"),
    # cause B: guidance bounded (its float32 overflow gave NaN images; tests/test_sample.py for the finiteness check)
    ("50:guidance-overflowing", "sample", [*SAMPLE, "--sampler=dpmpp_2m", "--steps=4", "--guide_ckpt=run",
                                           "--guidance=1e308"], "--guidance must be >= 1 and <= 100, got 1e+308"),
    ("50:fid-guidance-overflowing", "fid", ["--ckpt=run", "--num_images=2", "--guide_ckpt=run", "--guidance=1e30",
                                            "images"], "--guidance must be >= 1 and <= 100"),
    # cause C: a resumable directory's settings compared whole, resolved, both ways
    ("50:continue-without-the-order", "sample", [*RESPACED, "--ckpt={shared}/run", "--sampler=unipc", "--steps=4",
                                                 "--output=order3_out", "--num_images=4"],
     "order3_out holds images made with other settings (order: 3 -> 2)"),
    ("continue-without-the-spacing", "sample", [*RESPACED, "--ckpt={shared}/run", "--sampler=unipc", "--steps=4",
                                                "--output=logsnr_out", "--num_images=4"],
     "logsnr_out holds images made with other settings (spacing: 'logsnr' -> 'karras')"),
    ("continue-with-another-sampler-default-steps", "sample", [*RESPACED, "--ckpt={shared}/run", "--sampler=unipc",
                                                               "--output=order3_out", "--order=3", "--num_images=4"],
     "order3_out holds images made with other settings (steps: 4 -> 20)"),
    # cause H: every check before the first write
    ("50:demo-config-for-two-gpus", "demo", [*DEMO, "--config=two_gpus.cfg"], "--num_gpus 2 needs CUDA GPUs"),
    # cause E: flagfiles that cannot be read
    ("50:flagfile-a-checkpoint", "train", ["--flagfile=run/checkpoints/ckpt_0000002.pkl"],
     "--flagfile run/checkpoints/ckpt_0000002.pkl is not a text file of flags"),
    ("50:flagfile-including-itself", "train", ["--flagfile=self.cfg"], "flagfile self.cfg includes itself"),
    ("flagfile-cycle", "sample", ["--flagfile=a.cfg"], "flagfile a.cfg includes itself (through"),
    ("flagfile-binary-of-fid", "fid", ["--flagfile=data.npz", "images", "images"], "--flagfile data.npz is not a text"),
    # cause F: flags that do nothing in the combination given
    ("50:kid-flags-scoring-fid-only", "fid", ["--metrics=fid", "--kid_subset_size=3", "--kid_subsets=7", "images",
                                              "images"],
     "--kid_subsets does nothing without --metrics with kid (or all); drop it, or add --metrics with kid (or all)"),
    ("kid-seed-scoring-pr-only", "fid", ["--metrics=pr", "--kid_seed=3", "images", "images"],
     "--kid_seed does nothing without --metrics with kid"),
    ("50:grid-sampler-without-grids", "train", [*TRAIN, "--sample_sampler=euler"],
     "--sample_sampler does nothing without --sample_every or --fid_every (what samples with it); drop it, or add"),
    ("fid-metrics-without-fid-every", "train", [*TRAIN, "--fid_metrics=kid"], "--fid_metrics does nothing without "
                                                                              "--fid_every"),
    ("grid-size-without-grids", "train", [*TRAIN, "--sample_num=16"], "--sample_num does nothing without "
                                                                      "--sample_every"),
    ("master-ip-on-one-machine", "train", [*TRAIN, "--master_ip=10.0.0.1"],
     "--master_ip does nothing without --world_size above --num_gpus (several machines)"),
    ("sampler-without-a-model", "fid", ["--sampler=euler", "images", "images"],
     "--sampler does nothing without --ckpt or --sweep (scoring a model's samples)"),
    ("overwrite-without-save-stats", "fid", ["--overwrite", "images", "images"],
     "--overwrite does nothing without --save_stats"),
    # cause I: a message that contradicts itself
    ("50:metrics-all-and-fid", "fid", ["--metrics=all,fid", "images", "images"],
     "'all' stands alone in --metrics (it means fid,kid,pr); got 'all,fid'"),
    ("fid-metrics-all-and-kid-in-training", "train", [*TRAIN, "--fid_every=1", "--fid_metrics=kid,all"],
     "'all' stands alone in --fid_metrics"),
    # cause J: counts with an upper bound
    ("50:kid-subsets-huge", "fid", ["--metrics=kid", "--kid_subsets=99999999999999999999", "images", "images"],
     "--kid_subsets must be >= 1 and <= 10000"),
    ("timesteps-beyond-any-schedule", "train", [*TRAIN, "--num_timesteps=99999999999"],
     "--num_timesteps must be >= 2 and <= 100000"),
    ("grid-of-a-billion-images", "train", [*TRAIN, "--sample_every=1", "--sample_num=1000000000"],
     "--sample_num must be >= 1 and <= 4096"),
    ("fid-during-training-beyond-any-seed", "train", [*TRAIN, "--fid_every=1", "--fid_num_images=99999999999"],
     "--fid_num_images must be >= 2 and <= 4294967296"),
    ("batch-beyond-any-machine", "train", [*TRAIN, "--batch_size=99999999999"],
     "--batch_size must be >= 1 and <= 1048576"),
    ("demo-images-beyond-any-seed", "demo", [*DEMO[:1], "--images=99999999999999"],
     "--images must be >= 1 and <= 4294967296"),
    ("demo-minutes-beyond-a-week", "demo", [*DEMO[:1], "--minutes=1e9"], "--minutes must be > 0 and <= 10080"),
    # cause K: an output that is its own input, however named
    ("50:stats-over-their-images", "fid", ["--save_stats", "--overwrite", "data.npz", "data.npz"],
     "OUT.npz data.npz is the input data.npz itself; give the output another path"),
    ("stats-over-their-images-through-a-link", "fid", ["--save_stats", "--overwrite", "data.npz", "data_link.npz"],
     "OUT.npz data_link.npz is the input data.npz itself"),
    ("stats-over-their-images-through-dots", "fid", ["--save_stats", "--overwrite", "data.npz", "images/../data.npz"],
     "is the input data.npz itself"),
    ("convert-over-its-source", "convert", ["unet_small.pt", "unet_small.pt", "--overwrite"],
     "OUT unet_small.pt is the input unet_small.pt itself"),
    ("prepare-over-its-source-through-a-link", "prepare", ["data.npz", "data_link.npz", "--overwrite"],
     "DEST data_link.npz is the input data.npz itself"),
    # prepare
    ("47:prepare-no-images", "prepare", ["empty", "out.data", "--image_size=8"], "no images (.png, .jpg"),
    ("47:prepare-corrupt-image", "prepare", ["images_broken", "out.data", "--image_size=8"],
     "cannot read image images_broken/a.png"),
    ("47:prepare-labels-of-a-flat-folder", "prepare", ["images", "out.data", "--image_size=8", "--labels=subfolders"],
     "lie in images itself; move the images into one subfolder per class"),
    ("47:prepare-subfolder-labels-of-an-npz", "prepare", ["data.npz", "out.data", "--labels=subfolders"],
     "--labels subfolders takes classes from a folder's subfolders; data.npz is not a folder of images"),
    ("47:prepare-dest-exists", "prepare", ["images", "afile.txt", "--image_size=8"],
     "DEST afile.txt exists; give a new path, or --overwrite to replace it"),
    ("47:prepare-dest-unwritable", "prepare", ["images", "/proc/x.data", "--image_size=8"],
     "DEST /proc/x.data cannot be written"),
    ("47:prepare-dest-under-a-file", "prepare", ["images", "afile.txt/x.data", "--image_size=8"],
     "afile.txt is a file"),
    ("prepare-dest-is-a-directory", "prepare", ["images", "empty", "--image_size=8"], "DEST empty is a directory"),
    ("prepare-dest-is-src", "prepare", ["data.npz", "data.npz", "--overwrite"],
     "DEST data.npz is the input data.npz itself; give the output another path"),
    ("prepare-src-missing", "prepare", ["nope", "out.data", "--image_size=8"],
     "'nope' does not exist; give a folder of images"),
    ("prepare-src-not-images", "prepare", ["afile.txt", "out.data", "--image_size=8"],
     "'afile.txt' is none of the data a command reads"),
    ("prepare-folder-without-size", "prepare", ["images", "out.data"], "give --image_size"),
    ("prepare-size-zero", "prepare", ["images", "out.data", "--image_size=0"],
     "--image_size must be >= 1 and <= 4096, got 0"),
    ("prepare-workers-negative", "prepare", ["images", "out.data", "--image_size=8", "--workers=-1"],
     "--workers must be >= 0 and <= 256, got -1"),
    ("prepare-one-argument", "prepare", ["images"], "expected two arguments, SRC DEST; got 1"),
    ("prepare-npz-without-images", "prepare", ["mu_only.npz", "out.data"], "has no 'arr_0' array"),
    ("prepare-damaged-npz", "prepare", ["broken.npz", "out.data"], "cannot read broken.npz as an npz archive"),
    # scoring against one's own data
    ("47:fid-floor-of-two-sources", "fid", ["--floor", "images", "images"],
     "--floor scores one image source against itself: give one PATH and no --save_stats; got 2 PATHs"),
    ("fid-floor-with-save-stats", "fid", ["--floor", "--save_stats", "images", "s.npz"],
     "got 2 PATHs and --save_stats"),
    ("47:fid-floor-larger-than-the-set", "fid", ["--floor", "--num_images=2", "images"],
     "--floor draws two disjoint sets of --num_images=2; images has 3 images"),
    ("fid-image-size-zero", "fid", ["--image_size=0", "images", "images"],
     "--image_size must be >= 1 and <= 4096, got 0"),
    ("47:fid-prepared-at-another-size", "fid", ["--save_stats", "--image_size=16", "p8.data", "s.npz"],
     "p8.data holds 8x8 images, not --image_size 16"),
    ("fid-prepared-truncated", "fid", ["--save_stats", "truncated.data", "s.npz"], "is truncated or damaged"),
    # training on prepared data
    ("47:prepared-truncated", "train", [*TRAIN, "--data_path=truncated.data"],
     "truncated.data is truncated or damaged"),
    ("47:prepared-other-resolution", "train", [*TRAIN, "--dataset=prepared", "--data_path=p8.data",
                                               "--image_size=16"], "p8.data holds 8x8 images, not --image_size 16"),
    ("prepared-without-labels", "train", [*TRAIN, "--data_path=p8.data", "--num_classes=3"],
     "p8.data was prepared without class labels"),
    ("prepared-not-a-prepared-file", "train", [*TRAIN, "--dataset=prepared", "--data_path=afile.txt"],
     "must be a file written by megdiffusion.scripts.prepare"),
    ("47:resume-on-other-data", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume",
                                          "--data_path=p8.data"],
     "was trained on 16 images (checksum unknown); this dataset has 12"),
    ("47:resume-on-data-of-other-channels", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume",
                                                      "--data_path=rgb8.data"],
     "was trained on images of 1 channel(s); this dataset's have 3: resume on the run's data"),
    ("init-from-data-of-other-channels", "train", ["--flagfile=run/flags.cfg", "--logdir=new", "--data_path=rgb8.data",
                                                   "--init_from=run"],
     "--init_from run was trained on images of 1 channel(s); this dataset's have 3: start without --init_from"),
    # a run continued without its flagfile: the command line may not change what decides the weights
    ("resume-changing-the-weights", "train", ["--logdir=run", "--resume", "--total_steps=3", "--lr=0.1",
                                              "--model_channels=64", "--save_every=1"],
     "run/checkpoints/ckpt_0000002.pkl was trained with different model_channels (--model_channels=32); use those "
     "flags"),
    ("56:resume-changing-the-lr", "train", ["--logdir=run", "--resume", "--total_steps=3", "--lr=0.1"],
     "run/checkpoints/ckpt_0000002.pkl was trained with different lr (--lr=0.0002), and exact resume keeps them; use "
     "those flags, or give --allow_changes to continue the run with the new ones"),
    ("56:resume-changing-batch-and-seed-by-flagfile", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume",
                                                                 "--batch_size=2", "--seed=5"],
     "was trained with different batch_size, seed (--batch_size=8 --seed=0), and exact resume keeps them"),
    ("56:allow-changes-not-boolean", "train", ["--logdir=run", "--resume", "--allow_changes=maybe"],
     "flag --allow_changes=maybe: ('Non-boolean argument to boolean flag', 'maybe')"),
    ("56:resume-changing-the-network-even-when-allowed", "train", ["--logdir=run", "--resume", "--allow_changes",
                                                                   "--num_res_blocks=2"],
     "was trained with different num_res_blocks (--num_res_blocks=1); use those flags"),
    # 57: post-hoc EMA
    ("57:ema-profiles-not-numbers", "train", [*TRAIN, "--ema_profiles=0.05,x"],
     "--ema_profiles must be relative standard deviations, comma-separated (e.g. 0.05,0.10); got 0.05,x"),
    ("57:ema-profile-too-long", "train", [*TRAIN, "--ema_profiles=0.05,0.3"], "sigma_rel 0.3 is outside (0, 0.28]"),
    ("57:ema-profile-zero", "train", [*TRAIN, "--ema_profiles=0"], "sigma_rel 0 is outside (0, 0.28]"),
    ("57:ema-profile-twice", "train", [*TRAIN, "--ema_profiles=0.05,0.05"],
     "--ema_profiles names a length twice (0.05,0.05); give each once"),
    ("57:snapshots-without-profiles", "train", [*TRAIN, "--snapshot_every=5"],
     "--snapshot_every saves post-hoc EMA profiles: give --ema_profiles too"),
    ("57:snapshot-dtype", "train", [*TRAIN, "--ema_profiles=0.1", "--snapshot_dtype=float64"],
     "flag --snapshot_dtype=float64: value should be one of <float32|float16>"),
    ("57:resume-adding-profiles-even-when-allowed", "train", ["--logdir=run", "--resume", "--allow_changes",
                                                              "--ema_profiles=0.1"],
     "was trained with different ema_profiles (--ema_profiles=); use those flags"),
    ("57:posthoc-without-logdir", "posthoc_ema", ["--sigma_rel=0.07", "--output=out"],
     "expected one argument, LOGDIR (a run trained with --ema_profiles and --snapshot_every); got 0"),
    ("57:posthoc-without-sigma-rel", "posthoc_ema", ["snapshots", "--output=out"], "give --sigma_rel"),
    ("57:posthoc-sigma-rel-not-a-number", "posthoc_ema", ["snapshots", "--sigma_rel=0.07,wide", "--output=out"],
     "--sigma_rel must be relative standard deviations, comma-separated (e.g. 0.05,0.10); got 0.07,wide"),
    ("57:posthoc-sigma-rel-outside", "posthoc_ema", ["snapshots", "--sigma_rel=0.5", "--output=out"],
     "--sigma_rel: sigma_rel 0.5 is outside (0, 0.28]"),
    ("posthoc-sigma-rel-twice", "posthoc_ema", ["snapshots", "--sigma_rel=0.07,0.07", "--output=out"],
     "--sigma_rel names a length twice (0.07,0.07); give each once"),
    ("57:posthoc-without-output", "posthoc_ema", ["snapshots", "--sigma_rel=0.07"], "give --output DIR"),
    ("57:posthoc-output-a-file", "posthoc_ema", ["snapshots", "--sigma_rel=0.07", "--output=afile.txt"],
     "--output afile.txt is a file"),
    ("57:posthoc-of-a-run-without-snapshots", "posthoc_ema", ["run", "--sigma_rel=0.07", "--output=out"],
     "run holds no post-hoc EMA snapshots (ema_snapshots/snapshot_*.pkl): train with --ema_profiles 0.05,0.10"),
    ("57:posthoc-step-without-snapshot", "posthoc_ema", ["snapshots", "--sigma_rel=0.07", "--output=out", "--step=3"],
     "--step 3 has no snapshot in snapshots; its 1 snapshots are at steps 4 to 4: give one of those"),
    ("57:posthoc-step-zero", "posthoc_ema", ["snapshots", "--sigma_rel=0.07", "--output=out", "--step=0"],
     "--step must be >= 1"),
    ("data-workers-negative", "train", [*TRAIN, "--data_workers=-1"], "--data_workers must be >= 0 and <= 64, got -1"),
    ("47:folder-of-a-size-without-recipe", "train", ["--dataset=folder", "--data_path=images", "--image_size=48"],
     "no recipe for 48x48 without a --flagfile"),
    # train
    ("17:resume-other-recipe", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume", "--model_channels=64"],
     "was trained with different model_channels (--model_channels=32); use those flags, the run's flags.cfg"),
    ("17:lr-nan", "train", [*TRAIN, "--logdir=new", "--lr=nan"], "--lr must be a finite number, got nan"),
    ("17:lr-inf", "train", [*TRAIN, "--logdir=new", "--lr=inf"], "--lr must be a finite number, got inf"),
    ("lr-overflow", "train", [*TRAIN, "--logdir=new", "--lr=1e400"], "--lr must be a finite number, got inf"),
    ("ema-warmup-not-boolean", "train", [*TRAIN, "--logdir=new", "--ema_warmup=often"],
     "flag --ema_warmup=often: ('Non-boolean argument to boolean flag', 'often')"),
    ("17:grad-clip-nan", "train", [*TRAIN, "--logdir=new", "--grad_clip=nan"], "--grad_clip must be a finite number"),
    ("17:logdir-proc", "train", [*TRAIN, "--logdir=/proc/x"], "--logdir /proc/x cannot be written"),
    ("17:logdir-file", "train", [*TRAIN, "--logdir=afile.txt"], "--logdir afile.txt is a file"),
    ("logdir-under-file", "train", [*TRAIN, "--logdir=afile.txt/sub"], "afile.txt is a file"),
    ("17:missing-flagfile", "train", ["--flagfile=nope.cfg"],
     "error: cannot open flagfile nope.cfg: No such file or directory"),
    ("init-from-missing", "train", [*TRAIN, "--logdir=new", "--init_from=nope.pkl"], "no checkpoint file at nope.pkl"),
    ("init-from-crafted", "train", [*TRAIN, "--logdir=new", "--init_from=evil.pkl"], "refusing to load builtins.exec"),
    ("init-from-other-network", "train", [*TRAIN, "--logdir=new", "--init_from=run", "--model_channels=64"],
     "holds a network with different model_channels (--model_channels=32); set those flags"),
    ("logdir-empty", "train", [*TRAIN, "--logdir="], "--logdir is empty; give a path"),
    ("logdir-with-checkpoints", "train", [*TRAIN, "--logdir=run"], "already holds checkpoints; pass --resume"),
    ("logdir-of-other-files", "train", [*TRAIN, "--logdir=notours"], "notours holds files that megdiffusion did not"),
    ("unknown-dataset", "train", [*TRAIN, "--dataset=imagenet"], "--dataset=imagenet: value should be one of"),
    ("missing-data", "train", [*TRAIN, "--data_path=nope.npz"], "data path nope.npz does not exist"),
    ("npz-without-images", "train", [*TRAIN, "--data_path=mu_only.npz"], "has no 'arr_0' array (expected uint8 NHWC"
     " images; it holds: mu)"),
    ("npy-named-npz", "train", [*TRAIN, "--data_path=array.npz"], "holds a single .npy array, not an npz archive"),
    ("damaged-npz", "train", [*TRAIN, "--data_path=broken.npz"], "cannot read broken.npz as an npz archive"),
    ("streamed-folder-smaller-than-the-batch", "train", [*TRAIN, "--dataset=folder", "--data_path=images",
                                                         "--image_size=8"], "the dataset has 3 images, fewer than"),
    ("empty-folder", "train", [*TRAIN, "--dataset=folder", "--data_path=empty", "--image_size=8"], "no images"),
    ("crafted-cifar-batch", "train", [*TRAIN, "--dataset=cifar10", "--data_path=cifar_evil"],
     "refusing to load __builtin__.exec"),
    ("batch-not-a-number", "train", [*TRAIN, "--batch_size=abc"], "--batch_size=abc"),
    ("batch-zero", "train", [*TRAIN, "--batch_size=0"], "--batch_size must be >= 1 and <= 1048576, got 0"),
    ("microbatch-not-a-divisor", "train", [*TRAIN, "--logdir=new", "--microbatch=3"],
     "--microbatch 3 does not divide the per-device batch of 8 (--batch_size 8 over 1 processes); choose a divisor"),
    ("microbatch-negative", "train", [*TRAIN, "--logdir=new", "--microbatch=-1"], "--microbatch must be >= 0"),
    ("trace-with-dropout", "train", [*TRAIN, "--logdir=new", "--trace", "--dropout=0.1"],
     "--trace needs --dropout 0 (got 0.1)"),
    ("dropout-one", "train", [*TRAIN, "--dropout=1"], "--dropout must be >= 0 and < 1, got 1"),
    ("negative-time-limit", "train", [*TRAIN, "--time_limit_minutes=-1"], "--time_limit_minutes must be >= 0"),
    ("channel-mult-letters", "train", [*TRAIN, "--channel_mult=a,b"], "needs comma-separated integers"),
    ("attention-never-occurs", "train", [*TRAIN, "--attention_resolutions=16"], "never occur"),
    ("norm-groups-misfit", "train", [*TRAIN, "--norm_groups=5"], "bad model flags"),
    ("sample-steps-over-T", "train", [*TRAIN, "--sample_every=1", "--sample_steps=41"], "--sample_steps"),
    ("grid-order-the-solver-lacks", "train", [*TRAIN, "--sample_every=1", "--sample_sampler=dpmpp_3m",
                                              "--sample_order=2"], "dpmpp_3m has order 3, not 2"),
    ("batch-over-dataset", "train", [*TRAIN, "--batch_size=32"], "fewer than --batch_size 32"),
    ("two-gpus", "train", [*TRAIN, "--logdir=new", "--num_gpus=2"], "--num_gpus 2 needs CUDA GPUs"),
    ("positional", "train", [*TRAIN, "extra"], "unexpected arguments ['extra']"),
    ("hybrid-without-learned-variance", "train", [*TRAIN, "--loss_type=hybrid"],
     "bad diffusion flags: loss_type 'hybrid' weights the vb term that trains a learned variance"),
    ("unknown-loss-type", "train", [*TRAIN, "--loss_type=kl"], "--loss_type=kl: value should be one of <mse|hybrid>"),
    ("negative-min-snr-gamma", "train", [*TRAIN, "--min_snr_gamma=-1"], "--min_snr_gamma"),
    ("negative-input-perturbation", "train", [*TRAIN, "--input_perturbation=-0.1"], "--input_perturbation"),
    ("input-perturbation-with-xprev", "train", [*TRAIN, "--mean_type=xprev", "--input_perturbation=0.1"],
     "--input_perturbation needs --mean_type eps, xstart or v"),
    ("min-snr-with-xprev", "train", [*TRAIN, "--mean_type=xprev", "--min_snr_gamma=5"],
     "bad diffusion flags: min_snr_gamma must be 0 (off) or positive with mean_type eps, xstart or v"),
    ("classes-without-labels", "train", [*TRAIN, "--num_classes=10"],
     "--data_path data.npz has no class labels: a class-conditional run (--num_classes) on an npz needs them under"),
    ("class-label-outside", "train", [*TRAIN, "--data_path=labels_to_11.npz", "--num_classes=10"],
     "class label 10 is outside 0..9; set --num_classes to the number of classes (the labels go up to 11)"),
    ("class-labels-miscounted", "train", [*TRAIN, "--data_path=three_labels.npz", "--num_classes=10"],
     "the dataset has 16 images but 3 class labels"),
    ("classes-of-a-folder", "train", [*TRAIN, "--dataset=folder", "--data_path=images", "--image_size=8",
                                      "--batch_size=2", "--num_classes=2"],
     "a folder's class labels are its first-level subfolders, but images/0.png (and 2 more) lie in images itself"),
    ("negative-num-classes", "train", [*TRAIN, "--num_classes=-1"], "--num_classes must be >= 0 and <= 100000, got -1"),
    ("class-dropout-without-classes", "train", [*TRAIN, "--class_dropout=0.1"],
     "--class_dropout drops class labels: it needs a class-conditional run (--num_classes)"),
    ("class-dropout-of-one", "train", [*TRAIN, "--class_dropout=1"], "--class_dropout must be"),
    ("heads-do-not-divide", "train", [*TRAIN, "--num_heads=3"],
     "attention over 32 channels cannot be split into heads with num_heads=3"),
    ("head-channels-do-not-divide", "train", [*TRAIN, "--num_head_channels=12"], "with num_head_channels=12"),
    ("heads-zero", "train", [*TRAIN, "--num_heads=0"], "--num_heads must be >= 1 and <= 1024, got 0"),
    ("scale-shift-not-a-bool", "train", [*TRAIN, "--use_scale_shift_norm=maybe"], "Non-boolean argument"),
    ("resume-with-a-learned-variance", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume",
                                                 "--var_type=learned_range", "--loss_type=hybrid"],
     "was trained with different var_type, loss_type (--var_type=fixedlarge --loss_type=mse)"),
    ("init-a-learned-variance-from-a-fixed-one", "train", [*TRAIN, "--logdir=new", "--init_from=run",
                                                           "--var_type=learned_range"],
     "holds a network with different var_type (--var_type=fixedlarge); set those flags"),
    ("39:resume-with-another-init-from", "train", ["--flagfile=run/flags.cfg", "--logdir=run", "--resume",
                                                   "--init_from=mismatch.pkl"],
     "--resume continues the run in run, which started from scratch, and --init_from mismatch.pkl would start "
     "another"),
    ("39:resume-of-a-corrupt-checkpoint-only", "train", ["--flagfile=corrupt_run/flags.cfg", "--logdir=corrupt_run",
                                                         "--resume"],
     "none of the 1 checkpoints in corrupt_run/checkpoints loads (the newest: cannot read checkpoint "
     "corrupt_run/checkpoints/ckpt_0000002.pkl"),
    ("39:negative-labels", "train", [*TRAIN, "--data_path=negative_labels.npz", "--num_classes=3"],
     "class label -1 is negative; the labels of a class-conditional run are 0..2: number the dataset's classes"),
    ("36:unknown-fid-metric", "train", [*TRAIN, "--fid_every=1", "--fid_metrics=kid,is"],
     "unknown metric 'is' in --fid_metrics 'kid,is'; choose from fid, kid, pr or all"),
    ("36:precision-recall-of-two-samples", "train", [*TRAIN, "--fid_every=1", "--fid_metrics=pr",
                                                     "--fid_num_images=2"],
     "precision/recall need at least 4 images in each set"),
    ("39:seed-over-64-bits", "train", [*TRAIN, "--seed=18446744073709551616"],
     "--seed must be >= 0 and <= 18446744073709551615, got 18446744073709551616"),
    ("39:run-with-profiling", "train", [*TRAIN, "--run_with_profiling"],
     "--run_with_profiling is absl's debugging flag, which megdiffusion does not support; run python -m cProfile"),
    ("39:profile-file", "train", [*TRAIN, "--profile_file=prof.out"], "--profile_file is absl's debugging flag"),
    ("39:logdir-dangling-symlink", "train", [*TRAIN, "--logdir=dangling"],
     "dangling is a symbolic link to nowhere, which does not exist; create that or choose another --logdir"),
    # sample
    ("17:eta-negative", "sample", [*SAMPLE, "--eta=-1"], "eta must be a finite number >= 0"),
    ("17:eta-nan", "sample", [*SAMPLE, "--eta=nan"], "--eta must be a finite number, got nan"),
    ("17:output-proc", "sample", [*SAMPLE, "--output=/proc/x"], "--output /proc/x cannot be written"),
    ("17:output-under-file", "sample", [*SAMPLE, "--output=afile.txt/sub"], "afile.txt is a file"),
    ("17:truncated-image", "sample", [*SAMPLE, "--ckpt={shared}/run", "--output={shared}/samples_truncated"],
     "cannot read image {shared}/samples_truncated/000001.png"),
    ("17:config-does-not-fit-weights", "sample", [*SAMPLE, "--ckpt=mismatch.pkl"],
     "mismatch.pkl: its weights do not fit the network of its config"),
    ("17:invalid-stored-config", "sample", [*SAMPLE, "--ckpt=bad_config.pkl"],
     "bad_config.pkl holds an unusable training config: --image_size must be >= 1 and <= 4096, got -4"),
    ("nan-stored-config", "sample", [*SAMPLE, "--ckpt=nan_config.pkl"], "--lr must be a finite number, got nan"),
    ("17:crafted-checkpoint", "sample", [*SAMPLE, "--ckpt=evil.pkl"], "refusing to load builtins.exec"),
    ("weights-of-text", "sample", [*SAMPLE, "--ckpt=text_weights.pkl"], "is str, the network's float32"),
    ("not-a-checkpoint", "sample", [*SAMPLE, "--ckpt=a_list.pkl"], "is not a megdiffusion training checkpoint"),
    ("garbage-checkpoint", "sample", [*SAMPLE, "--ckpt=garbage.pkl"], "cannot read checkpoint garbage.pkl"),
    ("missing-checkpoint", "sample", [*SAMPLE, "--ckpt=nope.pkl"], "no checkpoint file at nope.pkl"),
    ("logdir-without-checkpoints", "sample", [*SAMPLE, "--ckpt=empty"], "no checkpoints in empty"),
    ("output-file", "sample", [*SAMPLE, "--output=afile.txt"], "--output afile.txt is a file"),
    ("output-of-other-files", "sample", [*SAMPLE, "--output=notours"], "holds files that megdiffusion did not write"),
    ("output-of-other-settings", "sample", [*SAMPLE, "--ckpt={shared}/run", "--output={shared}/samples",
                                            "--seed=1"],
     "holds images made with other settings (seed: 0 -> 1)"),
    ("manifest-not-a-dict", "sample", [*SAMPLE, "--output=manifest_list"], "manifest.json is unreadable"),
    ("unknown-sampler", "sample", [*SAMPLE, "--sampler=euler_a"], "--sampler=euler_a: value should be one of"),
    ("unknown-spacing", "sample", [*SAMPLE, "--sampler=unipc", "--spacing=uniform"],
     "--spacing=uniform: value should be one of <leading|linspace|trailing|karras|logsnr>"),
    ("order-the-solver-lacks", "sample", [*SAMPLE, "--sampler=unipc", "--order=4"], "unipc has order 2 or 3, not 4"),
    ("order-of-a-named-solver", "sample", [*SAMPLE, "--sampler=dpmpp_2m", "--order=3"], "dpmpp_2m has order 2, not 3"),
    ("order-for-ddim", "sample", [*SAMPLE, "--order=2"], "--order is for the multistep solvers"),
    ("eta-with-a-solver", "sample", [*SAMPLE, "--sampler=heun", "--eta=0.5"], "only used by the ddim sampler"),
    ("steps-below-the-order", "sample", [*SAMPLE, "--sampler=dpmpp_3m", "--steps=2"],
     "dpmpp_3m with --spacing karras needs --steps >= 3, got 2"),
    ("karras-one-step", "sample", [*SAMPLE, "--sampler=euler", "--steps=1", "--spacing=karras"],
     "euler with --spacing karras needs --steps >= 2, got 1"),
    ("karras-for-ddim", "sample", [*SAMPLE, "--spacing=karras"], "ddim steps between timesteps: --spacing must be one"),
    ("respacing-for-a-solver", "sample", [*RESPACED, "--sampler=unipc", "--respacing=ddim10"],
     "--respacing is for ddpm and ddim; unipc takes --steps and --spacing"),
    ("spacing-and-respacing", "sample", [*RESPACED, "--respacing=4", "--spacing=trailing"],
     "give --spacing or --respacing, not both"),
    ("trailing-steps-over-T", "sample", [*SAMPLE, "--steps=41", "--spacing=trailing"], "between 1 and T=40"),
    ("steps-over-T", "sample", [*SAMPLE, "--steps=41"], "between 1 and T=40"),
    ("eta-with-ddpm", "sample", [*SAMPLE, "--sampler=ddpm", "--eta=0.5"], "only used by the ddim sampler"),
    ("zero-images", "sample", [*SAMPLE, "--num_images=0"], "--num_images must be >= 1"),
    ("no-ckpt", "sample", ["--output=out"], "--ckpt and --output are required"),
    ("two-gpus", "sample", [*SAMPLE, "--num_gpus=2"], "--num_gpus 2 needs CUDA GPUs"),
    ("positional", "sample", [*SAMPLE, "extra"], "unexpected arguments"),
    ("respacing-garbage", "sample", [*RESPACED, "--respacing=abc"], "respacing must be 'N', 'a,b,c'"),
    ("respacing-over-T", "sample", [*RESPACED, "--respacing=50"], "a section of 40 of T=40 steps cannot keep 50"),
    ("steps-and-respacing", "sample", [*SAMPLE, "--respacing=4"], "give steps or respacing, not both"),
    ("guidance-without-guide", "sample", [*SAMPLE, "--guidance=2"], "--guidance 2 needs --guide_ckpt, the weaker"),
    ("guide-without-guidance", "sample", [*SAMPLE, "--guide_ckpt=run"], "--guide_ckpt needs --guidance above 1"),
    ("guidance-below-one", "sample", [*SAMPLE, "--guide_ckpt=run", "--guidance=0.5"],
     "--guidance must be >= 1 and <= 100, got 0.5"),
    ("guide-of-another-recipe", "sample", [*SAMPLE, "--guide_ckpt=cosine.pkl", "--guidance=2"],
     "--guide_ckpt cosine.pkl was trained with different beta_schedule (--beta_schedule=cosine) than the sampled"),
    ("guide-missing", "sample", [*SAMPLE, "--guide_ckpt=nope.pkl", "--guidance=2"], "no checkpoint file at nope.pkl"),
    ("unconditional-guide", "sample", [*SAMPLE, "--ckpt=conditional", "--guide_ckpt=run", "--guidance=2"],
     "--guide_ckpt run was trained with different num_classes (--num_classes=0) than the sampled model"),
    ("unconditional-guide-without-guide", "sample", [*SAMPLE, "--ckpt=conditional", "--guide_unconditional"],
     "--guide_unconditional needs --guide_ckpt (the sampled checkpoint itself for classifier-free guidance)"),
    ("unconditional-guide-never-trained-so", "sample", [*SAMPLE, "--ckpt=conditional", "--guide_ckpt=conditional",
                                                        "--guidance=2", "--guide_unconditional"],
     "--guide_unconditional: conditional was trained without --class_dropout, so it never learnt to predict without"),
    ("class-of-an-unconditional-model", "sample", [*SAMPLE, "--class_label=1"],
     "--class_label: class 1 asked of an unconditional model (trained without --num_classes)"),
    ("class-outside", "sample", [*SAMPLE, "--ckpt=conditional", "--class_label=3"],
     "--class_label: class 3 is outside the model's classes 0..2"),
    ("output-of-unguided-images", "sample", [*SAMPLE, "--ckpt={shared}/run", "--output={shared}/samples",
                                             "--guide_ckpt={shared}/run", "--guidance=2"],
     "holds images made with other settings (guidance: 1.0 -> 2.0, guide_checkpoint: None -> "),
    ("39:seed-negative", "sample", [*SAMPLE, "--seed=-1"], "--seed must be >= 0 and <= 18446744073709551615, got -1"),
    ("39:images-beyond-any-machine", "sample", [*SAMPLE, "--num_images=99999999999999999999"],
     "--num_images must be >= 1 and <= 4294967296, got 99999999999999999999"),
    ("39:batch-zero", "sample", [*SAMPLE, "--batch_size=0"], "--batch_size must be >= 1 and <= 1048576, got 0"),
    ("39:gpus-zero", "sample", [*SAMPLE, "--num_gpus=0"], "--num_gpus must be >= 1 and <= 1024, got 0"),
    ("39:run-with-profiling", "sample", [*SAMPLE, "--run_with_profiling", "--profile_file=prof.out"],
     "is absl's debugging flag, which megdiffusion does not support; run python -m cProfile -o FILE"),
    ("39:run-with-pdb", "sample", [*SAMPLE, "--run_with_pdb"],
     "--run_with_pdb is absl's debugging flag, which megdiffusion does not support; run python -m pdb"),
    ("39:npz-as-checkpoint", "sample", [*SAMPLE, "--ckpt=data.npz"],
     "data.npz is not a torch archive (expected one */data.pkl)"),
    ("39:path-with-a-newline", "sample", [*SAMPLE, "--ckpt=a\nb.pkl"], "no checkpoint file at a\\nb.pkl"),
    ("39:output-dangling-symlink", "sample", [*SAMPLE, "--output=dangling"],
     "dangling is a symbolic link to nowhere, which does not exist; create that or choose another --output"),
    ("39:output-under-dangling-symlink", "sample", [*SAMPLE, "--output=dangling/sub"],
     "--output dangling/sub cannot be made"),
    ("39:respacing-ddim0", "sample", [*RESPACED, "--respacing=ddim0"], "or 'ddimN', got 'ddim0'"),
    ("39:respacing-ddim-of-sections", "sample", [*RESPACED, "--respacing=ddim4,4"], "or 'ddimN', got 'ddim4,4'"),
    # fid
    ("17:stats-out-proc", "fid", ["--save_stats", "images", "/proc/s.npz"], "OUT.npz /proc/s.npz cannot be written"),
    ("stats-out-under-file", "fid", ["--save_stats", "images", "afile.txt/s.npz"], "afile.txt is a file"),
    ("stats-out-directory", "fid", ["--save_stats", "images", "folder.npz"], "OUT.npz folder.npz is a directory"),
    ("stats-out-not-npz", "fid", ["--save_stats", "images", "out.txt"], "must end in .npz"),
    ("17:mu-without-sigma", "fid", ["mu_only.npz", "fashion_mnist"], "mu_only.npz has no 'sigma' array (it holds: mu)"),
    ("npy-named-npz", "fid", ["array.npz", "fashion_mnist"], "holds a single .npy array"),
    ("damaged-npz", "fid", ["broken.npz", "fashion_mnist"], "cannot read broken.npz as an npz archive"),
    ("missing-source", "fid", ["nope", "fashion_mnist"], "'nope' does not exist; give a folder of images"),
    ("empty-folder", "fid", ["empty", "fashion_mnist"], "no images"),
    ("fid-of-an-lmdb", "fid", ["lsun", "fashion_mnist"], "lsun is an LMDB, which only scripts.prepare reads"),
    ("three-paths", "fid", ["a", "b", "c"], "expected two arguments, GENERATED REAL; got 3"),
    ("one-image", "fid", ["--num_images=1", "images", "images"], "--num_images >= 2"),
    ("batch-zero", "fid", ["--batch_size=0", "images", "images"], "--batch_size must be >= 1"),
    ("ckpt-without-count", "fid", ["--ckpt=run", "images"], "--ckpt needs --num_images"),
    ("crafted-checkpoint", "fid", ["--ckpt=evil.pkl", "--num_images=2", "images"], "refusing to load builtins.exec"),
    ("eta-inf", "fid", ["--ckpt=run", "--num_images=2", "--eta=inf", "images"], "--eta must be a finite number"),
    ("respacing-garbage", "fid", ["--ckpt=run", "--num_images=2", "--respacing=ddimx", "images"],
     "respacing must be"),
    ("guidance-nan", "fid", ["--ckpt=run", "--num_images=2", "--guide_ckpt=run", "--guidance=nan", "images"],
     "--guidance must be a finite number, got nan"),
    ("guide-of-another-recipe", "fid", ["--ckpt=run", "--num_images=2", "--steps=2", "--guide_ckpt=cosine.pkl",
                                        "--guidance=2", "images"], "was trained with different beta_schedule"),
    ("39:seed-negative", "fid", ["--ckpt=run", "--num_images=2", "--steps=2", "--seed=-1", "images"],
     "--seed must be >= 0 and <= 18446744073709551615, got -1"),
    ("39:statistics-of-10-dimensions", "fid", ["stats_10.npz", "stats_10.npz"],
     "stats_10.npz holds mu float64 (10,) and sigma float64 (10, 10); FID statistics are those of the 2048 "
     "Inception pool3 features"),
    # Run after an Inception pass, this case would write the converted weights into HOME, and so fail.
    ("39:statistics-checked-before-the-images", "fid", ["images", "stats_10.npz"], "stats_10.npz holds mu"),
    ("39:reference-checked-before-sampling", "fid", ["--ckpt=run", "--num_images=2", "--steps=2", "stats_10.npz"],
     "stats_10.npz holds mu"),
    ("39:save-stats-over-a-file", "fid", ["--save_stats", "images", "stats_10.npz"],
     "OUT.npz stats_10.npz exists; give a new path, or --overwrite to replace it"),
    ("39:five-d-images", "fid", ["--num_images=2", "five_d.npz", "images"], "five_d.npz: arr_0 must be uint8 NHWC"),
    ("39:float-images", "fid", ["--num_images=2", "float_images.npz", "images"],
     "float_images.npz: arr_0 must be uint8 NHWC"),
    ("39:cifar10-without-directory", "fid", ["cifar10:", "images"], "'cifar10:' names no directory: write cifar10:DIR"),
    ("39:images-beyond-any-machine", "fid", ["--num_images=99999999999999999999", "images", "images"],
     "--num_images must be >= 1 and <= 4294967296"),
    ("39:run-with-profiling", "fid", ["--run_with_profiling", "images", "images"], "is absl's debugging flag"),
    ("39:one-sample", "fid", ["--ckpt=run", "--num_images=1", "--steps=2", "images"], "FID needs --num_images >= 2"),
    ("36:unknown-metric", "fid", ["--metrics=fid,kd", "images", "images"],
     "unknown metric 'kd' in --metrics 'fid,kd'; choose from fid, kid, pr or all"),
    ("36:kid-of-one-image", "fid", ["--metrics=kid", "one_feature.npz", "images"],
     "KID needs at least 2 images in each set, got 1 generated and 3 real"),
    ("36:kid-subset-above-the-set", "fid", ["--metrics=kid", "--kid_subset_size=4", "images", "images"],
     "the KID subset size (--kid_subset_size) must be between 2 and the smaller set's 3 images (3 generated, 3 real)"),
    ("36:kid-subset-of-one", "fid", ["--metrics=kid", "--kid_subset_size=1", "images", "images"],
     "--kid_subset_size must be >= 2, got 1"),
    ("36:kid-no-subsets", "fid", ["--metrics=kid", "--kid_subsets=0", "images", "images"],
     "--kid_subsets must be >= 1 and <= 10000, got 0"),
    ("36:precision-recall-of-three-images", "fid", ["--metrics=pr", "images", "images"],
     "precision/recall need at least 4 images in each set (k=3 nearest neighbours), got 3 generated and 3 real"),
    ("36:precision-recall-of-three-samples", "fid", ["--ckpt=run", "--num_images=3", "--steps=2", "--metrics=all",
                                                     "data.npz"], "precision/recall need at least 4 images"),
    ("36:statistics-without-features", "fid", ["--metrics=fid,pr", "images", "stats_plain.npz"],
     "stats_plain.npz holds only mu and sigma; KID and precision/recall need the features: make it with --save_stats "
     "--save_features"),
    ("36:reference-without-features", "fid", ["--ckpt=run", "--num_images=4", "--steps=2", "--metrics=kid",
                                              "stats_plain.npz"], "stats_plain.npz holds only mu and sigma"),
    ("36:features-without-save-stats", "fid", ["--save_features", "images", "images"],
     "--save_features keeps the features in the file --save_stats writes; add --save_stats"),
    # nll
    ("order-the-solver-lacks", "fid", ["--ckpt=run", "--num_images=2", "--sampler=unipc", "--order=1", "images"],
     "unipc has order 2 or 3, not 1"),
    ("no-sampler-in-nll", "nll", ["--ckpt=run", "--sampler=unipc", "data.npz"], "Unknown command line flag 'sampler'"),
    ("no-ckpt", "nll", ["data.npz"], "--ckpt is required"),
    ("two-paths", "nll", ["--ckpt=run", "data.npz", "images"], "expected one argument, the images PATH; got 2"),
    ("images-of-another-shape", "nll", ["--ckpt=run", "images"],
     "image 0 of images is 8x8x3 (HxWxC); the model takes 8x8x1"),
    ("too-many-images", "nll", ["--ckpt=run", "--num_images=20", "data.npz"],
     "data.npz has 16 images, fewer than --num_images=20"),
    ("respacing-over-T", "nll", ["--ckpt=run", "--respacing=50", "data.npz"], "cannot keep 50"),
    ("class-conditional", "nll", ["--ckpt=conditional", "data.npz"],
     "conditional is class-conditional (trained with --num_classes 3); the bound needs each image's class"),
    ("crafted-checkpoint", "nll", ["--ckpt=evil.pkl", "data.npz"], "refusing to load builtins.exec"),
    ("batch-zero", "nll", ["--ckpt=run", "--batch_size=0", "data.npz"],
     "--batch_size must be >= 1 and <= 1048576, got 0"),
    ("39:seed-negative", "nll", ["--ckpt=run", "--seed=-1", "data.npz"], "--seed must be >= 0"),
    ("39:cifar10-without-directory", "nll", ["--ckpt=run", "cifar10"], "'cifar10' names no directory"),
    # convert
    ("two-paths-needed", "convert", ["run"], "expected two arguments, SRC OUT; got 1"),
    ("missing-source", "convert", ["nope.pt", "out.pkl"], "no file or directory nope.pt"),
    ("crafted-source", "convert", ["evil.pkl", "out.pkl"], "refusing to load builtins.exec"),
    ("out-exists", "convert", ["run", "afile.txt"], "afile.txt exists; give a new path"),
    ("out-proc", "convert", ["run", "/proc/x.pkl"], "OUT /proc/x.pkl cannot be written"),
    ("out-under-file", "convert", ["run", "afile.txt/x.pkl"], "afile.txt is a file"),
    ("iddpm-without-image-size", "convert", [*IDDPM, "--num_heads=2"],
     "unet_small.pt does not record its image_size and is not a published network"),
    ("iddpm-without-heads", "convert", [*IDDPM, "--image_size=16"],
     "unet_small.pt does not record its num_heads and is not a published network"),
    ("iddpm-heads-do-not-divide", "convert", [*IDDPM, "--image_size=16", "--num_heads=3"],
     "cannot be split into heads with num_heads=3"),
    ("iddpm-other-norm-groups", "convert", [*IDDPM, "--image_size=16", "--num_heads=2", "--norm_groups=8"],
     "--norm_groups=8, but unet_small.pt states 32"),
    ("iddpm-one-timestep", "convert", [*IDDPM, "--image_size=16", "--num_heads=2", "--num_timesteps=1"],
     "--num_timesteps must be >= 2 and <= 100000, got 1"),
    ("iddpm-named-pesser", "convert", [*IDDPM, "--format=pesser"],
     "unet_small.pt is in the improved_diffusion format, not pesser"),
    ("39:a-megdiffusion-checkpoint", "convert", ["run/checkpoints/ckpt_0000002.pkl", "out.pkl"],
     "ckpt_0000002.pkl is a megdiffusion checkpoint: it needs no conversion; give it as it is to "
     "megdiffusion.scripts.sample, fid or nll (--ckpt)"),
    ("39:a-megdiffusion-logdir", "convert", ["run", "out.pkl"],
     "run holds megdiffusion checkpoints, which need no conversion; give it as it is to megdiffusion"),
    ("39:a-weights-only-checkpoint", "convert", ["mismatch.pkl", "out.pkl"], "is a megdiffusion checkpoint"),
    ("39:safetensors-header-too-long", "convert", ["huge_header.safetensors", "out.pkl"],
     "huge_header.safetensors: its safetensors header length, 4611686018427387904, is more than the file's"),
    ("39:image-size-zero", "convert", [*IDDPM, "--image_size=0", "--num_heads=2"],
     "--image_size must be >= 1 and <= 4096, got 0"),
    # demo
    ("17:minutes-nan", "demo", [*DEMO, "--minutes=nan"], "--minutes must be a finite number, got nan"),
    ("minutes-zero", "demo", [*DEMO, "--minutes=0"], "--minutes must be > 0"),
    ("images-zero", "demo", ["--output=out", "--images=0", "--num_images=2", "--num_reference=2"],
     "--images must be >= 1 and <= 4294967296, got 0"),
    ("missing-config", "demo", [*DEMO, "--config=nope.cfg"], "cannot open flagfile nope.cfg"),
    ("steps-over-T", "demo", [*DEMO, "--steps=1001"], "between 1 and T=1000"),
    ("order-the-solver-lacks", "demo", [*DEMO, "--sampler=unipc", "--order=5"], "unipc has order 2 or 3, not 5"),
    ("output-of-other-files", "demo", [*DEMO, "--output=notours"], "holds files that megdiffusion did not write"),
    ("output-file", "demo", [*DEMO, "--output=afile.txt"], "--output afile.txt is a file"),
    ("output-proc", "demo", [*DEMO, "--output=/proc/x"], "--output /proc/x cannot be written"),
    ("output-empty", "demo", [*DEMO, "--output="], "--output is empty; give a path"),
    ("guidance-below-one", "demo", [*DEMO, "--guidance=0.5"], "--guidance must be >= 1 and <= 100, got 0.5"),
    ("positional", "demo", [*DEMO, "extra"], "unexpected arguments"),
    ("39:batch-zero", "demo", [*DEMO, "--batch_size=0"], "--batch_size must be >= 1 and <= 1048576, got 0"),
    ("39:one-reference-image", "demo", [*DEMO, "--num_reference=1"], "--num_reference must be >= 2"),
    ("39:one-sample", "demo", [*DEMO, "--num_images=1"], "--num_images and --num_reference must be at least 4 "
     "(precision/recall's k=3 nearest neighbours), got 1 and 4"),
    ("36:three-reference-images", "demo", [*DEMO, "--num_reference=3"], "must be at least 4"),
    ("39:output-dangling-symlink", "demo", [*DEMO, "--output=dangling"], "dangling is a symbolic link to nowhere"),
]


def tree(root):
    """Every file, directory and symbolic link under ``root`` (``root`` too): relative path -> (inode, size, mtime,
    ctime; for a directory its mtime, which a file made and removed in it changes; for a link its target). A file's
    ctime changes with any write to it, even one that keeps its size and sets its mtime back, and no process can set
    it; an atomic replacement is a new inode."""
    found = {}
    for path in [Path(root), *sorted(Path(root).rglob("*"))]:
        status = path.lstat()
        found[str(path.relative_to(root))] = (
            os.readlink(path) if path.is_symlink() else ("dir", status.st_mtime_ns) if path.is_dir() else
            ("fifo", status.st_mtime_ns) if path.is_fifo() else
            (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns))
    return found


@pytest.fixture(scope="session")
def command_flags():
    """Each command's flags and their defaults (as text), read from the command's own module."""
    code = ("import json, sys, importlib; from absl import flags; importlib.import_module(f'megdiffusion.scripts.{s}')"
            "; print(json.dumps({n: str(flags.FLAGS[n].default) for n in flags.FLAGS}))")
    found = {}
    for script in sorted({case[1] for case in CASES} | {"train", "prepare"}):
        result = subprocess.run([sys.executable, "-c", f"s = {script!r}; {code}"], capture_output=True, text=True,
                                check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
        found[script] = json.loads(result.stdout.splitlines()[-1])
    return found


FLAG_IN_MESSAGE = re.compile(r"(?<![\w-])--([a-z][a-z0-9_]*)(?:[ =]([^\s,;:)]+))?")


# The words after which a message speaks of another command's flags: how a model was trained, a file prepared.
OTHER_COMMAND = re.compile(r"\b(?:megdiffusion\.scripts\.(\w+)|(train)(?:ed|ing)?|(prepare)d?)\b")


def check_message(line, script, args, command_flags, workdir):
    """An error line names only flags of ``script``, of the flagfiles it was given (``--flagfile``, the demo's
    ``--config``), or of the command it speaks of (after "megdiffusion.scripts.NAME", "trained", "prepare"...), and
    what it advises after its first "; " is not what was given (a flag's value given, or its default when not
    given)."""
    advice_from = line.find("; ")
    given_files = [arg.split("=", 1)[1] for arg in args if arg.startswith(("--flagfile=", "--config="))]
    in_files = {arg.lstrip("-").split("=", 1)[0] for path in given_files if (workdir / path).is_file()
                for arg in (workdir / path).read_text(errors="replace").split()}
    for match in FLAG_IN_MESSAGE.finditer(line):
        spoken = [next(g for g in groups if g) for groups in OTHER_COMMAND.findall(line[:match.start()])]
        command = spoken[-1] if spoken else script
        own = {**command_flags[script], **command_flags[command]}
        name, value = match.group(1), match.group(2)
        if name not in own and name.startswith("no") and name[2:] in own:
            name = name[2:]
        assert name in own or name in in_files or name == "flagfile", \
            f"{line!r} names --{name}, which {command} does not have"
        if name not in command_flags[script]:
            continue
        if spoken or value is None or advice_from < 0 or match.start() < advice_from:
            continue
        given = [arg.split("=", 1)[1] for arg in args if arg.startswith(f"--{name}=")]
        current = given[-1] if given else command_flags[script][name]
        assert value != current, f"{line!r} advises --{name} {value}, which is what the command had"


def shown_lines(stderr):
    """The non-blank lines a terminal shows of ``stderr``: of a line a progress bar redrew in place (carriage
    returns), what was written last."""
    return [line.rpartition("\r")[2] for line in stderr.split("\n") if line.rpartition("\r")[2].strip()]


def case_directory(shared, tmp_path):
    """A case's working directory (a copy of the shared files, named pipes and an empty HOME) and its environment."""
    workdir = tmp_path / "case"
    shutil.copytree(shared, workdir, symlinks=True, ignore=shutil.ignore_patterns("samples*"))
    (workdir / "home").mkdir()
    for name in FIFOS:  # made here: copying one would wait for a writer
        os.mkfifo(workdir / name)
    env = {**os.environ, "HOME": str(workdir / "home"), "PYTHONPATH": str(REPO)}
    env.pop("XDG_CACHE_HOME", None)
    return workdir, env


def with_shared(shared, args, message):
    """A case's arguments and message with {shared} made the shared directory."""
    return [arg.replace("{shared}", str(shared)) for arg in args], message.replace("{shared}", str(shared))


@pytest.mark.parametrize("case, script, args, message", CASES, ids=[f"{c[1]}:{c[0]}" for c in CASES])
def test_bad_input_is_one_error_line_exit_2_and_changes_no_file(shared, command_flags, tmp_path, case, script, args,
                                                                 message):
    if "gpus" in case and cuda_driver_loadable():
        pytest.skip("a machine with a CUDA driver may have 2 GPUs")
    workdir, env = case_directory(shared, tmp_path)
    before, shared_before = tree(workdir), tree(shared)
    args, message = with_shared(shared, args, message)
    result = subprocess.run([sys.executable, "-m", f"megdiffusion.scripts.{script}", *args], cwd=workdir, env=env,
                            capture_output=True, timeout=300)
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()  # carriage returns kept
    lines = shown_lines(result.stderr)
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout and "ERROR::" not in lines[0]
    for old, new in ((before, tree(workdir)), (shared_before, tree(shared))):
        changed = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
        assert not changed, f"changed, made or removed: {changed}"
    check_message(lines[0], script, args, command_flags, workdir)


# Input whose flags, data or checkpoint file is wrong is refused before MegEngine is imported (about a second of each
# command's start): a module that imports it on a command's path before its checks shows here.
BEFORE_MEGENGINE = ("train:missing-data", "train:58:train-labels-beyond-int32", "train:input-perturbation-with-xprev",
                    "train:58:resume-past-total-steps", "sample:garbage-checkpoint", "sample:17:crafted-checkpoint",
                    "sample:17:eta-negative", "sample:50:euler-leading-over-T", "sample:17:output-under-file",
                    "sample:continue-without-the-spacing", "sample:guide-missing",
                    "nll:crafted-checkpoint", "nll:respacing-over-T", "nll:class-conditional", "fid:missing-source",
                    "fid:crafted-checkpoint", "fid:respacing-garbage", "fid:guidance-nan", "demo:39:one-sample",
                    "demo:50:demo-dpmpp-leading-over-T")
REPORT_MEGENGINE = ("import atexit, runpy, sys; atexit.register(lambda: print('imported megengine:', 'megengine' in "
                    "sys.modules)); sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', "
                    "alter_sys=True)")


@pytest.mark.parametrize("name", BEFORE_MEGENGINE)
def test_input_shown_wrong_by_flags_data_or_a_checkpoint_file_is_refused_before_megengine_is_imported(shared, tmp_path,
                                                                                                      name):
    case, script, args, message = next(c for c in CASES if f"{c[1]}:{c[0]}" == name)
    workdir, env = case_directory(shared, tmp_path)
    args, message = with_shared(shared, args, message)
    result = subprocess.run([sys.executable, "-c", REPORT_MEGENGINE, f"megdiffusion.scripts.{script}", *args],
                            cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert result.stdout.split("\n")[-2] == "imported megengine: False"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_sample_ends_in_one_line_with_workers_silent(shared, tmp_path, signum):
    """Ctrl-C (to the whole process group, as a terminal sends it) or SIGTERM part-way: exit 130 or 143, one
    ``error:`` line and nothing from the worker processes, every image written whole and no temporary file left."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "out"
    # Ctrl-C's default, as a terminal's foreground command has it: a suite started in the background (``&``) hands
    # its commands SIGINT ignored, and a command keeps that, as Python and the shell's convention want.
    process = subprocess.Popen([sys.executable, "-m", "megdiffusion.scripts.sample", f"--ckpt={shared / 'run'}",
                                f"--output={out}", "--num_images=100000", "--batch_size=16", "--sampler=ddim",
                                "--steps=2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while len(list(out.glob("*.png"))) < 32 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    os.killpg(process.pid, signum)
    stdout, stderr = process.communicate(timeout=120)
    lines = shown_lines(stderr.decode())
    assert process.returncode == 128 + signum, stderr.decode()
    assert lines == [f"error: stopped by {signum.name}; every file written so far is complete"], stderr.decode()
    assert not [path for path in out.iterdir() if path.name.startswith(".")]
    for path in out.glob("*.png"):
        assert read_image(path).shape == (8, 8, 3)
