"""Training at scale: time and memory against dataset size for three ways of feeding a folder of 256x256 images.

For each size (``--sizes``, and ``--baseline``, the size the memory is compared with) on a synthetic folder of
341x256 JPEGs (seeded smooth gradients, blobs and noise, quality 90; generated once into ``--workdir`` and reused, a
larger set reusing the smaller one's files):

1. ``scripts.prepare FOLDER FILE --image_size 256``: wall seconds, images/s, the prepared file's size;
2. one decode worker's rate on the streamed folder: ``load_dataset("folder", DIR, 256)`` indexed with batches of 64
   random indices for ``--decode_seconds`` in this process (what one ``--data_workers`` process can deliver);
3. ``scripts.train`` with a tiny network at 256x256 (batch 8, 2 steps, ``--log_every=1``), one row per feed:
   ``in-RAM folder (before)``: the code before the prepared file (``BASE_COMMIT``, a worktree in ``--base_worktree``),
   which decodes the whole folder into one array before the first step, 1 process; ``prepared file``: the memory
   map, 1 process and 2 (two runs started together on the same file, each its own logdir); ``streamed folder``: the
   folder decoded by the data workers as the steps need it, 1 process and 2. A row's time to first step runs from the
   process start to the first line of metrics.jsonl (the slower run's with 2 processes); its memory is the peak
   RssAnon (anonymous memory: not a memory map's page cache, which is RssFile) summed over the training process and
   all its descendants (the data workers), polled every ``--poll`` seconds from /proc; with 2 processes, the sum of
   both runs' peaks. The before row is not run where its array (N x 196,608 bytes) would exceed 70% of MemTotal.

Prints one JSON line per measurement, then a markdown table (size x feed x processes; the difference in peak memory
against the same row at ``--baseline`` images) and notes: the decode rates, and on paper the images/s the paper's
256x256 step (batch 64) needs on one GPU at an assumed ``--gpu_steps_per_s``, and how many decode workers that is.
The page cache is warm throughout (the images were just written or read): the times are not cold-disk times. GB are
10^9 bytes. Logdirs are removed after each run, the prepared files after each size (``--keep_prepared`` keeps them).

    python benchmarks/data_scale.py                      # 10,000, 40,000 and 126,227 images: long; ~4 GB of JPEG
                                                         # written once, a 24.8 GB prepared file at 126,227
    python benchmarks/data_scale.py --quick              # 300 and 600 images, a few minutes: checks the script
    python benchmarks/data_scale.py --sizes 2000 --baseline 1000 --data_workers 2
"""
import argparse
import atexit
import fcntl
import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_COMMIT = "b6d0ce8"  # the commit before the prepared file and the streamed folder
WIDTH, HEIGHT = 341, 256  # the synthetic images (the aspect of LSUN's; centre-cropped to 256x256)
IMAGE_SIZE = 256
IMAGE_BYTES = IMAGE_SIZE * IMAGE_SIZE * 3  # 196,608: one decoded training image
SHARD = 1000  # images per subfolder
GB = 1e9
BATCH = 64  # the paper's 256x256 batch, and the decode-rate benchmark's batch
FEEDS = ("in-RAM folder (before)", "prepared file", "streamed folder")
# The tiny network at 256x256: the data path is what is measured, not the step.
TINY_FLAGS = """# data_scale.py's tiny network at 256x256 (a --flagfile, so the CPU recipe is not read first)
--image_size=256
--model_channels=16
--channel_mult=1,1,1,1,1,1
--num_res_blocks=1
--attention_resolutions=
--norm_groups=4
--dropout=0
--batch_size=8
--total_steps=2
--log_every=1
--sample_every=0
--save_every=0
--num_timesteps=1000
--device=cpu
--seed=0
"""

_LIVE = []  # Popen objects of running children (each its own process group)


# ---------------------------------------------------------------------------------------------------------------------
# Children: started in their own process group, killed with all their descendants on the way out.

def _start(args, cwd, env, log):
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _LIVE.append(proc)
    return proc


