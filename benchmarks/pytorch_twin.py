"""The PyTorch twin of megdiffusion's UNet, of ``Trainer.step`` and of the DDIM sampler, for ``vs_pytorch.py``.

Imports only torch, numpy, the standard library and ``measurement.py`` beside it (standard library only), so it
runs under any interpreter with torch (``vs_pytorch.py --torch_python``). It reads the files that
``megdiffusion_side.py prepare``/``reference`` write into a work directory: ``MODEL.json`` (megdiffusion's
``TrainConfig.to_dict()``, what a config without a later field means, and the betas), ``MODEL_x0.npy`` (the
batch), ``MODEL_weights.npz`` (megdiffusion's initial weights), ``reference.json`` and ``MODEL_reference.npz``
(parameter shapes and outputs to compare).

The network follows the config: ``norm_groups``, ``norm_eps``, ``downsample_padding`` ("bottom_right": one
zero row and column at the bottom and right before a stride-2 conv without padding; "symmetric": padding 1)
and ``time_embedding`` ("ho": [sin | cos]; "pytorch_ddpm": sin and cos interleaved). A config field the twin
does not know is refused unless it has the value a config without that field stands for.

    python benchmarks/pytorch_twin.py check DIR              # compare with megdiffusion_side.py reference
    python benchmarks/pytorch_twin.py train DIR MODEL [--warmup 1] [--steps 3] [--round 0]
    python benchmarks/pytorch_twin.py ddim DIR MODEL [--batch 16] [--sample_steps 50] [--round 0]
"""
import argparse
import copy
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import measurement

# Fields that shape the network or the step, read (or restricted by SUPPORTED) below.
MODEL_FIELDS = ("image_channels", "image_size", "model_channels", "channel_mult", "num_res_blocks",
                "attention_resolutions", "dropout", "norm_groups", "norm_eps", "downsample_padding",
                "time_embedding")
STEP_FIELDS = ("num_timesteps", "mean_type", "var_type", "lr", "warmup_steps", "grad_clip", "ema_decay", "ema_warmup",
               "seed")
# Fields that change neither the network nor one step on a given batch (data, outputs, run length, devices),
# and beta_schedule: the betas come with the config.
IGNORED_FIELDS = ("beta_schedule", "batch_size", "dataset", "data_path", "random_flip", "total_steps", "logdir",
                  "log_every", "save_every", "keep_checkpoints", "sample_every", "sample_num", "sample_sampler",
                  "sample_steps", "resume", "init_from", "time_limit_minutes", "fid_every", "fid_num_images",
                  "device", "num_gpus", "world_size", "rank_start", "master_ip", "port")
# The choices implemented here (megdiffusion offers more for some).
SUPPORTED = {"mean_type": ("eps",), "var_type": ("fixedlarge", "fixedsmall"),
             "downsample_padding": ("bottom_right", "symmetric"), "time_embedding": ("ho", "pytorch_ddpm")}


# How far the twin may be from megdiffusion with the same weights: relative errors of the outputs; errors of the
# weights (and EMA) after the steps as fractions of the summed lr, since Adam moves a weight by about lr per step
# whatever the gradient's scale, and rounding errors of the gradients move its direction (measured: 3.7e-4 on the
# CPU recipe, 5.7e-4 on the CIFAR-shaped model). Adam moves a weight by lr * m / (sqrt(v) + 1e-8): where a
# gradient is below 100 * eps at either step (attention's key biases, whose gradient softmax cancels, and a
# few entries per tensor), float32 rounding decides that move, so those entries only get Adam's bound of
# about lr per step on each side (2.01 * the summed lr).
TOLERANCES = {"forward": 2e-5, "loss": 1e-5, "grad_norm": 1e-4, "ddim": 1e-4, "weights": 1e-3,
              "adam_sensitive_gradient": 1e-6, "sensitive_weights": 2.01}


class UnsupportedConfig(ValueError):
    """A megdiffusion config this twin does not implement."""


