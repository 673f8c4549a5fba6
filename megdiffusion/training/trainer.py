"""Training: the state and one step (``Trainer``), and the loop around it (``TrainingRun``, one process's
``run_worker``); ``start.train`` checks, locks the logdir and launches them.

Randomness without saved generator state: a step's timesteps, noise and dropout seed are functions of (seed, step,
the samples' place in the global batch) (``draws``), the data order a function of (seed, epoch). A checkpoint
therefore only needs the step count, the loader position and the name of the draw scheme to continue bit for bit.
"""
import functools
import math
import os
import signal
import time

import numpy as np

from megdiffusion.compat import EngineFailure, is_megengine_error, megengine_error_cause, quiet_megengine
from megdiffusion.data.datasets import dataset_identity, describe_dataset, load_dataset, load_labels
from megdiffusion.data.loader import BatchLoader
from megdiffusion.errors import MegdiffusionError
from megdiffusion.files.images import save_png
from megdiffusion.training import checkpoint as ckpt
from megdiffusion.training import distributed
from megdiffusion.training import posthoc_ema
from megdiffusion.training.config import TrainConfig, build_diffusion, build_model, \
    grid_sampler, profile_sigma_rels
from megdiffusion.training.draws import PER_SAMPLE, draw_step, first_sample
from megdiffusion.training.feed import StepFeed
from megdiffusion.training.outputs import RunLogger, grid_path, sample_grid
from megdiffusion.training.engine import LossScaler, NonFiniteLossError, make_engine, pieces

mge = quiet_megengine()


def warmup_lr(cfg, step):
    """Learning rate of (0-based) step ``step``: linear from lr/warmup_steps up to lr, then constant."""
    if cfg.warmup_steps == 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)


def ema_decay_at(cfg, updates):
    """EMA decay of the update that follows ``updates`` earlier ones: ``ema_decay``, capped by (1 + n) / (10 + n)
    with ``ema_warmup``."""
    if cfg.ema_warmup:
        return min(cfg.ema_decay, (1 + updates) / (10 + updates))
    return cfg.ema_decay


def decays_at(cfg, gammas, steps):
    """The decays of the moving averages in the update of step ``steps`` (0-based): the EMA's (``ema_decay_at``),
    then each post-hoc EMA profile's of exponent in ``gammas`` (``posthoc_ema.beta``, t in images of the global
    batch)."""
    t_next = (steps + 1) * cfg.batch_size
    return [ema_decay_at(cfg, steps), *(posthoc_ema.beta(gamma, t_next, cfg.batch_size) for gamma in gammas)]


