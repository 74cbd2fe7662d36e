"""What one run measures besides step times: peak memory, the profiled segment's figures, the machine
(and its disk: `read_cost`).

Memory on CPU is the process's resident set: `reset_peak` releases what Python and malloc hold free
(gc, `malloc_trim`), resets the kernel's high-water mark (`/proc/self/clear_refs` = 5) and returns
the RSS then; `peak` reads the high-water mark (VmHWM) back; the difference is the run's peak growth.
On CUDA the pair uses the caching allocator's counters. Step time is wall time (`perf_counter`) per
step; process CPU time (`process_time`: every thread of the process) is the steadier figure on a
shared machine. Nothing here reaches into the library: the figures come from the clock, /proc and
the profiler labels the pipeline emits.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import random
import re
import statistics
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the launcher reads the machine without loading torch
    import torch

__all__ = [
    "InputBytes",
    "ProfileSummary",
    "cpu_busy",
    "machine",
    "peak",
    "peak_rss_bytes",
    "read_cost",
    "read_cost_line",
    "reset_peak",
    "summarize_profile",
    "tensor_peak_bytes",
]

_STATUS = Path("/proc/self/status")
_PAGE = 4096
# "pipeline::forward#12" and torchrec's "## forward 12 ##" both name stage "forward" of batch 12.
_INDEX_SUFFIX = re.compile(r"(#\d+$)|(\s+\d+\s*##$)|(\s*##$)")
_ASSEMBLY = "## dist_init:recat_values ##"
"""torchrec's reordering of the received ids into the output KJT: CPU work inside the wait."""


def reset_peak(device: torch.device) -> int:
    """Free what can be freed, restart peak tracking and return the current memory in bytes."""
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed memory may stay resident (a bigger baseline)
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def peak(device: torch.device) -> int:
    """Peak memory in bytes since the last `reset_peak`."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), in bytes."""
    return _status_kb("VmHWM") * 1024


def _status_kb(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no {key} in {_STATUS}: cannot measure memory on this system")
    return int(match.group(1))


@dataclass(kw_only=True, slots=True)
class ProfileSummary:
    """What one profiled segment says, per step."""

    wait_in_forward_ms: float
    """Time under the wait label nested in the forward label on the same thread."""
    assembly_in_wait_ms: float
    """Of it, torchrec's reordering of the received ids (CPU work, not waiting on the network)."""
    forward_ms: float
    """Time under the forward label."""
    labels_ms: dict[str, float]
    """Every `pipeline::`, `bench::` and torchrec `## ... ##` label on forward's thread, batch index
    removed, to its time (nested labels count in each parent)."""


def summarize_profile(
    events: Iterable[Any], *, forward_label: str, wait_label: str, steps: int
) -> ProfileSummary:
    """Sum the wait labels contained in forward labels on the same thread, per step.

    Args:
        events: `torch.profiler.profile(...).events()`: each has `name`, `thread` and `time_range`
            (microseconds).
        forward_label: prefix of the label around forward.
        wait_label: prefix of the input_dist wait label.
        steps: steps the segment ran.
    """
    events = [e for e in events if e.name.startswith(("pipeline::", "bench::", "## "))]
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.name.startswith(forward_label):
            spans[e.thread].append((e.time_range.start, e.time_range.end))
    labels: dict[str, float] = defaultdict(float)
    waits: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in (e for e in events if e.thread in spans):
        start, end = e.time_range.start, e.time_range.end
        labels[_INDEX_SUFFIX.sub("", e.name)] += (end - start) / 1e3
        if e.name.startswith(wait_label) and _inside(start, end, spans[e.thread]):
            waits[e.thread].append((start, end))
    assembly = [e for e in events if e.name == _ASSEMBLY and _inside(*_span(e), waits[e.thread])]
    return ProfileSummary(
        wait_in_forward_ms=sum(t - s for w in waits.values() for s, t in w) / 1e3 / steps,
        assembly_in_wait_ms=sum(t - s for s, t in map(_span, assembly)) / 1e3 / steps,
        forward_ms=sum(t - s for w in spans.values() for s, t in w) / 1e3 / steps,
        labels_ms={k: v / steps for k, v in sorted(labels.items())},
    )


def _span(e: Any) -> tuple[float, float]:
    return e.time_range.start, e.time_range.end


def _inside(start: float, end: float, spans: list[tuple[float, float]]) -> bool:
    return any(s <= start and end <= t for s, t in spans)


def tensor_peak_bytes(prof: Any, device: torch.device) -> int:
    """Peak bytes of tensors on `device` allocated during a `profile(profile_memory=True)` segment and
    alive at the same time: the running sum of the profiler's allocation (+) and free (-) records.
    Unlike RSS it ignores what the allocator keeps cached: the CPU counterpart of CUDA's max allocated.
    """
    kind = "CUDA" if device.type == "cuda" else "CPU"
    changes = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).endswith(kind)
    )
    live = top = 0
    for _, nbytes in changes:
        live += nbytes
        top = max(top, live)
    return top


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of all CPUs' time spent busy over the next `interval` seconds (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)  # idle and iowait are not busy

    busy0, total0 = sample()
    time.sleep(interval)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def machine() -> str:
    """The CPU model, cores, kernel and the library versions, for a report's header."""
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    versions = []
    for package in ("torch", "torchrec", "fbgemm-gpu-cpu", "fbgemm-gpu"):
        try:
            versions.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            pass
    return f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}; {', '.join(versions)}"