def _group(pgid):
    """The live processes of process group ``pgid`` (zombies left out)."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(name))
    return members


def _stop(proc, grace=15.0):
    """End ``proc`` and its process group (its workers). SIGTERM to ``proc`` alone first: training then stops after the
    current step and closes its data workers itself, and multiprocessing's resource tracker (in the group too)
    removes the semaphores; a SIGKILL of the group in the middle of that would leave files in /dev/shm. Whatever of
    the group is still there ``grace`` seconds later is killed."""
    deadline = time.monotonic() + grace
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    while proc.poll() is not None and [pid for pid in _group(proc.pid) if pid != proc.pid] \
            and time.monotonic() < deadline:
        time.sleep(0.1)  # the workers and the resource tracker end on their own once their parent is gone
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if proc in _LIVE:
        _LIVE.remove(proc)


def _stop_all():
    for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal does not cut the clean-up short
        signal.signal(signum, signal.SIG_IGN)
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # all at once, then each waited for
    for proc in list(_LIVE):
        _stop(proc)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


# ---------------------------------------------------------------------------------------------------------------------
# Memory from /proc.

def mem_total():
    """MemTotal in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _parents():
    """{pid: parent pid} of every process (read from /proc/PID/stat)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
    return parents


def _tree(root, parents):
    """``root`` and its descendants, recursively."""
    children = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _rss(pid):
    """(RssAnon, RssFile, RssShmem) of ``pid`` in bytes; zeros for a process that ended."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    key, number = line.split()[:2]
                    values[key] = int(number) * 1024
    except OSError:
        pass
    return values.get("RssAnon:", 0), values.get("RssFile:", 0), values.get("RssShmem:", 0)


class Watch:
    """Polls the process trees of ``procs`` every ``poll`` seconds until they all end (or ``timeout``): the peak of
    each tree's summed RssAnon (and RssFile, RssShmem), the peak of all trees' RssAnon together, and when each
    ``first_line`` file (or None) first holds a whole line, in seconds from ``starts``.

    A process counts from its second poll on: a child caught between fork and exec still shows its parent's memory
    (shared, copy-on-write) as its own RssAnon, which would count the parent twice."""

    def __init__(self, procs, starts, first_line, poll, timeout):
        seen = set()
        self.peak = [[0, 0, 0] for _ in procs]
        self.peak_processes = [0 for _ in procs]
        self.peak_together = 0
        self.first = [None for _ in procs]
        self.timed_out = False
        deadline = time.monotonic() + timeout
        while True:
            parents = _parents()
            together = 0
            for i, proc in enumerate(procs):
                tree = _tree(proc.pid, parents) if proc.pid in parents else []
                pids = [pid for pid in tree if pid in seen]
                seen.update(tree)
                sums = [sum(values) for values in zip(*(_rss(pid) for pid in pids))] or [0, 0, 0]
                self.peak[i] = [max(a, b) for a, b in zip(self.peak[i], sums)]
                self.peak_processes[i] = max(self.peak_processes[i], len(pids))
                together += sums[0]
                if self.first[i] is None and first_line[i] is not None and _has_line(first_line[i]):
                    self.first[i] = time.monotonic() - starts[i]
            self.peak_together = max(self.peak_together, together)
            if all(proc.poll() is not None for proc in procs):
                break
            if time.monotonic() > deadline:
                self.timed_out = True
                break
            time.sleep(poll)


def _has_line(path):
    try:
        with open(path, "rb") as f:
            return b"\n" in f.read(4096)
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------------------------
# The synthetic folder.

def synthetic_image(seed, index):
    """Image ``index`` of seed ``seed``: uint8 (HEIGHT, WIDTH, 3), a smooth colour gradient, 3-8 soft blobs and
    Gaussian noise (so that JPEG has real work on both sides)."""
    rng = np.random.default_rng([seed, index])
    x = np.linspace(0.0, 1.0, WIDTH, dtype=np.float32)
    y = np.linspace(0.0, 1.0, HEIGHT, dtype=np.float32)
    base, dx, dy = rng.uniform(0, 255, 3), rng.uniform(-120, 120, 3), rng.uniform(-120, 120, 3)
    image = (base + dx * x[None, :, None] + dy * y[:, None, None]).astype(np.float32)
    for _ in range(rng.integers(3, 9)):
        cx, cy = rng.uniform(0, 1, 2)
        sx, sy = rng.uniform(0.03, 0.3, 2)
        colour = rng.uniform(-160, 160, 3).astype(np.float32)
        bump = np.exp(-((y[:, None] - cy) / sy) ** 2 / 2) * np.exp(-((x[None, :] - cx) / sx) ** 2 / 2)
        image += bump[:, :, None] * colour
    image += rng.standard_normal(image.shape, dtype=np.float32) * rng.uniform(2, 12)
    return np.clip(image, 0, 255).astype(np.uint8)


def image_path(pool, index):
    return os.path.join(pool, f"{index // SHARD:03d}", f"{index:06d}.jpg")


