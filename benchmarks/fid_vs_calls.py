"""FID against network calls per image, for every sampler, on a demo's checkpoint (the demo's protocol: 500 EMA
samples against the first 1000 embedded Fashion-MNIST images, guided by the demo's guide.pkl with w 2.5 or not).

    .venv/bin/python benchmarks/fid_vs_calls.py RUN_DIR OUT.jsonl SAMPLER:SPACING:CALLS[:unguided] ...
    .venv/bin/python benchmarks/fid_vs_calls.py --plot OUT.jsonl docs/fid_vs_calls.png

RUN_DIR is a demo's --output (``scripts/demo.sh --images 45000 --output RUN_DIR``). CALLS counts every network call
of an image, the guide's too: guided samplers take half as many steps (Heun: calls = 2 (2 steps - 1) guided,
2 steps - 1 unguided). Each point appends one JSON line to OUT.jsonl (points already there are skipped), with its
FID, the sampling and Inception seconds and the command that reproduces it. ``--plot`` draws the curves (needs
matplotlib).
"""
import argparse
import json
import os
import sys
import time

from megdiffusion.compat import quiet_megengine

GUIDANCE = 2.5


def steps_for(sampler, calls, guided):
    """Sampler steps that make ``calls`` network calls per image (ValueError when none does)."""
    per_model = calls // 2 if guided else calls
    if guided and calls % 2:
        raise ValueError(f"a guided sampler makes an even number of calls, not {calls}")
    if sampler == "heun":
        if per_model % 2 == 0:
            raise ValueError(f"heun makes 2 steps - 1 calls per model, not {per_model}")
        return (per_model + 1) // 2
    return per_model


def measure(run_dir, sampler, spacing, calls, guided, num_images=500, batch_size=100):
    """One point: FID and sampling seconds of ``num_images`` samples of the run's final EMA model."""
    from megdiffusion.diffusion.generation import Autoguidance, generate_images
    from megdiffusion.diffusion.sampler_settings import SamplerSettings
    from megdiffusion.metrics import fid
    from megdiffusion.sampling.jobs import load_model

    model, diffusion, cfg, step = load_model(os.path.join(run_dir, "train"))
    guide = None
    if guided:
        guide = Autoguidance(load_model(os.path.join(run_dir, "guide.pkl"))[0], GUIDANCE)
    reference = fid.load_statistics(os.path.join(run_dir, "reference", "fashion_mnist_first1000.npz"))
    steps = steps_for(sampler, calls, guided)
    started = time.perf_counter()
    settings = SamplerSettings(sampler, steps, spacing=None if spacing == "default" else spacing)
    samples = generate_images(model, diffusion, cfg.image_shape, range(num_images), cfg.seed, settings,
                              batch_size=batch_size, guidance=guide)
    sampled = time.perf_counter()
    generated = fid.statistics_of_images(samples)
    value = fid.frechet_distance(generated.mu, generated.sigma, reference.mu, reference.sigma)
    return {"fid": round(float(value), 2), "steps": steps, "train_step": int(step), "seed": cfg.seed,
            "sample_seconds": round(sampled - started, 1), "inception_seconds": round(time.perf_counter() - sampled, 1)}


def plot(results_path, image_path):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(results_path)]
    top = 130  # points above are drawn at the top edge with their value
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for ax, guided in zip(axes, (True, False)):
        curves = {}
        for row in rows:
            if row["guided"] == guided and row["seed"] == 0:
                curves.setdefault(f"{row['sampler']} ({row['spacing']})", []).append((row["calls"], row["fid"]))
        for label, points in sorted(curves.items()):
            points.sort()
            calls, fids = [c for c, _ in points], [min(f, top) for _, f in points]
            ax.plot(calls, fids, marker="o", label=label)
            for c, f in points:
                if f > top:
                    ax.annotate(f"{f:.0f}", (c, top), textcoords="offset points", xytext=(3, -10), fontsize=7)
        ax.axhline(33.0, color="gray", linestyle=":", label="real-data floor (33.0)")
        ax.set_xscale("log")
        ax.set_xticks([10, 20, 50, 100, 200])
        ax.set_xticklabels(["10", "20", "50", "100", "200"])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlim(8, 250)
        ax.set_ylim(25, top + 5)
        ax.set_xlabel("network calls per image (the guide's included)")
        ax.set_title("guided (autoguidance, w 2.5)" if guided else "unguided")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("FID, 500 samples vs 1000 real images")
    fig.suptitle("The demo's model after 45,008 training images (seed 0): FID against network calls")
    fig.tight_layout()
    fig.savefig(image_path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", action="store_true")
    parser.add_argument("paths", nargs=2)
    parser.add_argument("points", nargs="*", help="SAMPLER:SPACING:CALLS[:unguided] (SPACING 'default': the "
                        "sampler's own)")
    args = parser.parse_args()
    if args.plot:
        return plot(*args.paths)
    quiet_megengine()
    run_dir, out = args.paths
    done = set()
    if os.path.exists(out):
        done = {(r["run"], r["sampler"], r["spacing"], r["calls"], r["guided"]) for r in map(json.loads, open(out))}
    for point in args.points:
        sampler, spacing, calls, *rest = point.split(":")
        guided = rest != ["unguided"]
        key = (os.path.abspath(run_dir), sampler, spacing, int(calls), guided)
        if key in done:
            continue
        row = {"run": key[0], "sampler": sampler, "spacing": spacing, "calls": int(calls), "guided": guided,
               **measure(run_dir, sampler, spacing, int(calls), guided),
               "command": f"{sys.executable} benchmarks/fid_vs_calls.py {run_dir} OUT.jsonl {point}"}
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
