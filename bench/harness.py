"""Timing, machine description and table/JSON output shared by every benchmark."""
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from wse_core.errors import ConfigError


def numbers(text, flag, kind=int):
    """The comma-separated numbers of an option (``--num_csx 1,2,4``); a ConfigError naming ``flag`` when
    one is not a number, so `wse bench` says it in one line rather than int()'s bare ValueError."""
    try:
        return [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected numbers separated by commas, got {text!r}") from None


def machine():
    """What the figures were measured on."""
    from wse_core import openmp_info

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel_threads": openmp_info()["max_threads"],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


def seconds(fn, repeats, warmup=2):
    """Wall times of ``repeats`` calls of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn, repeats, warmup=2):
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls."""
    return statistics.median(seconds(fn, repeats, warmup))


def table(rows, headers):
    """Format rows (lists of cells) as an aligned plain-text table."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(result, path):
    """Write ``result`` to ``path`` ("-" for stdout)."""
    text = json.dumps(result, indent=2, sort_keys=True)
    if str(path) == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(path).write_text(text + "\n")