def check_config(name, cfg, legacy):
    """Raise ``UnsupportedConfig`` (one line) for a TrainConfig dict the twin cannot follow. ``legacy``: what a
    config without a field stands for (``TrainConfig.from_dict({})``), the only value accepted for unknown fields."""
    for field, value in cfg.items():
        if field in MODEL_FIELDS or field in STEP_FIELDS or field in IGNORED_FIELDS:
            allowed = SUPPORTED.get(field)
            if allowed is not None and value not in allowed:
                raise UnsupportedConfig(f"{name}: the PyTorch twin implements {field} "
                                        f"{' or '.join(allowed)}, not {value!r}")
        elif field not in legacy or value != legacy[field]:
            raise UnsupportedConfig(f"{name}: the PyTorch twin does not implement the config field "
                                    f"{field}={value!r}; teach benchmarks/pytorch_twin.py about it")
    missing = [field for field in MODEL_FIELDS + STEP_FIELDS if field not in cfg]
    if missing:
        raise UnsupportedConfig(f"{name}: the config lacks {', '.join(missing)}")


def read_config(work_dir, model):
    """``(cfg, betas)`` of MODEL.json, checked by ``check_config``."""
    with open(os.path.join(work_dir, f"{model}.json")) as f:
        prepared = json.load(f)
    check_config(model, prepared["config"], prepared["legacy"])
    return prepared["config"], np.asarray(prepared["betas"], dtype=np.float64)


def conv(in_channels, out_channels, kernel_size=3, stride=1, padding=None):
    """A Conv2d, "same"-padded unless ``padding`` is given (weights come from megdiffusion)."""
    return nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                     kernel_size // 2 if padding is None else padding)


