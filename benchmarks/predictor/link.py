"""The link between ranks as the cost model sees it (`Link`), from a name such as `1gbit` or
`25gbit:10us`, or measured by a short probe of all-to-alls over a live process group.

An all-to-all in which every rank sends `b` bytes to each of its `W - 1` peers takes, on every rank,

    call + (W - 2) * latency + transfer((W - 1) * b)

(`alltoall_seconds`): a fixed host cost per call (the machine's, `MachineCosts.a2a_call`), one
message latency per peer beyond the first (gloo sends to its peers one after the other), and the
time the bytes that leave the rank take at the rank's own bandwidth, the first message's latency
included (`Link.transfer`). Bytes a rank keeps for itself do not cross the link. A named link's
transfer is `latency + bytes / bandwidth`; a probed link's is the measured curve (interpolated
between the sizes probed, extended by its last slope): shaped and real links are not linear (a
token bucket lets a burst through at once; TCP over a deep queue slows large transfers both ways
share), and the curve keeps what the probe saw.
"""

from __future__ import annotations

import bisect
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Link", "alltoall_seconds", "link_from_curve", "parse_link", "probe_link", "time_alltoalls"]

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_NAME = re.compile(r"(\d+(?:\.\d+)?)([a-z]+)(?::(\d+(?:\.\d+)?)([a-z]+))?")


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """Each rank's connection to the others."""

    name: str
    """What it was made from (`1gbit`, `loopback`, `probe`), for tables and plots."""
    bandwidth: float
    """Bytes per second each rank sends (and receives) at once, to all its peers together."""
    latency: float
    """Seconds one message to one peer costs beyond its bytes (the per-peer cost of an all-to-all)."""
    cpu_per_byte: float
    """Host CPU seconds each byte sent costs its rank (the TCP copies); on loopback this is what
    bounds the transfer, and it competes with compute for the rank's cores."""
    curve: tuple[tuple[float, float], ...] = field(default=())
    """Measured (bytes sent, seconds) of one transfer to one peer, ascending; empty for a named link."""

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency >= 0 and self.cpu_per_byte >= 0):
            raise ValueError(f"a link needs bandwidth > 0 and latency, cpu_per_byte >= 0; got {self}")

    def transfer(self, nbytes: float) -> float:
        """Seconds `nbytes` take to leave a rank, one message's latency included."""
        if not self.curve:
            return self.latency + nbytes / self.bandwidth
        sizes = [s for s, _ in self.curve]
        i = min(max(bisect.bisect_left(sizes, nbytes), 1), len(sizes) - 1)
        (s0, t0), (s1, t1) = self.curve[i - 1], self.curve[i]
        slope = (t1 - t0) / (s1 - s0) if s1 > s0 else 1.0 / self.bandwidth
        return max(t0 + (nbytes - s0) * max(slope, 0.0), 0.0)

    def cpu_share(self) -> float:
        """Fraction of a core a transfer at full rate keeps busy (at most 1)."""
        return min(1.0, self.cpu_per_byte * self.bandwidth)


def alltoall_seconds(link: Link, *, call: float, peers: int, bytes_per_peer: float) -> float:
    """Seconds of one all-to-all on one rank (module docstring); the host part (`call`) included."""
    if peers <= 0:
        return call
    return call + (peers - 1) * link.latency + link.transfer(peers * bytes_per_peer)


def parse_link(text: str, *, loopback: Link) -> Link:
    """A `Link` from a name: `loopback` (the machine's measured one), or a rate such as `1gbit`,
    `100mbit`, `25gbit`, optionally with a per-message latency, `25gbit:10us`.

    A rate without a latency takes the loopback's; the CPU cost per byte is always the loopback's
    (TCP copies on this machine).

    Raises:
        ValueError: not a link name; the message shows the accepted forms.
    """
    if text == "loopback":
        return loopback
    match = _NAME.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _RATE_UNITS or (match.group(4) or "s") not in _TIME_UNITS:
        raise ValueError(
            f"not a link: {text!r}; write loopback, a rate (1gbit, 100mbit) or rate:latency (25gbit:10us)"
        )
    bandwidth = float(match.group(1)) * _RATE_UNITS[match.group(2)] / 8
    latency = loopback.latency
    if match.group(3) is not None:
        latency = float(match.group(3)) * _TIME_UNITS[match.group(4)]
    return replace(loopback, name=text, bandwidth=bandwidth, latency=latency, curve=())


