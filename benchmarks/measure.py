"""Peak memory and profiler arithmetic for one run of one variant.

Memory on CPU is the process's resident set: `reset_peak` releases what Python and malloc hold
free (gc, `malloc_trim`), resets the kernel's high-water mark (`/proc/self/clear_refs` = 5) and
returns the RSS then; `peak` reads the high-water mark (VmHWM) back. The difference is the run's peak
growth. On CUDA the same pair uses the caching allocator's allocated-bytes counters.
"""

from __future__ import annotations

import ctypes
import gc
import re
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["AgreementClock", "ProfileSummary", "peak", "reset_peak", "summarize_profile", "tensor_peak_bytes"]

_STATUS = Path("/proc/self/status")
# "pipeline::forward#12" and torchrec's "## forward 12 ##" both name stage "forward" of batch 12.
_INDEX_SUFFIX = re.compile(r"(#\d+$)|(\s+\d+\s*##$)|(\s*##$)")


def reset_peak(device: torch.device) -> int:
    """Free what can be freed, restart peak tracking and return current memory in bytes."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    _malloc_trim()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def peak(device: torch.device) -> int:
    """Peak memory in bytes since the last `reset_peak`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_kb("VmHWM") * 1024


def _status_kb(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no {key} in {_STATUS}: cannot measure memory on this system")
    return int(match.group(1))


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: freed memory may stay resident (a bigger baseline)
        pass


@dataclass(kw_only=True, slots=True)
class ProfileSummary:
    """What one profiled segment says, per step."""

    wait_in_forward_ms: float
    """Time inside the forward label spent under the input_dist wait label, per step."""
    assembly_in_wait_ms: float
    """Of `wait_in_forward_ms`, the time torchrec spends reordering the received ids into the
    output KJT (its `## dist_init:recat_values ##` label): CPU work, not waiting on the network."""
    forward_ms: float
    """Time under the forward label, per step."""
    labels_ms: dict[str, float]
    """Every `pipeline::`, `bench::` and torchrec `## ... ##` label on the forward's thread, with its
    batch index removed, to its total time per step (nested labels count in each parent)."""


def summarize_profile(
    events: Iterable[Any], *, forward_label: str, wait_label: str, steps: int
) -> ProfileSummary:
    """Sum the wait labels contained in forward labels on the same thread.

    Args:
        events: `torch.profiler.profile(...).events()`; each has `name`, `thread` and `time_range`
            (microseconds).
        forward_label: prefix of the label around forward.
        wait_label: prefix of the input_dist wait label.
        steps: steps the segment ran, to turn totals into per-step figures.
    """
    events = [e for e in events if _is_label(e.name)]
    forwards = [e for e in events if e.name.startswith(forward_label)]
    threads = {e.thread for e in forwards}
    per_thread: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for f in forwards:
        per_thread[f.thread].append((f.time_range.start, f.time_range.end))
    waited = 0.0
    labels: dict[str, float] = defaultdict(float)
    waits: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.thread not in threads:
            continue
        start, end = e.time_range.start, e.time_range.end
        labels[_INDEX_SUFFIX.sub("", e.name)] += (end - start) / 1e3
        if e.name.startswith(wait_label) and any(s <= start and end <= t for s, t in per_thread[e.thread]):
            waited += (end - start) / 1e3
            waits[e.thread].append((start, end))
    assembly = sum(
        (e.time_range.end - e.time_range.start) / 1e3
        for e in events
        if e.name == _ASSEMBLY_LABEL
        and any(s <= e.time_range.start and e.time_range.end <= t for s, t in waits[e.thread])
    )
    forward_ms = sum(t - s for spans in per_thread.values() for s, t in spans) / 1e3
    return ProfileSummary(
        wait_in_forward_ms=waited / steps,
        assembly_in_wait_ms=assembly / steps,
        forward_ms=forward_ms / steps,
        labels_ms={k: v / steps for k, v in sorted(labels.items())},
    )


def tensor_peak_bytes(prof: Any, device: torch.device) -> int:
    """Peak bytes of tensors on `device` allocated during a `profile(profile_memory=True)` segment
    and alive at the same time.

    The profiler logs each allocation (+bytes) and each free of a block it saw allocated (-bytes);
    the result is the maximum of their running sum. Unlike RSS it ignores what the allocator keeps
    cached: the CPU counterpart of CUDA's max allocated. Everything a step creates, in-flight
    batches included, is freed within a few steps, so over a segment of several steps the figure is
    the steady-state peak minus the long-lived state (weights, optimizer state, the batches in
    memory), which is the same for every variant.
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


_ASSEMBLY_LABEL = "## dist_init:recat_values ##"


def _is_label(name: str) -> bool:
    return name.startswith(("pipeline::", "bench::", "## "))


class AgreementClock:
    """Seconds this process spends on its calling thread inside the ranks' agreement
    (`pipeline.ranks`: key and KJT checks, store flags, votes), summed over every call.

    The with/without A/B of `benchmarks.agreement` cannot resolve 1 % on a VM whose rounds differ by
    10-30 %; this direct figure can. `install()` wraps the agreement's entry points once per process
    (a wrapper costs well under a microsecond); work the agreement leaves to its own threads (the
    store read ahead) is not counted, as it delays no step unless its result is waited for, which is
    counted.
    """

    seconds = 0.0
    kjt_seconds = 0.0
    """Of `seconds`, those in the KJT check (`KJTCheck.check`)..."""
    kjt_calls = 0
    """... and how many batches it checked."""

    @classmethod
    def install(cls) -> None:
        from pipeline import ranks

        targets = {
            ranks.KeyCheck: ("check",),
            ranks.KJTCheck: ("check",),
            ranks.StoreFlags: ("raise_flag", "statuses", "read_in_background"),
            ranks.Votes: ("vote",),
            ranks.Vote: ("wait",),
        }
        for owner, names in targets.items():
            for name in names:
                method = getattr(owner, name, None)
                if method is not None and not getattr(method, "_clocked", False):
                    setattr(owner, name, cls._clocked(method))

    @classmethod
    def _clocked(cls, method: Any) -> Any:
        kjt = method.__qualname__ == "KJTCheck.check"

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                cls.seconds += took
                if kjt:
                    cls.kjt_seconds += took
                    cls.kjt_calls += 1

        timed._clocked = True  # type: ignore[attr-defined]
        return timed