class ResBlock(nn.Module):
    """GN, SiLU, conv; + the projected time embedding; GN, SiLU, dropout, conv; plus the (1x1 conv) skip."""

    def __init__(self, in_channels, out_channels, temb_channels, dropout, norm):
        super().__init__()
        self.norm1 = norm(in_channels)
        self.conv1 = conv(in_channels, out_channels)
        self.temb_proj = nn.Linear(temb_channels, out_channels)
        self.norm2 = norm(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = conv(out_channels, out_channels)
        self.skip = conv(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return (x if self.skip is None else self.skip(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions, with 1x1 convs for q, k, v and the output."""

    def __init__(self, channels, norm):
        super().__init__()
        self.norm = norm(channels)
        self.q, self.k, self.v, self.proj_out = (conv(channels, channels, 1) for _ in range(4))

    def forward(self, x):
        n, c, height, width = x.shape
        h = self.norm(x)
        q, k, v = (layer(h).flatten(2) for layer in (self.q, self.k, self.v))  # (n, c, positions)
        weights = torch.softmax(torch.bmm(q.transpose(1, 2), k) * c ** -0.5, dim=2)  # (n, query, key)
        return x + self.proj_out(torch.bmm(v, weights.transpose(1, 2)).reshape(n, c, height, width))


class Downsample(nn.Module):
    """Stride-2 3x3 conv; "bottom_right" pads one zero row and column at the bottom and right first."""

    def __init__(self, channels, padding):
        super().__init__()
        self.bottom_right = padding == "bottom_right"
        self.conv = conv(channels, channels, stride=2, padding=0 if self.bottom_right else 1)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)) if self.bottom_right else x)


class Upsample(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv."""

    def __init__(self, channels):
        super().__init__()
        self.conv = conv(channels, channels)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class DownLevel(nn.Module):
    """One resolution on the way down; ``forward`` returns the skips: one per block, then the downsampled."""

    def __init__(self, blocks, attns, downsample):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.attns = nn.ModuleList(attns)
        self.downsample = downsample

    def forward(self, h, temb):
        outputs = []
        for i, block in enumerate(self.blocks):
            h = block(h, temb)
            h = self.attns[i](h) if len(self.attns) else h
            outputs.append(h)
        return outputs if self.downsample is None else outputs + [self.downsample(h)]


class UpLevel(nn.Module):
    """One resolution on the way up: blocks on [h, skip] (skips popped from the end), then an Upsample."""

    def __init__(self, blocks, attns, upsample):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.attns = nn.ModuleList(attns)
        self.upsample = upsample

    def forward(self, h, temb, skips):
        for i, block in enumerate(self.blocks):
            h = block(torch.cat([h, skips.pop()], dim=1), temb)
            h = self.attns[i](h) if len(self.attns) else h
        return h if self.upsample is None else self.upsample(h)


def embedding_frequencies(dim, kind):
    """The (dim / 2,) float32 frequencies of the sinusoidal timestep embedding, computed in float64 as megdiffusion
    does: exp(-ln(1e4) i / (dim / 2 - 1)) for "ho", exp(-ln(1e4) 2i / dim) for "pytorch_ddpm"."""
    steps = np.arange(dim // 2, dtype=np.float64)
    exponents = steps / (dim // 2 - 1) if kind == "ho" else 2 * steps / dim
    return torch.from_numpy(np.exp(-math.log(10000.0) * exponents).astype(np.float32))


class UNet(nn.Module):
    """megdiffusion.nn.UNet in PyTorch, built from a TrainConfig dict; ``forward(x, t)``, t (N,) timesteps."""

    def __init__(self, cfg):
        super().__init__()
        ch, mults, levels = cfg["model_channels"], cfg["channel_mult"], len(cfg["channel_mult"])

        def norm(channels):
            return nn.GroupNorm(cfg["norm_groups"], channels, eps=cfg["norm_eps"])

        def block(in_channels, out_channels):
            return ResBlock(in_channels, out_channels, 4 * ch, cfg["dropout"], norm)

        self.time_embedding = cfg["time_embedding"]
        self.freqs = embedding_frequencies(ch, cfg["time_embedding"])
        self.temb_dense0 = nn.Linear(ch, 4 * ch)
        self.temb_dense1 = nn.Linear(4 * ch, 4 * ch)
        self.conv_in = conv(cfg["image_channels"], ch)
        skips, channels, down = [ch], ch, []
        for level, mult in enumerate(mults):
            attend = cfg["image_size"] // 2 ** level in cfg["attention_resolutions"]
            blocks, attns = [], []
            for _ in range(cfg["num_res_blocks"]):
                blocks.append(block(channels, ch * mult))
                channels = ch * mult
                attns += [AttnBlock(channels, norm)] if attend else []
                skips.append(channels)
            last = level == levels - 1
            skips += [] if last else [channels]
            down.append(DownLevel(blocks, attns, None if last else Downsample(channels, cfg["downsample_padding"])))
        self.down = nn.ModuleList(down)
        self.mid_block1 = block(channels, channels)
        self.mid_attn = AttnBlock(channels, norm)
        self.mid_block2 = block(channels, channels)
        up = []
        for level in reversed(range(levels)):
            attend = cfg["image_size"] // 2 ** level in cfg["attention_resolutions"]
            blocks, attns = [], []
            for _ in range(cfg["num_res_blocks"] + 1):
                blocks.append(block(channels + skips.pop(), ch * mults[level]))
                channels = ch * mults[level]
                attns += [AttnBlock(channels, norm)] if attend else []
            up.insert(0, UpLevel(blocks, attns, Upsample(channels) if level else None))
        self.up = nn.ModuleList(up)
        self.norm_out = norm(channels)
        self.conv_out = conv(channels, cfg["image_channels"])

    def embed(self, t):
        args = t.float()[:, None] * self.freqs[None, :]
        if self.time_embedding == "ho":
            return torch.cat([torch.sin(args), torch.cos(args)], dim=1)
        return torch.stack([torch.sin(args), torch.cos(args)], dim=2).flatten(1)

    def forward(self, x, t):
        temb = self.temb_dense1(F.silu(self.temb_dense0(self.embed(t))))
        hs = [self.conv_in(x)]
        for level in self.down:
            hs += level(hs[-1], temb)
        h = self.mid_block2(self.mid_attn(self.mid_block1(hs[-1], temb)), temb)
        for level in reversed(self.up):
            h = level(h, temb, hs)
        return self.conv_out(F.silu(self.norm_out(h)))


def torch_shape(shape):
    """megdiffusion's shape of a parameter as torch stores it: conv biases are (1, O, 1, 1) there, (O,) here."""
    shape = tuple(shape)
    return shape[1:2] if len(shape) == 4 and shape[0] == shape[2] == shape[3] == 1 else shape


def load_weights(model, weights):
    """Copy megdiffusion-named, megdiffusion-shaped arrays into ``model`` (every parameter, nothing else)."""
    own = dict(model.named_parameters())
    if set(own) != set(weights):
        raise KeyError(f"weights differ by name: missing {sorted(set(own) - set(weights))[:3]}, "
                       f"unexpected {sorted(set(weights) - set(own))[:3]}")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(torch.from_numpy(np.asarray(weights[name])).reshape(param.shape))


class Schedule:
    """The float32 per-timestep coefficients megdiffusion's GaussianDiffusion gathers, and alpha_bar (float64)."""

    def __init__(self, betas):
        alphas_cumprod = self.alphas_cumprod = np.cumprod(1.0 - betas)
        self.sqrt_ac, self.sqrt_1m_ac, self.sqrt_recip_ac, self.sqrt_recipm1_ac = (
            torch.from_numpy(np.sqrt(a).astype(np.float32))
            for a in (alphas_cumprod, 1.0 - alphas_cumprod, 1.0 / alphas_cumprod, 1.0 / alphas_cumprod - 1.0))

    @staticmethod
    def at(table, t):
        return table[t].view(-1, 1, 1, 1)


class TwinTrainer:
    """``Trainer.step`` of one process: same t and noise, sample i's from ``default_rng([seed, step, i, 0])``,
    per-image MSE on the noise, its batch mean, backward, global-norm clip, Adam (warmed-up lr), EMA."""

    def __init__(self, cfg, betas, weights):
        self.cfg = cfg
        self.schedule = Schedule(betas)
        self.model = UNet(cfg)
        load_weights(self.model, weights)
        self.ema = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=cfg["lr"])
        self.step_count = 0

    def lr(self):
        warmup = self.cfg["warmup_steps"]
        return self.cfg["lr"] * (min(1.0, (self.step_count + 1) / warmup) if warmup else 1.0)

    def ema_decay(self):
        decay = self.cfg["ema_decay"]
        if self.cfg["ema_warmup"]:
            decay = min(decay, (1 + self.step_count) / (10 + self.step_count))
        return decay

    def step(self, x0):
        """One update on ``x0`` (float32 NCHW numpy): {"loss", "grad_norm", "lr"}."""
        cfg, schedule = self.cfg, self.schedule
        t, noise = np.empty(len(x0), np.int64), np.empty(x0.shape, np.float32)
        for i in range(len(x0)):  # sample i draws from its own generator, whatever the batch's cut
            rng = np.random.default_rng([cfg["seed"], self.step_count, i, 0])
            t[i] = rng.integers(0, cfg["num_timesteps"])
            noise[i] = rng.standard_normal(x0.shape[1:], dtype=np.float32)
        t, noise = torch.from_numpy(t), torch.from_numpy(noise)
        torch.manual_seed(int(np.random.default_rng([cfg["seed"], self.step_count, 0, 1]).integers(2 ** 31)))
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # at the start: the last step's gradients stay readable
        x0 = torch.from_numpy(x0)
        x_t = schedule.at(schedule.sqrt_ac, t) * x0 + schedule.at(schedule.sqrt_1m_ac, t) * noise
        loss = (self.model(x_t, t) - noise).square().flatten(1).mean(dim=1).mean()
        loss.backward()
        clip = cfg["grad_clip"] if cfg["grad_clip"] > 0 else math.inf
        grad_norm = float(nn.utils.clip_grad_norm_(self.params, clip))
        loss = loss.item()
        self.optimizer.step()
        decay = self.ema_decay()
        with torch.no_grad():
            for ema_param, param in zip(self.ema.parameters(), self.params):
                ema_param.mul_(decay).add_(param, alpha=1.0 - decay)
        self.step_count += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr}


@torch.no_grad()
def ddim_sample(model, schedule, num_timesteps, steps, seeds, image_shape):
    """megdiffusion's ``sample(sampler="ddim", eta=0, clip_denoised=True, seeds=...)``: x_T of image j from
    ``default_rng(seeds[j])``, the timesteps range(0, T, T // steps)[:steps] walked down, x_0 clipped to
    [-1, 1] and eps re-derived from it. Returns a float32 numpy array in [-1, 1]."""
    model.eval()
    timesteps = np.arange(0, num_timesteps, num_timesteps // steps)[:steps]
    x = torch.from_numpy(np.stack([np.random.default_rng(s).standard_normal(image_shape, dtype=np.float32)
                                   for s in seeds]))
    for i in range(len(timesteps) - 1, -1, -1):
        t = torch.full((len(seeds),), int(timesteps[i]), dtype=torch.int64)
        scaled = schedule.at(schedule.sqrt_recip_ac, t) * x
        x0 = (scaled - schedule.at(schedule.sqrt_recipm1_ac, t) * model(x, t)).clamp(-1.0, 1.0)
        eps = (scaled - x0) / schedule.at(schedule.sqrt_recipm1_ac, t)
        a_prev = schedule.alphas_cumprod[timesteps[i - 1]] if i > 0 else 1.0
        x = math.sqrt(a_prev) * x0 + math.sqrt(1.0 - a_prev) * eps
    return x.clamp(-1.0, 1.0).numpy()


def relative_error(ours, reference):
    """max |ours - reference| / max |reference|."""
    return float(np.abs(ours - reference).max() / max(np.abs(reference).max(), 1e-30))


def check_counts(name, entry):
    """Equal parameter names, shapes and total with megdiffusion's UNet for one config; returns the JSON line."""
    with torch.device("meta"):  # shapes only, no initialisation
        twin = {n: tuple(p.shape) for n, p in UNet(entry["config"]).named_parameters()}
    ours = {n: torch_shape(shape) for n, shape in entry["params"].items()}
    differ = sorted(n for n in set(twin) | set(ours) if twin.get(n) != ours.get(n))
    total = sum(math.prod(shape) for shape in twin.values())
    line = {"check": "parameters", "config": name, "megdiffusion_params": entry["total"], "torch_params": total,
            "tensors": len(twin), "differing_tensors": differ[:5]}
    if differ or total != entry["total"]:
        raise AssertionError(f"{name}: parameters differ from megdiffusion's ({len(differ)} tensors by name or "
                             f"shape, e.g. {differ[:3]}; totals {entry['total']} vs {total})")
    if entry.get("expected_total", total) != total:
        raise AssertionError(f"{name}: {total} parameters, expected {entry['expected_total']}")
    return line


def check_outputs(work_dir, name, entry, tolerances=TOLERANCES):
    """Forward, two training steps and a short DDIM sample from megdiffusion's weights; returns the JSON line."""
    ref = np.load(os.path.join(work_dir, f"{name}_reference.npz"))
    weights = {k[len("init."):]: ref[k] for k in ref.files if k.startswith("init.")}
    cfg, betas = entry["step_config"], np.asarray(entry["betas"])
    model = UNet(cfg)
    load_weights(model, weights)
    with torch.no_grad():
        y = model.eval()(torch.from_numpy(ref["x"]), torch.from_numpy(ref["t"]).long()).numpy()
    trainer = TwinTrainer(cfg, betas, weights)
    steps, sensitive = [], {n: False for n in weights}
    for _ in entry["steps"]:
        steps.append(trainer.step(ref["x"]))
        for n, p in trainer.model.named_parameters():
            sensitive[n] = sensitive[n] | (p.grad.abs() < tolerances["adam_sensitive_gradient"]).numpy()
    sample = ddim_sample(model, Schedule(betas), cfg["num_timesteps"], entry["ddim_steps"],
                         entry["ddim_seeds"], ref["x"].shape[1:])
    errors = {"forward": relative_error(y, ref["y"]),
              "loss": max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(entry["steps"], steps)),
              "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
                               for a, b in zip(entry["steps"], steps)),
              "ddim": relative_error(sample, ref["ddim"])}
    lr_sum = sum(s["lr"] for s in steps)
    for what, saved, module in (("weights", "model", trainer.model), ("ema", "ema", trainer.ema)):
        for n, p in module.named_parameters():
            err = np.abs(p.detach().numpy() - ref[f"{saved}.{n}"].reshape(p.shape))
            for key, mask in ((what, ~sensitive[n]), (f"sensitive_{what}", sensitive[n])):
                errors[key] = max(errors.get(key, 0.0), float(err[mask].max(initial=0.0)))
    limits = {key: tolerances[key] for key in ("forward", "loss", "grad_norm", "ddim")}
    limits.update(weights=tolerances["weights"] * lr_sum, ema=tolerances["weights"] * lr_sum,
                  sensitive_weights=tolerances["sensitive_weights"] * lr_sum,
                  sensitive_ema=tolerances["sensitive_weights"] * lr_sum)
    line = {"check": "same_weights", "config": name, **{f"{key}_max_err": errors[key] for key in limits},
            "ddim_steps": entry["ddim_steps"], "lr_sum": lr_sum,
            "sensitive_entries": int(sum(mask.sum() for mask in sensitive.values())),
            "loss": [[s["loss"] for s in entry["steps"]], [s["loss"] for s in steps]],
            "grad_norm": [[s["grad_norm"] for s in entry["steps"]], [s["grad_norm"] for s in steps]]}
    failures = [f"{key} error {errors[key]:.2e} > {limit:.2e}" for key, limit in limits.items()
                if not errors[key] <= limit]
    if [s["lr"] for s in entry["steps"]] != [s["lr"] for s in steps]:
        failures.append(f"learning rates differ: {[s['lr'] for s in entry['steps']]} vs {[s['lr'] for s in steps]}")
    if failures:
        raise AssertionError(f"{name}: " + "; ".join(failures))
    return line


def check(args):
    with open(os.path.join(args.work_dir, "reference.json")) as f:
        reference = json.load(f)
    for name, entry in reference["configs"].items():
        for key in ("config", "step_config"):  # refuse before comparing anything the twin cannot build
            if key in entry:
                check_config(name, entry[key], reference["legacy"])
        print(json.dumps(check_counts(name, entry)), flush=True)
        if "steps" in entry:
            print(json.dumps(check_outputs(args.work_dir, name, entry)), flush=True)


def engine():
    """What ran the twin: torch's version and its intra-op threads."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads()}


def train(args):
    cfg, betas = read_config(args.work_dir, args.model)
    x0 = np.load(os.path.join(args.work_dir, f"{args.model}_x0.npy"))
    trainer = TwinTrainer(cfg, betas, np.load(os.path.join(args.work_dir, f"{args.model}_weights.npz")))
    return measurement.training(args, "torch", lambda: trainer.step(x0), len(x0), engine())


def ddim(args):
    cfg, betas = read_config(args.work_dir, args.model)
    model = UNet(cfg)
    load_weights(model, np.load(os.path.join(args.work_dir, f"{args.model}_weights.npz")))
    shape = (cfg["image_channels"], cfg["image_size"], cfg["image_size"])
    with torch.no_grad():  # one untimed call at the batch size
        model.eval()(torch.zeros((args.batch,) + shape), torch.zeros(args.batch, dtype=torch.int64))
    return measurement.sampling(args, "torch", lambda: ddim_sample(
        model, Schedule(betas), cfg["num_timesteps"], args.sample_steps, range(args.batch), shape), engine())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check").add_argument("work_dir")
    for command in ("train", "ddim"):
        p = sub.add_parser(command)
        p.add_argument("work_dir")
        p.add_argument("model")
        p.add_argument("--round", type=int, default=0)
    p = sub.choices["train"]
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p = sub.choices["ddim"]
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--sample_steps", type=int, default=50)
    args = parser.parse_args()
    try:
        if args.command == "check":
            check(args)
        else:
            print(json.dumps({"train": train, "ddim": ddim}[args.command](args)), flush=True)
    except (UnsupportedConfig, AssertionError) as err:
        sys.exit(f"pytorch_twin.py {args.command}: {err}")


if __name__ == "__main__":
    main()