def probe_link(
    group: Any = None, *, cpu_per_byte: float, call: float, budget_s: float = 2.0, max_bytes: int = 8 << 20
) -> Link:
    """Measure the `Link` of `group` by all-to-alls of growing size (a collective call: every rank
    of the group calls it with the same arguments, and every rank gets the same `Link`).

    Args:
        group: the process group (None: the default one).
        cpu_per_byte: the machine's TCP cost per byte (kept as is: a probe cannot separate it).
        call: the machine's host cost of one all-to-all call, seconds (taken out of the curve).
        budget_s: a rough cap on the probe's time.
        max_bytes: the largest message per peer.

    Raises:
        ValueError: the group has one rank (no byte crosses a link).
    """
    world = dist.get_world_size(group)

    def all_to_all(send: torch.Tensor, recv: torch.Tensor) -> None:
        dist.all_to_all_single(recv, send, group=group)

    def agree(values: list[float]) -> list[float]:
        summed = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(summed, group=group)
        return [v / world for v in summed.tolist()]

    sizes, seconds = time_alltoalls(
        all_to_all, lambda: dist.barrier(group), agree, world, budget_s=budget_s, max_bytes=max_bytes
    )
    return link_from_curve("probe", sizes, [t - call for t in seconds], world - 1, cpu_per_byte)


def link_from_curve(
    name: str, sizes: list[int], seconds: list[float], peers: int, cpu_per_byte: float
) -> Link:
    """A `Link` from all-to-all times (host call cost taken out) at `sizes` bytes per peer: the
    latency of the smallest, the slope of the two largest as its bandwidth, the curve per peer."""
    total = [peers * s for s in sizes]
    per_message = max(seconds[0], 0.0) / max(peers, 1)
    curve = tuple((b, max(t - (peers - 1) * per_message, 0.0)) for b, t in zip(total, seconds, strict=True))
    rise = curve[-1][1] - curve[-2][1] if len(curve) > 1 else 0.0
    bandwidth = (curve[-1][0] - curve[-2][0]) / rise if rise > 0 else 1e12
    return Link(name=name, bandwidth=bandwidth, latency=per_message, cpu_per_byte=cpu_per_byte, curve=curve)


def time_alltoalls(
    all_to_all: Callable[[torch.Tensor, torch.Tensor], None],
    barrier: Callable[[], None],
    agree: Callable[[list[float]], list[float]],
    world: int,
    *,
    budget_s: float,
    max_bytes: int,
) -> tuple[list[int], list[float]]:
    """Median seconds of all-to-alls of growing size: bytes per peer 0, then 4 KiB growing 2x,
    until one takes a tenth of `budget_s` or reaches `max_bytes`; 5 runs each, after a barrier.
    `agree` averages a list of floats over the ranks: every rank stops at the same size and
    returns the same figures.

    Returns:
        (bytes per peer, median seconds averaged over the ranks) per size.

    Raises:
        ValueError: `world` < 2.
    """
    if world < 2:
        raise ValueError("probing a link needs at least 2 ranks; at 1 rank no byte crosses a link")
    sizes, times, size = [], [], 0
    while True:
        send = torch.zeros(world * (size // 4), dtype=torch.float32)
        recv = torch.empty_like(send)
        all_to_all(send, recv)  # the first call of a size sets up buffers
        runs = []
        for _ in range(5):
            barrier()
            start = time.perf_counter()
            all_to_all(send, recv)
            runs.append(time.perf_counter() - start)
        sizes.append(size)
        times.append(agree([statistics.median(runs)])[0])
        if times[-1] > budget_s / 10 or size >= max_bytes:
            return sizes, times
        size = max(4096, size * 2)
