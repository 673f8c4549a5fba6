"""megdiffusion's side of ``vs_pytorch.py``: what both sides train on, the reference outputs the PyTorch twin
(``pytorch_twin.py``) is checked against, and timed training steps and DDIM sampling of megdiffusion.

Models: ``cpu`` is the CPU recipe (configs/fashion_mnist_cpu.cfg with a batch of its real images), ``cifar``
the CIFAR-shaped model of ``train_step.py`` (``cifar_shaped``: 3x32x32, 64 channels, a random batch).
Files written into the work directory DIR: ``MODEL.json`` (the TrainConfig dict, ``legacy``: what a config
without a field stands for, the betas), ``MODEL_x0.npy`` (the batch), ``MODEL_weights.npz`` (the initial
weights of ``Trainer(cfg)``, which both sides start from), and for the check ``reference.json`` and
``MODEL_reference.npz``.

    python benchmarks/megdiffusion_side.py prepare DIR [--models cpu,cifar] [--cpu_batch N] [--cifar_batch N]
    python benchmarks/megdiffusion_side.py reference DIR [--models cpu,cifar]   # and the paper model's shapes
    python benchmarks/megdiffusion_side.py train DIR MODEL [--warmup 1] [--steps 3] [--round 0]
    python benchmarks/megdiffusion_side.py ddim DIR MODEL [--batch 16] [--sample_steps 50] [--round 0]
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import measurement  # noqa: E402
from megdiffusion.compat import quiet_megengine  # noqa: E402

mge = quiet_megengine()
from megdiffusion.cpu import native  # noqa: E402
from megdiffusion.cpu import onednn  # noqa: E402
from megdiffusion.cpu.choice import cpu_engine_enabled  # noqa: E402
from megdiffusion.diffusion import solvers  # noqa: E402
from megdiffusion.training.config import TrainConfig, build_diffusion, build_model  # noqa: E402
from megdiffusion.training.trainer import Trainer  # noqa: E402
from train_step import cifar_shaped, cpu_recipe  # noqa: E402

CIFAR_BATCH = 16  # train_step.py's default
MODELS = {"cpu": cpu_recipe, "cifar": lambda batch: cifar_shaped(batch or CIFAR_BATCH, 1)}
PAPER_PARAMS = 35_746_307  # Ho et al.'s CIFAR-10 model: megdiffusion's UNet defaults
CHECK_T = (3, 876)  # timesteps of the two images of the forward check
CHECK_DDIM_STEPS = 5


def weights_of(model):
    """{name: float32 array} of the parameters, in megdiffusion's shapes."""
    return {name: param.numpy() for name, param in model.named_parameters()}


def prepare(work_dir, models, batches):
    """``write_prepared`` for each named model (``batches``: model -> batch size, default the model's)."""
    return [write_prepared(work_dir, name, *MODELS[name](batches.get(name))) for name in models]


def write_prepared(work_dir, name, cfg, x0):
    """Write NAME.json, NAME_x0.npy and NAME_weights.npz for a config and its batch; returns a summary line."""
    os.makedirs(work_dir, exist_ok=True)
    with open(os.path.join(work_dir, f"{name}.json"), "w") as f:
        json.dump({"config": cfg.to_dict(), "legacy": TrainConfig.from_dict({}).to_dict(),
                   "betas": build_diffusion(cfg).betas.tolist()}, f)
    np.save(os.path.join(work_dir, f"{name}_x0.npy"), np.ascontiguousarray(x0, dtype=np.float32))
    np.savez(os.path.join(work_dir, f"{name}_weights.npz"), **weights_of(Trainer(cfg).model))
    return {"prepared": name, "batch": list(x0.shape), "lr": cfg.lr, "ema_decay": cfg.ema_decay,
            "dropout": cfg.dropout, "downsample_padding": cfg.downsample_padding,
            "time_embedding": cfg.time_embedding, "norm_eps": cfg.norm_eps}


def read_prepared(work_dir, name):
    """(TrainConfig, batch, initial weights) that ``prepare`` wrote for a model."""
    with open(os.path.join(work_dir, f"{name}.json")) as f:
        cfg = TrainConfig.from_dict(json.load(f)["config"])
    weights = np.load(os.path.join(work_dir, f"{name}_weights.npz"))
    return cfg, np.load(os.path.join(work_dir, f"{name}_x0.npy")), {k: weights[k] for k in weights.files}