class Trainer:
    """The network, its EMA copy, the diffusion, the step count and the engine (``engine.make_engine``, chosen once:
    the CPU engine or MegEngine's), which owns the weights, the EMA and Adam's state; ``step(x0)`` does one update.

    ``model`` is the network with the current weights (made so when read); the EMA and Adam's state are handed over
    by ``state()``.
    """

    def __init__(self, config: TrainConfig, world_size=1, rank=0, engine=None):
        self.cfg = config
        self.world_size = world_size
        self.rank = rank
        self.first_index = first_sample(config.batch_size, world_size, rank)
        self.draw_scheme = PER_SAMPLE  # a resumed run takes its checkpoint's (``checkpoint.restore``)
        mge.random.seed(config.seed)  # identical initial weights for a given seed
        model = build_model(config)
        if world_size > 1:
            distributed.broadcast_from_rank0(model)
        ema = build_model(config)
        ema.load_state_dict(model.state_dict())
        ema.eval()
        self.diffusion = build_diffusion(config)
        self.engine = make_engine(config, model, ema, self.diffusion, world_size, engine)
        self.profile_gammas = [posthoc_ema.gamma_of(s) for s in profile_sigma_rels(config)]
        self.scaler = LossScaler() if config.amp else None
        self.step_count = 0
        self.recomputed_steps = 0  # steps whose gradients came out non-finite once, then finite (``step``)

    @property
    def model(self):
        return self.engine.current_model()

    def state(self):
        """A context manager: the ``engine.Modules`` (model, EMA, optimizer) holding the run's state, to read or
        change in the block (checkpoints, sampling); the engine continues from them after it."""
        return self.engine.handed_over()

    def draws(self, shape, labels=None, step=None):
        """The ``StepDraws`` of this rank's batch of ``shape`` at ``step`` (default: the next step)."""
        return draw_step(self.draw_scheme, self.cfg, self.diffusion.num_timesteps,
                         self.step_count if step is None else step, shape, labels, self.rank, self.first_index)

    def draw_function(self):
        """``draw(step, shape, labels)``: this rank's ``StepDraws`` at any step, as a picklable function (the data
        workers of ``feed.StepFeed`` draw with it)."""
        return functools.partial(draw_step, self.draw_scheme, self.cfg, self.diffusion.num_timesteps,
                                 rank=self.rank, first_index=self.first_index)

    @np.errstate(over="ignore", invalid="ignore", divide="ignore")  # a non-finite loss is one error, not warnings
    def step(self, x0, labels=None, draws=None):
        """One update on this rank's batch ``x0`` (float32 NCHW in [-1, 1]), with its class ``labels`` (int, (N,))
        for a class-conditional network (with ``class_dropout``, each is replaced by ``NO_CLASS`` with that
        probability), and the step's ``draws`` when they were made ahead (``draw_function``; default: drawn
        here): {"loss", "grad_norm", "lr"}, with ``--amp`` also "loss_scale" (the scale this step used),
        "update_skipped" (its gradients overflowed: no update) and "skipped_updates" (over the run), and after a
        step whose gradients were recomputed (non-finite once, then finite) "recomputed_steps" (over the run).

        The loss is the batch mean of ``training_losses``' ``loss``, computed in ``--microbatch`` pieces; gradients
        are averaged over ranks, clipped to ``grad_clip`` (the returned norm is the one before clipping), then Adam
        and the EMA update. Dropout's masks come from the step's ``dropout_seed``: on MegEngine's autodiff they are
        drawn in turn by the micro-batches (they depend on the cut), on the numpy pass per group of 8 samples of the
        batch (the same for any cut into multiples of 8).
        """
        draws = self.draws(x0.shape, labels) if draws is None else draws
        metrics = {"lr": warmup_lr(self.cfg, self.step_count)}
        if self.scaler is not None:
            metrics["loss_scale"] = self.scaler.scale
        gradients = self._gradients(x0, draws)
        if self._divergence(gradients) is not None:
            # Once more, from the same weights and draws: a transient fault (a GPU's, or MegEngine's CPU race) then
            # costs one step's compute; a real divergence gives the same numbers and stops.
            gradients = self._gradients(x0, draws)
            error = self._divergence(gradients)
            if error is not None:
                raise error
            self.recomputed_steps += 1
            metrics["recomputed_steps"] = self.recomputed_steps
        if self.scaler is None or self.scaler.update(np.isfinite(gradients.norm)):
            # With clipping off, an infinite bound leaves the gradients untouched (scale min(inf, 1) = 1).
            self.engine.update(gradients, metrics["lr"], self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf,
                               decays_at(self.cfg, self.profile_gammas, self.step_count))
        else:
            self.engine.discard()
        if self.scaler is not None:
            metrics.update(update_skipped=not np.isfinite(gradients.norm), skipped_updates=self.scaler.skipped)
        self.step_count += 1
        return {"loss": gradients.loss, "grad_norm": gradients.norm, **metrics}

    def _gradients(self, x0, draws):
        return self.engine.gradients(x0, draws, pieces(len(x0), self.cfg.microbatch),
                                     self.scaler.scale if self.scaler else 1.0)

    def _divergence(self, gradients):
        """The ``NonFiniteLossError`` a step with ``gradients`` stops with (its gradients already discarded), or
        None: a non-finite loss, or a non-finite norm that no ``LossScaler`` skips."""
        loss, norm = gradients
        if np.isfinite(loss) and (np.isfinite(norm) or (
                self.scaler is not None and self.scaler.scale * self.scaler.backoff_factor >= LossScaler.MIN_SCALE)):
            return None
        self.engine.discard()
        if self.scaler is None:
            return NonFiniteLossError.at(loss, norm, self.step_count)
        if not np.isfinite(loss):
            return NonFiniteLossError.at(loss, norm, self.step_count,
                                         "its float16 forward (--amp) overflowed; try without --amp")
        return NonFiniteLossError(f"gradients not finite at step {self.step_count} with the loss scale at "
                                  f"{self.scaler.scale:g}: they overflow float16 unscaled; train without --amp, or "
                                  "with a lower --lr")


