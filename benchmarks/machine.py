"""Which processor a benchmark ran on, precisely enough to compare figures across machines.

Cloud machines often report a bare "AMD EPYC" or an empty ``platform.processor()``,
yet two such machines can differ by a generation: the ingest's speed-up over the
naive Pillow loop at 2 MP was 2.9x on one EPYC and 2.6x on a Zen 5 one (family 26),
because the newer core speeds up the naive loop's full decode and resize more
than it speeds up entropy decoding. The CPU family, model and vector extensions
tell such machines apart.
"""
from __future__ import annotations

import os
import platform

_FLAGS = ("avx2", "avx512f", "avx512_vnni", "sha_ni", "bmi2")


def cpu() -> dict:
    """Vendor, model name, family/model and the vector extensions that matter to image codecs."""
    info = {"arch": platform.machine(), "name": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:  # not Linux
        return info
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in first.splitlines()) if k.strip()
    )
    flags = set(fields.get("flags", "").split())
    info.update({
        "name": fields.get("model name", info["name"]),
        "vendor": fields.get("vendor_id"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "flags": [f for f in _FLAGS if f in flags],
    })
    return info


def busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot, every process counted (``/proc/stat``:
    all but idle and iowait); None off Linux. A difference of two readings on a quiet machine is what
    a stretch of work cost, its child processes and Ray's workers included."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def describe() -> dict:
    """The ``machine`` object of a benchmark's JSON line."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu(), "cores": os.cpu_count(), "load_avg_1m": load, "python": platform.python_version()}