def read_cost(directory: str, *, megabytes: int = 64, reads: int = 2000, seed: int = 0) -> dict[str, float]:
    """What a read from disk costs where the stores live, so that a figure with tables on disk is read
    with its machine: `wall_us` and `cpu_us` (this process's) per 4 KiB read at a random offset of a
    file just written and dropped from the page cache (as the benchmarks' cold stores are), medians
    over `reads` reads."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".read-cost-{os.getpid()}")
    pages = megabytes * (1 << 20) // _PAGE
    try:
        with open(path, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(megabytes):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold, as the stores are
            offsets = random.Random(seed).sample(range(pages), min(reads, pages))
            wall, cpu = [], []
            for page in offsets:
                w, c = time.perf_counter(), time.process_time()
                os.pread(fd, _PAGE, page * _PAGE)
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - w)
        finally:
            os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return {"wall_us": statistics.median(wall) * 1e6, "cpu_us": statistics.median(cpu) * 1e6}


def read_cost_line(directory: str) -> str:
    """One line for a report's notes."""
    cost = read_cost(directory)
    return (
        f"Disk, measured at the start in the stores' folder: a cold 4 KiB read at a random offset takes "
        f"{cost['wall_us']:.0f} us ({cost['cpu_us']:.0f} us of CPU), median of 2,000."
    )


def commit() -> str:
    """The commit the benchmark ran (its short hash), and whether the tree differed from it."""

    def git(*argv: str) -> str:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "--short=12", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head} ({'with uncommitted changes' if changed else 'clean tree'})"


class InputBytes:
    """Bytes handed to torchrec's KJT values all-to-alls (ids, lengths, weights; this rank's own share
    included) per step, while in the `with` block: `step()` after each step, `per_batch()` the
    median of the later half of the steps, where each step starts one batch's all-to-alls (ours and
    torchrec's loops alike; the first steps also fill the pipeline)."""

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._now = 0

    def __enter__(self) -> InputBytes:
        from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable

        self._class, self._original = KJTAllToAllTensorsAwaitable, KJTAllToAllTensorsAwaitable.__init__
        original, counter = self._original, self

        def counting(awaitable: Any, *args: Any, **kwargs: Any) -> None:
            counter._now += sum(t.numel() * t.element_size() for t in kwargs.get("input_tensors", []))
            original(awaitable, *args, **kwargs)

        self._class.__init__ = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        self._class.__init__ = self._original

    def step(self) -> None:
        self._steps.append(self._now)
        self._now = 0

    def per_batch(self) -> int | None:
        """None under 4 steps."""
        later = sorted(self._steps[len(self._steps) // 2 :])
        return later[len(later) // 2] if len(self._steps) >= 4 else None