def _write_images(job):
    """Write the images ``indices`` of ``seed`` into ``pool`` (a worker's task), each under a temporary name first."""
    from PIL import Image

    pool, seed, indices = job
    for index in indices:
        path = image_path(pool, index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(synthetic_image(seed, index)).save(path + ".part", "JPEG", quality=90)
        os.replace(path + ".part", path)
    return len(indices)


def make_pool(pool, seed, count, workers):
    """The first ``count`` images of ``seed`` in ``pool``, writing the missing ones in ``workers`` processes; returns
    (images written, seconds)."""
    missing = [i for i in range(count) if not os.path.exists(image_path(pool, i))]
    start = time.perf_counter()
    if missing:
        jobs = [(pool, seed, missing[i:i + 100]) for i in range(0, len(missing), 100)]
        with multiprocessing.get_context("spawn").Pool(workers) as processes:
            for _ in processes.imap_unordered(_write_images, jobs):
                pass
    return len(missing), time.perf_counter() - start


def make_set(sets, pool, count):
    """A folder of exactly the first ``count`` images of ``pool`` (hard links, so the files and their page cache are
    shared with every other set), made once."""
    folder = os.path.join(sets, str(count))
    done = folder + ".complete"
    if os.path.exists(done):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    for index in range(count):
        source = image_path(pool, index)
        target = image_path(folder, index)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
    open(done, "w").close()
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# The measurements.

def emit(line):
    print(json.dumps(line), flush=True)
    return line


def _tail(log, lines=3):
    """The last lines of a child's output, progress bars left out."""
    try:
        with open(log, errors="replace") as f:
            text = [line for line in f.read().splitlines() if line.strip() and "%|" not in line]
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _env(code):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = code + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def prepare(args, size, folder, dest):
    """Time ``scripts.prepare`` on ``folder``; its peak memory too (RssAnon over it and its decode workers)."""
    command = [sys.executable, "-m", "megdiffusion.scripts.prepare", folder, dest, "--image_size", str(IMAGE_SIZE),
               "--noprogress", "--overwrite"]
    if args.prepare_workers is not None:
        command += ["--workers", str(args.prepare_workers)]
    needed = size * IMAGE_BYTES + 2 * GB
    free = shutil.disk_usage(os.path.dirname(dest)).free
    if free < needed:
        return emit({"kind": "prepare", "size": size, "error": f"{free / GB:.1f} GB free in {os.path.dirname(dest)}, "
                                                               f"the prepared file needs {needed / GB:.1f} GB"})
    log = dest + ".log"
    start = time.monotonic()
    proc = _start(command, REPO, _env(REPO), log)
    watch = Watch([proc], [start], [None], args.poll, args.timeout)
    seconds = time.monotonic() - start
    _stop(proc)
    line = {"kind": "prepare", "size": size, "seconds": round(seconds, 2),
            "images_per_s": round(size / seconds, 1), "workers": args.prepare_workers,
            "peak_rss_anon_gb": round(watch.peak[0][0] / GB, 3), "exit_code": proc.returncode}
    if proc.returncode == 0:
        line["file_gb"] = round(os.path.getsize(dest) / GB, 3)
    else:
        line["error"] = "timed out" if watch.timed_out else _tail(log)
    os.remove(log)
    return emit(line)


def decode_rate(args, size, folder):
    """Images/s one process decodes from the streamed folder, batches of 64 random indices for ~decode_seconds."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from megdiffusion.data.datasets import load_dataset

    images = load_dataset("folder", folder, IMAGE_SIZE)
    rng = np.random.default_rng(args.seed)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.decode_seconds:
        batch = images[rng.choice(len(images), min(BATCH, len(images)), replace=False)]
        count += len(batch)
    seconds = time.perf_counter() - start
    return emit({"kind": "decode", "size": size, "images": count, "seconds": round(seconds, 2),
                 "images_per_s": round(count / seconds, 1), "batch": BATCH, "processes": 1})


def train(args, size, feed, processes, data_path, kind="train"):
    """``processes`` training runs of ``feed`` started together; the row's line (``kind`` "warmup": a run that
    only warms the code up: its .pyc files, numba's cache, the page cache)."""
    before = feed == FEEDS[0]
    code = args.base_worktree if before else REPO
    runs_dir = os.path.join(args.workdir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    procs, starts, firsts, logdirs, logs = [], [], [], [], []
    for i in range(processes):
        logdir = os.path.join(runs_dir, f"{size}-{FEEDS.index(feed)}-{processes}-{i}")
        shutil.rmtree(logdir, ignore_errors=True)
        command = [sys.executable, "-m", "megdiffusion.scripts.train", f"--flagfile={args.flagfile}",
                   f"--dataset={'prepared' if feed == FEEDS[1] else 'folder'}", f"--data_path={data_path}",
                   f"--logdir={logdir}"]
        if not before:  # the old code has no --data_workers
            command.append(f"--data_workers={args.data_workers}")
        logdirs.append(logdir)
        logs.append(logdir + ".log")
        firsts.append(os.path.join(logdir, "metrics.jsonl"))
        starts.append(time.monotonic())
        procs.append(_start(command, code, _env(code), logs[-1]))
    watch = Watch(procs, starts, firsts, args.poll, args.timeout)
    seconds = [time.monotonic() - s for s in starts]
    for proc in procs:
        _stop(proc)
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0 or watch.first[i] is None]
    line = {"kind": kind, "size": size, "feed": feed, "processes": processes,
            "data_workers": None if before else args.data_workers,
            "time_to_first_step_s": None if failed else round(max(watch.first), 2),
            "peak_rss_anon_gb": round(sum(p[0] for p in watch.peak) / GB, 3),
            "peak_rss_anon_together_gb": round(watch.peak_together / GB, 3),
            "peak_rss_file_gb": round(sum(p[1] for p in watch.peak) / GB, 3),
            "peak_rss_shmem_gb": round(sum(p[2] for p in watch.peak) / GB, 3),
            "per_run_first_step_s": [None if f is None else round(f, 2) for f in watch.first],
            "per_run_peak_rss_anon_gb": [round(p[0] / GB, 3) for p in watch.peak],
            "per_run_processes": watch.peak_processes,
            "seconds": round(max(seconds), 2), "exit_codes": [proc.returncode for proc in procs],
            "load": round(os.getloadavg()[0], 2)}
    if failed:
        i = failed[0]
        line["error"] = "timed out" if watch.timed_out else (
            _tail(logs[i]) or f"exit code {procs[i].returncode}, no line in {firsts[i]}")
    for logdir, log in zip(logdirs, logs):
        shutil.rmtree(logdir, ignore_errors=True)
        if os.path.exists(log):
            os.remove(log)
    return emit(line)


def cannot_fit(size, ram):
    """The before row's line where its array would not fit (> 70% of MemTotal), else None."""
    projected = size * IMAGE_BYTES
    if projected <= 0.7 * ram:
        return None
    than = "RAM" if projected > ram else "70% of RAM"
    text = (f"cannot fit: {size:,} images x {IMAGE_BYTES:,} bytes = {projected / GB:.1f} GB > {than} "
            f"(MemTotal {ram / GB:.1f} GB)")
    return emit({"kind": "train", "size": size, "feed": FEEDS[0], "processes": 1, "skipped": text,
                 "projected_gb": round(projected / GB, 2), "mem_total_gb": round(ram / GB, 2)})


def base_worktree(path):
    """The worktree of the code before (``BASE_COMMIT``) at ``path``, added when missing."""
    if not os.path.isdir(os.path.join(path, "megdiffusion")):
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", path, BASE_COMMIT], check=True,
                       stdout=subprocess.DEVNULL)
    head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    if not head.startswith(BASE_COMMIT):
        print(f"warning: {path} is at {head[:7]}, not {BASE_COMMIT}: its rows are not the code before",
              file=sys.stderr)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# The table.

