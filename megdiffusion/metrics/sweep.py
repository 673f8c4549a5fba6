"""The post-hoc EMA sweep: the scores of the EMA lengths ``scripts.posthoc_ema`` rebuilt, against sigma_rel, as a
table (``sweep.json``) and a chart (``sweep.png``, like EDM2's Figure 5) with the tracked profiles marked."""
import glob
import json
import os
import re

import numpy as np
from PIL import Image, ImageDraw

from megdiffusion.files.disk import atomic_write
from megdiffusion.files.images import save_png

REBUILT = re.compile(r"^ema_(\d+\.\d+)\.pkl$")  # checkpoint.rebuilt_path's files
CHARTED = ("fid", "kid")  # what the chart plots, one panel each, of the scores a sweep has


def rebuilt_lengths(directory):
    """``[(sigma_rel, path)]`` of the rebuilt EMA checkpoints in ``directory``, shortest first."""
    found = [(float(m.group(1)), path) for path in glob.glob(os.path.join(glob.escape(directory), "ema_*.pkl"))
             if (m := REBUILT.match(os.path.basename(path)))]
    return sorted(found)


def write_sweep(directory, rows, tracked, label):
    """``directory``/sweep.json (``rows``: {"sigma_rel", scores...} each, with the ``tracked`` profiles and the
    sampler ``label``) and sweep.png; returns their paths."""
    table = os.path.join(directory, "sweep.json")
    with atomic_write(table, "w") as f:
        json.dump({"tracked_sigma_rel": list(tracked), "sampler": label, "rows": rows}, f, indent=1)
    panels = [name for name in CHARTED if all(name in row for row in rows)]
    picture = os.path.join(directory, "sweep.png")
    save_png(picture, np.concatenate([chart([row["sigma_rel"] for row in rows], [row[name] for row in rows], tracked,
                                            f"{name.upper()} against the EMA length ({label})", name.upper())
                                      for name in panels], axis=0))
    return table, picture


def _ticks(low, high, count=5):
    """About ``count`` round values covering [low, high]."""
    span = high - low or abs(high) or 1.0
    step = 10 ** np.floor(np.log10(span / count))
    step *= min((m for m in (1, 2, 5, 10) if span / (step * m) <= count), default=10)
    return np.arange(np.floor(low / step) * step, high + step / 2, step)


def chart(xs, ys, marks, title, y_label, size=(640, 360)):
    """A line chart of ``ys`` against ``xs`` (sigma_rel) with dashed lines at ``marks`` (the tracked profiles), as a
    uint8 RGB image."""
    width, height = size
    left, right, top, bottom = 64, 20, 30, 44
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    x_ticks = _ticks(min(list(xs) + list(marks)), max(list(xs) + list(marks)))
    y_ticks = _ticks(min(ys), max(ys))
    x_range, y_range = (x_ticks[0], x_ticks[-1]), (y_ticks[0], y_ticks[-1])

    def at(x, y):
        u = (x - x_range[0]) / ((x_range[1] - x_range[0]) or 1)
        v = (y - y_range[0]) / ((y_range[1] - y_range[0]) or 1)
        return left + u * (width - left - right), height - bottom - v * (height - top - bottom)

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for x in x_ticks:
        px, py = at(x, y_range[0])
        draw.line([px, py, px, py + 4], fill="black")
        draw.text((px - 12, py + 6), f"{x:.3g}", fill="black")
    for y in y_ticks:
        px, py = at(x_range[0], y)
        draw.line([px - 4, py, px, py], fill="black")
        draw.text((6, py - 6), f"{y:.4g}", fill="black")
    for mark in marks:  # the tracked profiles, dashed
        px, _ = at(mark, 0)
        for start in range(top, height - bottom, 8):
            draw.line([px, start, px, min(start + 4, height - bottom)], fill=(200, 120, 0))
        draw.text((px + 3, top + 2), "tracked", fill=(200, 120, 0))
    points = [at(x, y) for x, y in zip(xs, ys)]
    draw.line(points, fill=(0, 70, 160), width=2)
    best = int(np.argmin(ys))
    for i, (px, py) in enumerate(points):
        colour = (200, 0, 0) if i == best else (0, 70, 160)
        draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
    draw.text((left, 8), f"{title}; best sigma_rel {xs[best]:g}", fill="black")
    draw.text((width // 2 - 30, height - 18), "sigma_rel", fill="black")
    draw.text((6, top - 16), y_label, fill="black")
    return np.asarray(image)