class TrainingInterrupted(MegdiffusionError):
    """SIGINT or SIGTERM stopped training after a checkpoint was saved; exit code 128 + the signal number."""

    def __init__(self, signum, message):
        super().__init__(message)
        self.exit_code = 128 + signum


class TrainingRun:
    """The loop: batches -> ``Trainer.step`` -> per-step maintenance (logs, grids, checkpoints).

    Only rank 0 writes. SIGINT/SIGTERM end the loop after the current step with a checkpoint, then raise
    ``TrainingInterrupted``.
    """

    def __init__(self, cfg, images, world_size=1, rank=0, progress=True):
        self.cfg = cfg
        self.trainer = Trainer(cfg, world_size, rank)
        labels = load_labels(cfg.dataset, cfg.data_path) if cfg.num_classes else None
        self.loader = BatchLoader(images, cfg.batch_size, cfg.seed, world_size, rank, cfg.random_flip, labels)
        self.feed = None  # made when the loop starts: the draws follow a resumed run's scheme
        self.writes = rank == 0
        self.progress = progress
        self.stop_signal = None
        self.saved_step = None
        self.logger = None

    def resume(self, latest=None):
        """Continue from ``latest`` (``(state, path)``; default: the newest loadable checkpoint of the logdir),
        if there is one. Returns its path or None."""
        latest = latest or ckpt.load_latest(self.cfg.logdir)
        if latest is None:
            return None
        state, path = latest
        ckpt.restore(state, path, self.trainer, self.loader)
        self.saved_step = self.trainer.step_count
        return path

    def initialise(self):
        """Start from the weights of ``cfg.init_from`` (model and EMA; new optimizer, step 0). Returns the step
        the weights were trained to."""
        state, path = ckpt.load_init(self.cfg)
        ckpt.initialise(state, path, self.trainer)
        return state["step"]

    def save(self):
        """Checkpoint the current state (rank 0) and drop the oldest beyond ``keep_checkpoints``."""
        step = self.trainer.step_count
        if self.writes and self.saved_step != step:
            state = ckpt.snapshot(self.trainer, self.feed or self.loader,
                                  dataset_identity(self.cfg.dataset, self.cfg.data_path, len(self.loader.images)))
            ckpt.save_checkpoint(ckpt.checkpoint_path(self.cfg.logdir, step), state)
            ckpt.prune_checkpoints(self.cfg.logdir, self.cfg.keep_checkpoints)
        self.saved_step = step

    def parameter_count(self):
        """The network's number of weights."""
        return sum(int(np.prod(p.shape)) for p in self.trainer.model.parameters())

    def start_line(self):
        """What the run trains on and how, in one line."""
        cfg = self.cfg
        parameters = self.parameter_count()
        per_rank = f" ({self.loader.local_batch} per process)" if self.trainer.world_size > 1 else ""
        return (f"data: {describe_dataset(cfg.dataset, cfg.data_path, self.loader.images, cfg.num_classes)}; "
                f"model: {parameters:,} parameters; batch {cfg.batch_size}{per_rank}; steps "
                f"{self.trainer.step_count:,} of {cfg.total_steps:,}; logdir {cfg.logdir}")

    def profile_line(self):
        """The post-hoc EMA profiles a run tracks, and the disk its snapshots will take, in one line."""
        cfg, profiles = self.cfg, len(self.trainer.profile_gammas)
        line = f"post-hoc EMA: tracking sigma_rel {', '.join(f'{s:g}' for s in profile_sigma_rels(cfg))}"
        if not cfg.snapshot_every:
            return line + "; no snapshots (--snapshot_every 0), which scripts.posthoc_ema reads"
        size = self.parameter_count() * np.dtype(cfg.snapshot_dtype).itemsize * profiles
        count = cfg.total_steps // cfg.snapshot_every
        halved = "; --snapshot_dtype float16 halves it" if cfg.snapshot_dtype == "float32" else ""
        where = os.path.join(cfg.logdir, ckpt.SNAPSHOT_DIR)
        return (f"{line}; a snapshot every {cfg.snapshot_every:,} steps in {where} "
                f"holds {profiles} x {size / profiles / 2 ** 20:,.1f} MiB ({cfg.snapshot_dtype}): {count:,} snapshots, "
                f"{count * size / 2 ** 30:,.2f} GiB to --total_steps{halved}")

    def _on_signal(self, signum, frame):
        self.stop_signal = signum

    def run(self, latest=None):
        """``resume(latest)`` with --resume, then train until ``total_steps``, a signal or the time limit; save
        a final checkpoint. Returns the step; ``TrainingInterrupted`` after that checkpoint when a signal
        stopped it."""
        cfg = self.cfg
        self.deadline = time.monotonic() + 60 * cfg.time_limit_minutes if cfg.time_limit_minutes > 0 else None
        resumed_from = self.resume(latest) if cfg.resume else None
        init_step = self.initialise() if resumed_from is None and cfg.init_from else None
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        if self.writes:
            self.logger = RunLogger(cfg.logdir, cfg.total_steps, self.trainer.step_count, self.progress)
            self.logger.message(self.start_line())
            if self.trainer.profile_gammas:
                self.logger.message(self.profile_line())
            if resumed_from:
                self.logger.message(f"resumed from {resumed_from} at step {self.trainer.step_count}")
            elif init_step is not None:
                self.logger.message(f"started from the weights of {cfg.init_from} (step {init_step} of its run)")
        self.feed = StepFeed(self.loader, self.trainer.draw_function(), cfg.data_workers,
                             perturbation=bool(cfg.input_perturbation))
        try:
            self._loop()
        finally:
            self.feed.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.logger is not None:
                self.logger.close()
        if self.stop_signal is not None:
            raise TrainingInterrupted(self.stop_signal, f"stopped by {signal.Signals(self.stop_signal).name} at step "
                                      f"{self.trainer.step_count}; checkpoint saved in "
                                      f"{ckpt.checkpoint_dir(cfg.logdir)}; continue with --resume")
        return self.trainer.step_count

    def _loop(self):
        cfg = self.cfg
        while (self.trainer.step_count < cfg.total_steps and self.stop_signal is None
               and (self.deadline is None or time.monotonic() < self.deadline)):
            try:
                start = time.perf_counter()
                metrics = self.trainer.step(*self.feed.next(self.trainer.step_count))
                metrics["images_per_s"] = cfg.batch_size / (time.perf_counter() - start)
                self.maintenance(metrics)
            except NonFiniteLossError as error:
                kept = ckpt.list_checkpoints(cfg.logdir)
                restart = (f"resume from the newest checkpoint, {kept[-1]}, with --resume" if kept else
                           "no checkpoint had been written yet: train again from the start")
                raise NonFiniteLossError(f"{error}; {restart}") from None
            except RuntimeError as error:
                if not is_megengine_error(error):
                    raise
                raise EngineFailure(self._failure_message(error)) from None
        self.save()

    def _failure_message(self, error):
        """One line for a MegEngine failure: its first cause and the checkpoint a resumed run starts from."""
        step = self.trainer.step_count
        kept = ckpt.list_checkpoints(self.cfg.logdir)
        saved = f"the newest checkpoint, {kept[-1]}, is intact" if kept else "no checkpoint had been written yet"
        return f"MegEngine failed at training step {step + 1}: {megengine_error_cause(error)}; {saved}"

    def maintenance(self, metrics):
        """Per-step bookkeeping after an update: progress, metrics, sample grid, checkpoint (rank 0)."""
        cfg, step = self.cfg, self.trainer.step_count
        if self.writes:
            self.logger.advance(metrics["loss"], metrics["images_per_s"])
            if "recomputed_steps" in metrics:
                self.logger.message(f"step {step}: the gradients came out non-finite, then finite when computed "
                                    "again from the same weights and draws (a transient fault); training goes on "
                                    f"({metrics['recomputed_steps']} such steps in this run)")
            if metrics.get("update_skipped"):
                self.logger.message(f"step {step}: float16 gradients overflowed at loss scale "
                                    f"{metrics['loss_scale']:g}; update skipped, scale halved "
                                    f"({metrics['skipped_updates']} skipped in this run)")
            if step % cfg.log_every == 0 or step == cfg.total_steps:
                self.logger.write_metrics(step, metrics)
            if cfg.sample_every and (step % cfg.sample_every == 0 or step == cfg.total_steps):
                self.save_grid()
            if cfg.fid_every and (step % cfg.fid_every == 0 or step == cfg.total_steps):
                self.evaluate_fid()
            if cfg.snapshot_every and step % cfg.snapshot_every == 0:
                ckpt.save_profile_snapshot(self.trainer, cfg.logdir)
        if cfg.save_every and step % cfg.save_every == 0:
            self.save()

    def save_grid(self):
        """Sample the EMA model with the fixed grid seeds and save the PNG (and TensorBoard image)."""
        step = self.trainer.step_count
        with self.trainer.state() as state:
            grid = sample_grid(state.ema, self.trainer.diffusion, self.cfg)
        save_png(grid_path(self.cfg.logdir, step), grid)
        self.logger.add_grid(step, grid)

    def evaluate_fid(self):
        """``fid_metrics`` of ``fid_num_images`` EMA samples against the training images (their statistics, and
        features for KID and precision/recall, cached in the logdir as ``fid_reference.npz``), written to
        metrics.jsonl (``scores.compare``'s names)."""
        from megdiffusion.metrics.evaluate import model_scores, reference_statistics
        from megdiffusion.metrics.scores import needs_features, parse_metrics, score_lines

        cfg = self.cfg
        metrics = parse_metrics(cfg.fid_metrics, "--fid_metrics")
        reference = reference_statistics(self.loader.images, os.path.join(cfg.logdir, "fid_reference.npz"),
                                         keep_features=needs_features(metrics))
        with self.trainer.state() as state:
            scores, _ = model_scores(state.ema, self.trainer.diffusion, cfg.image_shape, reference,
                                     cfg.fid_num_images, cfg.seed, grid_sampler(cfg), metrics=metrics)
        self.logger.write_metrics(self.trainer.step_count, {**scores, "fid_num_images": cfg.fid_num_images})
        self.logger.message(f"step {self.trainer.step_count}: {'; '.join(score_lines(scores))} "
                            f"({cfg.fid_num_images} EMA samples)")


def run_worker(cfg, images=None, latest=None, progress=True):
    """One training process; ``images=None``, ``latest=None``: load the dataset and the checkpoint to resume
    from here (launched workers)."""
    distributed.select_device(cfg)
    rank, world_size = distributed.rank_and_world()
    if images is None:
        images = load_dataset(cfg.dataset, path=cfg.data_path, image_size=cfg.image_size)
    return TrainingRun(cfg, images, world_size, rank, progress).run(latest)