def _number(value, digits):
    return "" if value is None else f"{value:,.{digits}f}"


def table(args, sizes, lines):
    prepares = {line["size"]: line for line in lines if line["kind"] == "prepare"}
    decodes = {line["size"]: line for line in lines if line["kind"] == "decode"}
    trains = {(line["size"], line["feed"], line["processes"]): line for line in lines if line["kind"] == "train"}
    out = [f"| images | feed | processes | prepare s | prepare img/s | time to first step s | peak RssAnon sum GB | "
           f"vs {args.baseline:,} images GB |", "|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        for feed in FEEDS:
            for processes in (1,) if feed == FEEDS[0] else (1, 2):
                line = trains.get((size, feed, processes))
                if line is None:
                    continue
                prep = prepares.get(size) if feed == FEEDS[1] and processes == 1 else None
                cells = [f"{size:,}", feed, str(processes), _number(prep and prep.get("seconds"), 1),
                         _number(prep and prep.get("images_per_s"), 0)]
                if "skipped" in line:
                    cells += [line["skipped"], "", ""]
                elif "error" in line:
                    cells += [f"failed: {line['error'][:120]}", _number(line.get("peak_rss_anon_gb"), 2), ""]
                else:
                    base = trains.get((args.baseline, feed, processes))
                    difference = None if base is None or "error" in base or "skipped" in base else \
                        line["peak_rss_anon_gb"] - base["peak_rss_anon_gb"]
                    if size == args.baseline:
                        compared = "(baseline)"
                    else:
                        compared = "" if difference is None else f"{round(difference, 2) + 0.0:+.2f}"
                    cells += [_number(line["time_to_first_step_s"], 1), _number(line["peak_rss_anon_gb"], 2),
                              compared]
                out.append("| " + " | ".join(cells) + " |")
    notes = [f"Machine: {os.cpu_count()} cores, MemTotal {mem_total() / GB:.1f} GB. Tiny network at 256x256 "
             f"(16 channels, mult 1,1,1,1,1,1, batch 8), --data_workers {args.data_workers} (new code); with 2 "
             "processes: two runs started together, the slower run's time to first step and the sum of both "
             "runs' peaks. Prepare: --image_size 256" + (f" --workers {args.prepare_workers}"
                                                          if args.prepare_workers is not None else
                                                          " (a decode worker per core)") + ". GB = 10^9 bytes."]
    files = ", ".join(f"{size:,}: {prepares[size]['file_gb']:.2f} GB" for size in sizes
                      if "file_gb" in prepares.get(size, {}))
    if files:
        notes.append(f"Prepared files ({IMAGE_BYTES:,} bytes an image): {files}.")
    rates = [decodes[size]["images_per_s"] for size in sizes if size in decodes]
    if rates:
        rate = float(np.median(rates))
        needed = BATCH * args.gpu_steps_per_s
        notes.append("Decoding (one process, batches of 64 random images of the streamed folder: read, JPEG "
                     "decode, centre crop of the 341x256 images to 256x256, no resize as the short side is already "
                     "256): " + ", ".join(f"{size:,} images: {decodes[size]['images_per_s']:,.0f} img/s"
                                              for size in sizes if size in decodes) + ".")
        notes.append(f"On paper: the paper's 256x256 step takes batch {BATCH}; at an ASSUMED {args.gpu_steps_per_s:g} "
                     f"steps/s on one GPU (--gpu_steps_per_s, not a measurement) it needs {BATCH} x "
                     f"{args.gpu_steps_per_s:g} = {needed:,.0f} img/s; one decode worker gives {rate:,.0f} img/s "
                     f"(median above), so a streamed folder needs ceil({needed:,.0f} / {rate:,.0f}) = "
                     f"{math.ceil(needed / rate)} decode worker(s) (--data_workers), each with a core of its own. "
                     "A prepared file needs no decoding: a worker only copies the batch out of the memory map "
                     "(and flips and converts it to float).")
    return "\n".join(out) + "\n\n" + "\n\n".join(notes)


# ---------------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None,
                        help="Comma-separated dataset sizes in images (default: 10000,40000,126227; --quick: 300,600).")
    parser.add_argument("--baseline", type=int, default=None,
                        help="The size every row's peak memory is compared with, run too when not in --sizes "
                             "(default 1000; --quick: 300).")
    parser.add_argument("--quick", action="store_true",
                        help="Sizes 300 and 600, baseline 300, 3 s of decoding: a few minutes, to check the script.")
    parser.add_argument("--workdir", default="/tmp/data_scale",
                        help="Where the synthetic images (kept and reused), prepared files, logdirs and the "
                             "flagfile go.")
    parser.add_argument("--base_worktree", default="/tmp/megdiffusion-base",
                        help=f"A git worktree of {BASE_COMMIT} (the code before), added when missing.")
    parser.add_argument("--feeds", default="before,prepared,streamed",
                        help="Which feeds to train with: before (in-RAM folder, the old code), prepared, streamed.")
    parser.add_argument("--data_workers", type=int, default=1,
                        help="--data_workers of the new code's training runs (training's default: 1).")
    parser.add_argument("--prepare_workers", type=int, default=None,
                        help="--workers of scripts.prepare (default: its own, one per core).")
    parser.add_argument("--image_workers", type=int, default=os.cpu_count() or 1,
                        help="Processes that write the synthetic images (default: one per core).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the synthetic images and of the decode "
                                                            "benchmark's indices.")
    parser.add_argument("--decode_seconds", type=float, default=None,
                        help="Seconds of the one-process decode-rate measurement per size (default 10; --quick: 3).")
    parser.add_argument("--gpu_steps_per_s", type=float, default=2.0,
                        help="ASSUMED training steps/s of the paper's 256x256 model (batch 64) on one GPU, for the "
                             "on-paper images/s it needs (default 2.0, an assumption for an A100, not a measurement).")
    parser.add_argument("--poll", type=float, default=0.05, help="Seconds between memory polls.")
    parser.add_argument("--timeout", type=float, default=4 * 3600,
                        help="Seconds after which a run (prepare or training) counts as failed and is killed.")
    parser.add_argument("--keep_prepared", action="store_true", help="Keep the prepared files (24.8 GB at 126,227).")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in (args.sizes or ("300,600" if args.quick else "10000,40000,126227")).split(",")]
    if args.baseline is None:
        args.baseline = 300 if args.quick else 1000
    if args.decode_seconds is None:
        args.decode_seconds = 3.0 if args.quick else 10.0
    feeds = {"before": FEEDS[0], "prepared": FEEDS[1], "streamed": FEEDS[2]}
    unknown = [f for f in args.feeds.split(",") if f not in feeds]
    if unknown or min(args.sizes + [args.baseline]) < 8:
        parser.error(f"unknown --feeds {unknown}" if unknown else "every size must be at least the batch, 8")
    args.feeds = [feeds[f] for f in args.feeds.split(",")]
    args.workdir = os.path.abspath(args.workdir)
    return args


