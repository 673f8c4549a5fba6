"""How both sides of ``vs_pytorch.py`` time a model, and the JSON line of one measurement (standard library only:
the PyTorch twin imports it too)."""
import os
import time


def cpu_seconds():
    """CPU seconds so far of this process's threads and of its live child processes (megdiffusion's worker
    processes, ``megdiffusion.cpu.group_workers``), from /proc where there is one."""
    total = time.process_time()
    me = str(os.getpid())
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or it ended meanwhile
            continue
        if fields[1] == me:  # the parent pid; utime and stime follow at fields 11 and 12
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def timed(fn, repeats):
    """(wall seconds, CPU seconds of this process and its children, last result) of ``repeats`` calls of ``fn``."""
    start, start_cpu = time.perf_counter(), cpu_seconds()
    for _ in range(repeats):
        result = fn()
    return time.perf_counter() - start, cpu_seconds() - start_cpu, result


def line(args, side, mode, seconds, cpu_seconds, images, **extra):
    """The JSON-ready dict of one timed run of ``args.model`` (round ``args.round``), with the 1-minute load."""
    return {"model": args.model, "mode": mode, "side": side, "round": args.round, "images": images,
            "seconds": round(seconds, 4), "cpu_seconds": round(cpu_seconds, 4),
            "images_per_s": round(images / seconds, 3), "images_per_cpu_s": round(images / cpu_seconds, 3),
            **extra, "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 2)}


def training(args, side, step, batch, engine):
    """``args.warmup`` untimed calls of ``step`` (one training step on a batch of ``batch`` images, returning its
    metrics), then ``args.steps`` timed ones; ``engine``: what ran them, for the line."""
    for _ in range(args.warmup):
        step()
    seconds, cpu, metrics = timed(step, args.steps)
    return line(args, side, "train", seconds, cpu, args.steps * batch, batch=batch, steps=args.steps,
                warmup=args.warmup, loss=round(metrics["loss"], 6), **engine)


def sampling(args, side, sample, engine, sampler="ddim"):
    """One timed call of ``sample`` (``args.sample_steps`` network calls per image of ``args.batch`` images by
    ``sampler``, after the caller's untimed forward at that batch)."""
    seconds, cpu, _ = timed(sample, 1)
    return line(args, side, "ddim", seconds, cpu, args.batch, batch=args.batch, sample_steps=args.sample_steps,
                seconds_per_image=round(seconds / args.batch, 4), sampler=sampler, **engine)
