"""Device-kernel profiles of a jitted call: what the GPU ran, how long, and the gaps.

``profile_calls(fn, args_list)`` runs ``fn(*args)`` once per entry of ``args_list``
(rotate the inputs to keep the L2 cold) with a sync after each, under
``jax.profiler.trace``, and reads the trace back with ``jax.profiler.ProfileData``
(no TensorBoard needed). The device's stream lines hold one event per kernel or
copy; calls are told apart by the host sync between them (a gap far longer than
any gap inside one call).

For each call: ``span`` (first kernel start to last kernel end: the device time of
the call when nothing else runs), ``busy`` (sum of kernel durations, overlaps
merged), and the kernels themselves. :func:`summarize` gives medians over calls.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import statistics
import tempfile
import time
from typing import Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start_ns: float
    dur_ns: float


@dataclasses.dataclass(frozen=True)
class CallProfile:
    kernels: tuple[Kernel, ...]

    @property
    def span_us(self) -> float:
        if not self.kernels:
            return 0.0
        end = max(k.start_ns + k.dur_ns for k in self.kernels)
        return (end - self.kernels[0].start_ns) / 1e3

    @property
    def busy_us(self) -> float:
        total, cur_s, cur_e = 0.0, None, None
        for k in self.kernels:
            s, e = k.start_ns, k.start_ns + k.dur_ns
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total / 1e3


def _trace_file(
    fn: Callable, args_list: Sequence[Sequence], *, warmup: int, logdir: str | None = None, pause_s: float = 0.0
) -> str:
    """Run ``fn(*args)`` for each args under the profiler, a sync (and ``pause_s`` of
    sleep) after each, and return the path of the trace it wrote."""
    for a in list(args_list)[:warmup]:
        jax.block_until_ready(fn(*a))
    logdir = logdir or tempfile.mkdtemp(prefix="jattn_prof_")
    with jax.profiler.trace(logdir):
        for a in args_list:
            jax.block_until_ready(fn(*a))
            if pause_s:
                time.sleep(pause_s)
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"the profiler wrote no .xplane.pb under {logdir}")
    return paths[-1]


Event = tuple  # (start_ns, duration_ns, name)


def trace_events(
    fn: Callable, args: Sequence, *, reps: int = 3, warmup: int = 1, pause_s: float = 0.0
) -> tuple[list[Event], list[Event]]:
    """``reps`` calls of ``fn(*args)`` under the profiler: (host events, device events),
    each a time-sorted list of ``(start_ns, duration_ns, name)`` on one clock. Host events
    are every traced host activity (the runtime's thunks, launches, Python frames);
    device events are the kernels and copies of the device's stream lines."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(_trace_file(fn, [args] * reps, warmup=warmup, pause_s=pause_s))
    host, dev = [], []
    for plane in pd.planes:
        is_host = plane.name.startswith("/host")
        if not is_host and not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if not is_host and not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                (host if is_host else dev).append((float(ev.start_ns), float(ev.duration_ns), ev.name))
    return sorted(host), sorted(dev)


def _device_events(xplane_path: str) -> list[Kernel]:
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(xplane_path)
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            # Stream lines hold the kernels and copies; derived lines ("XLA Ops",
            # "XLA Modules", ...) repeat them at other granularities.
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                out.append(Kernel(ev.name, float(ev.start_ns), float(ev.duration_ns)))
    out.sort(key=lambda k: k.start_ns)
    if not out and any(p.name.startswith("/device:") for p in pd.planes):
        names = {p.name: [l.name for l in p.lines] for p in pd.planes if p.name.startswith("/device:")}
        raise RuntimeError(f"no kernel events on any device stream line; lines seen: {names}")
    return out


def _split_calls(events: list[Kernel], n_calls: int) -> list[CallProfile]:
    """Group kernels into calls at the ``n_calls - 1`` widest gaps between them."""
    if not events:
        return []
    gaps, end = [], events[0].start_ns + events[0].dur_ns
    for i in range(1, len(events)):
        gaps.append((events[i].start_ns - end, i))
        end = max(end, events[i].start_ns + events[i].dur_ns)
    cuts = sorted(i for _, i in sorted(gaps, reverse=True)[: max(0, n_calls - 1)])
    calls, lo = [], 0
    for c in cuts + [len(events)]:
        calls.append(CallProfile(tuple(events[lo:c])))
        lo = c
    return calls


def profile_calls(
    fn: Callable, args_list: Sequence[Sequence], *, warmup: int = 2, logdir: str | None = None
) -> list[CallProfile]:
    """Run ``fn(*args)`` for each args in ``args_list`` under the profiler, one sync each."""
    path = _trace_file(fn, args_list, warmup=warmup, logdir=logdir)
    return _split_calls(_device_events(path), len(args_list))


@dataclasses.dataclass(frozen=True)
class Summary:
    span_us: float  # median over calls
    busy_us: float  # median over calls
    kernels: list[tuple[str, int, float]]  # (name, count per call, median total us per call)

    def table(self, top: int = 12, width: int = 70) -> str:
        lines = [
            f"  device span {self.span_us:8.1f} us/call, kernels busy {self.busy_us:8.1f} us "
            f"({100 * self.busy_us / max(self.span_us, 1e-9):.0f}%), gaps "
            f"{self.span_us - self.busy_us:.1f} us"
        ]
        for name, count, us in self.kernels[:top]:
            lines.append(f"    {us:9.1f} us  x{count:<4d} {name[:width]}")
        if len(self.kernels) > top:
            rest = sum(us for _, _, us in self.kernels[top:])
            lines.append(f"    {rest:9.1f} us  ({len(self.kernels) - top} more kernel names)")
        return "\n".join(lines)


def summarize(calls: Sequence[CallProfile]) -> Summary:
    calls = [c for c in calls if c.kernels]
    if not calls:
        return Summary(0.0, 0.0, [])
    per_name: dict[str, list[tuple[int, float]]] = {}
    for c in calls:
        agg: dict[str, list[float]] = {}
        for k in c.kernels:
            agg.setdefault(k.name, []).append(k.dur_ns / 1e3)
        for name, ds in agg.items():
            per_name.setdefault(name, []).append((len(ds), sum(ds)))
    kernels = []
    for name, vals in per_name.items():
        counts = [v[0] for v in vals] + [0] * (len(calls) - len(vals))
        tots = [v[1] for v in vals] + [0.0] * (len(calls) - len(vals))
        kernels.append((name, int(statistics.median(counts)), statistics.median(tots)))
    kernels.sort(key=lambda t: -t[2])
    return Summary(statistics.median(c.span_us for c in calls), statistics.median(c.busy_us for c in calls), kernels)