def randomised(model, seed=1):
    """Weights with activations of order 1 everywhere (the init's near-zero convs would hide whole branches
    from a comparison): conv and linear weights U(-a, a) with variance 1/fan_in, GroupNorm scales near 1,
    biases near 0."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        if name.endswith("bias"):
            value = 0.2 * rng.standard_normal(shape)
        elif len(shape) == 1:  # GroupNorm scale
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            value = rng.uniform(-1, 1, shape) * np.sqrt(3.0 / np.prod(shape[1:]))
        weights[name] = value.astype(np.float32)
    return weights


def reference(work_dir, models, paper=True):
    """Write reference.json (parameter shapes of each prepared model and of the paper model; for each prepared
    model the config of the step check, its metrics and the DDIM check's settings) and MODEL_reference.npz
    (randomised weights, input, forward output, weights after two steps, a DDIM sample). Returns one line per
    config."""
    configs = {name: read_prepared(work_dir, name)[0] for name in models}
    if paper:
        configs["paper"] = TrainConfig(image_size=32, image_channels=3)
    entries, lines = {}, []
    for name, cfg in configs.items():
        mge.random.seed(cfg.seed)
        model = build_model(cfg)
        params = {n: list(p.shape) for n, p in model.named_parameters()}
        entry = entries[name] = {"config": cfg.to_dict(), "params": params,
                                 "total": int(sum(np.prod(shape) for shape in params.values()))}
        if name == "paper":
            entry["expected_total"] = PAPER_PARAMS
        else:
            entry.update(check_outputs(work_dir, name, cfg, model))
        lines.append({"reference": name, "params": entry["total"], "tensors": len(params)})
    with open(os.path.join(work_dir, "reference.json"), "w") as f:
        json.dump({"legacy": TrainConfig.from_dict({}).to_dict(), "configs": entries}, f)
    return lines


def check_outputs(work_dir, name, cfg, model):
    """Outputs of ``model`` (built for ``cfg``) from randomised weights on two images of the batch: an eval-mode
    forward, two ``Trainer.step`` updates (dropout 0, batch 2, warmup over 2 steps) and a DDIM sample.
    Saves the arrays to MODEL_reference.npz; returns the reference.json fields."""
    x = read_prepared(work_dir, name)[1][:2]
    t = np.array(CHECK_T, dtype=np.int32)
    weights = randomised(model)
    model.load_state_dict(weights)
    model.eval()
    y = model(mge.tensor(x), mge.tensor(t)).numpy()
    diffusion = build_diffusion(cfg)
    seeds = [0, 1]
    ddim = diffusion.sample(model, x.shape, sampler="ddim", steps=CHECK_DDIM_STEPS, seeds=seeds).numpy()
    step_cfg = cfg.replace(dropout=0.0, batch_size=2, warmup_steps=2)
    trainer = Trainer(step_cfg)
    with trainer.state() as state:
        state.model.load_state_dict(weights)
        state.ema.load_state_dict(weights)
    steps = [trainer.step(x) for _ in range(2)]
    with trainer.state() as state:
        after = {f"model.{n}": v for n, v in weights_of(state.model).items()}
        after.update((f"ema.{n}", v) for n, v in weights_of(state.ema).items())
    np.savez(os.path.join(work_dir, f"{name}_reference.npz"), x=x, t=t, y=y, ddim=ddim,
             **{f"init.{n}": v for n, v in weights.items()}, **after)
    return {"step_config": step_cfg.to_dict(), "betas": diffusion.betas.tolist(), "steps": steps,
            "ddim_steps": CHECK_DDIM_STEPS, "ddim_seeds": seeds}


def engine():
    """What ran megdiffusion's side: MegEngine's version, the convolution kernels, and whether the network runs
    outside MegEngine (``megdiffusion.cpu.native``)."""
    return {"megengine": mge.__version__, "cpu_engine": cpu_engine_enabled(), "onednn": onednn.available(),
            "native": native.enabled()}


def train(args):
    """Time ``Trainer.step`` from the prepared weights on the prepared batch."""
    cfg, x0, weights = read_prepared(args.work_dir, args.model)
    trainer = Trainer(cfg)
    with trainer.state() as state:
        state.model.load_state_dict(weights)
        state.ema.load_state_dict(weights)
    return measurement.training(args, "megdiffusion", lambda: trainer.step(x0), len(x0), engine())


def ddim(args):
    """Time one DDIM sampling call (eta 0, x_T from one seed per image) of a ``--batch`` of images, with the network
    ``generation.generate_images`` uses (``native.NativeModel`` on the fast CPU path); or, with ``--sampler``, an ODE
    solver making the same number of network calls (``--sample_steps``; Heun: one step fewer than half of them)."""
    cfg, _, weights = read_prepared(args.work_dir, args.model)
    model, diffusion = build_model(cfg), build_diffusion(cfg)
    model.load_state_dict(weights)
    model.eval()
    model = native.NativeModel.for_sampling(model)
    shape = (args.batch,) + cfg.image_shape
    model(mge.tensor(np.zeros(shape, np.float32)), mge.tensor(np.zeros(args.batch, np.int32))).numpy()  # untimed
    steps = (args.sample_steps + 1) // 2 if args.sampler == solvers.HEUN else args.sample_steps
    if solvers.calls_per_image(args.sampler, steps) != args.sample_steps:
        raise SystemExit(f"error: {args.sampler} cannot make {args.sample_steps} network calls per image")
    return measurement.sampling(args, "megdiffusion", lambda: diffusion.sample(
        model, shape, sampler=args.sampler, steps=steps, seeds=range(args.batch)).numpy(), engine(), args.sampler)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("prepare", "reference"):
        p = sub.add_parser(command)
        p.add_argument("work_dir")
        p.add_argument("--models", default="cpu,cifar")
    sub.choices["prepare"].add_argument("--cpu_batch", type=int, default=None, help="default: the recipe's")
    sub.choices["prepare"].add_argument("--cifar_batch", type=int, default=None, help=f"default: {CIFAR_BATCH}")
    for command in ("train", "ddim"):
        p = sub.add_parser(command)
        p.add_argument("work_dir")
        p.add_argument("model", choices=sorted(MODELS))
        p.add_argument("--round", type=int, default=0)
    sub.choices["train"].add_argument("--warmup", type=int, default=1)
    sub.choices["train"].add_argument("--steps", type=int, default=3)
    sub.choices["ddim"].add_argument("--batch", type=int, default=16)
    sub.choices["ddim"].add_argument("--sample_steps", type=int, default=50, help="network calls per image")
    sub.choices["ddim"].add_argument("--sampler", default="ddim", choices=("ddim",) + solvers.SOLVERS)
    args = parser.parse_args()
    if args.command == "prepare":
        lines = prepare(args.work_dir, args.models.split(","), {"cpu": args.cpu_batch, "cifar": args.cifar_batch})
    elif args.command == "reference":
        lines = reference(args.work_dir, args.models.split(","))
    else:
        lines = [{"train": train, "ddim": ddim}[args.command](args)]
    for line in lines:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