def measure_size(args, size, folder, dest, ram):
    """Every line of one size: prepare, the decode rate, then each feed's training rows."""
    prepared = prepare(args, size, folder, dest)
    lines = [prepared, decode_rate(args, size, folder)]
    for feed in args.feeds:
        if feed == FEEDS[0]:
            lines.append(cannot_fit(size, ram) or train(args, size, feed, 1, folder))
        elif feed == FEEDS[1] and "error" in prepared:
            lines.append({"kind": "train", "size": size, "feed": feed, "processes": 1,
                          "error": f"prepare failed: {prepared['error']}"})
        else:
            for processes in (1, 2):
                lines.append(train(args, size, feed, processes, dest if feed == FEEDS[1] else folder))
    return lines


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    atexit.register(_stop_all)
    sizes = sorted(set(args.sizes + [args.baseline]))
    os.makedirs(args.workdir, exist_ok=True)
    lock = open(os.path.join(args.workdir, ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # two benchmarks on one workdir would share logdirs
    except BlockingIOError:
        sys.exit(f"another data_scale.py is running on {args.workdir}; wait for it or give another --workdir")
    args.flagfile = os.path.join(args.workdir, "tiny256.cfg")
    with open(args.flagfile, "w") as f:
        f.write(TINY_FLAGS)
    if FEEDS[0] in args.feeds:
        base_worktree(args.base_worktree)
    ram = mem_total()
    pool = os.path.join(args.workdir, f"images-seed{args.seed}")
    sets = os.path.join(args.workdir, f"sets-seed{args.seed}")
    written, seconds = make_pool(pool, args.seed, max(sizes), args.image_workers)
    emit({"kind": "images", "count": max(sizes), "written": written, "seconds": round(seconds, 2),
          "folder": pool, "width": WIDTH, "height": HEIGHT})
    lines = []
    try:
        smallest = make_set(sets, pool, sizes[0])
        warm = [FEEDS[0]] if FEEDS[0] in args.feeds else []
        warm += [FEEDS[2]] if set(args.feeds) - {FEEDS[0]} else []
        for feed in warm:  # untimed: the first run of a code tree compiles its .pyc files and numba's kernels
            line = train(args, sizes[0], feed, 1, smallest, kind="warmup")
            if "error" in line:
                sys.exit(f"the warm-up run of {feed} failed: {line['error']}")
        for size in sizes:
            folder = make_set(sets, pool, size)
            dest = os.path.join(args.workdir, f"prepared-{size}.mdds")
            try:
                lines += measure_size(args, size, folder, dest, ram)
            finally:
                if not args.keep_prepared and os.path.exists(dest):
                    os.remove(dest)
    finally:
        _stop_all()
        shutil.rmtree(os.path.join(args.workdir, "runs"), ignore_errors=True)
    print()
    print(table(args, sizes, lines))


if __name__ == "__main__":
    main()
