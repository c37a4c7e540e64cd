"""Shared timing utilities for jattn benchmarks (GPU).

Pitfalls these avoid (measured on the H200, see docs/PERF.md):
* one jitted call at a time with ``block_until_ready`` adds ~150 us of host
  dispatch and sync, so many calls run inside ONE jitted function;
* XLA deduplicates identical calls inside one jit, so every call gets
  different inputs (``step(i, ...)`` picks rotation ``i``);
* inputs that fit in the 60 MB L2 measure the cache, so callers rotate over
  data several times larger than L2 (see :func:`rotation_pages`).

Per-call time is ``(T(n_hi) - T(n_lo)) / (n_hi - n_lo)`` from the medians of
several timings of the jitted function with ``n_lo`` and ``n_hi`` calls, which
cancels the fixed dispatch and sync cost.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:  # the stamp kernel's source needs triton.language only when it is compiled
    import triton.language as tl
except ImportError:  # pragma: no cover - no Triton: no device stamps
    tl = None

L2_BYTES = 60 * 1024 * 1024
# XLA command buffers (CUDA graphs) for fusions and custom calls only. (XLA's
# defaults, which the serving engine uses, also hold cuBLAS calls and slice-fused
# custom calls; under these options a Mosaic call fused with a slice of its input
# runs outside the graph.)
GRAPH_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"}
# No command buffers at all: every kernel launched by XLA's thunks from the host
# (XLA's defaults put some op types in command buffers).
NO_GRAPH_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


@dataclasses.dataclass(frozen=True)
class Timing:
    seconds: float  # per call, median-based
    spread: float  # relative spread of the per-call estimate across reps
    n_lo: int
    n_hi: int
    # Per call, GPU time between two %globaltimer stamps that bracket the calls
    # (``device=True`` on a GPU), differential of the median spans.
    device_seconds: float | None = None


_STAMP_ARITY = 8  # buffers one stamp kernel reads


def _stamp_kernel(
    d0,
    d1,
    d2,
    d3,
    d4,
    d5,
    d6,
    d7,  # buffers to wait for (element 0 is read)
    out_ptr,  # i32[1]
    STAMP: tl.constexpr,
):
    """Triton kernel source (``pallas_kernels.triton_glue``), one program of one warp.

    Reads one element of each input buffer, so XLA orders it after their producers
    (the whole buffers are operands of the call). Writes ``%globaltimer_lo`` (ns,
    low 32 bits) with ``STAMP``, else the sum of the elements read (a join of more
    than ``_STAMP_ARITY`` buffers, read by the next kernel)."""
    d = (
        tl.load(d0).to(tl.int32)
        + tl.load(d1).to(tl.int32)
        + tl.load(d2).to(tl.int32)
        + tl.load(d3).to(tl.int32)
        + tl.load(d4).to(tl.int32)
        + tl.load(d5).to(tl.int32)
        + tl.load(d6).to(tl.int32)
        + tl.load(d7).to(tl.int32)
    )
    if STAMP:
        d = tl.inline_asm_elementwise(
            "mov.u32 $0, %globaltimer_lo;", "=r,r", [d], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.store(out_ptr, d)


def gpu_stamp() -> Callable[..., jax.Array] | None:
    """``stamp(*deps) -> i32[1]``: the GPU's ``%globaltimer_lo`` (ns, low 32 bits), read
    by a one-warp Triton kernel (launched through jax-triton) once every array in
    ``deps`` is ready: the arrays are operands of the kernel, which reads one
    element of each (more than 8 arrays are joined by extra kernels of the same
    source first). Stamps taken inside one jit, ordered by data dependence, time
    the device without a profiler, as CUDA events around a CUDA-graph replay do.
    None without a GPU or without jax-triton."""
    from jattn.pallas_kernels import triton_glue

    if not triton_glue.available():
        return None

    def launch(deps, stamp):
        deps = list(deps) + [deps[0]] * (_STAMP_ARITY - len(deps))
        return triton_glue.triton_call(
            _stamp_kernel,
            *deps,
            out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
            grid=(1,),
            name="jattn_gpu_stamp" if stamp else "jattn_gpu_stamp_join",
            num_warps=1,
            num_stages=1,
            STAMP=stamp,
        )

    def stamp(*deps):
        deps = list(deps)
        while len(deps) > _STAMP_ARITY:
            deps = [launch(deps[:_STAMP_ARITY], False)] + deps[_STAMP_ARITY:]
        return launch(deps, True)

    return stamp


def _span_us(stamps) -> float:
    """GPU microseconds between the two stamps of one execution (32-bit wrap)."""
    t0, t1 = (int(x) for x in np.asarray(stamps))
    return ((t1 - t0) % (1 << 32)) / 1e3


def _median_wall(fn, args, reps: int, stamped: bool = False) -> tuple[float, list[float], list[float]]:
    out = fn(*args)
    jax.block_until_ready(out)  # compile + warm up
    ts, kept = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
        if stamped:
            kept.append(r[1])
    spans = [_span_us(st) * 1e-6 for st in kept]
    return statistics.median(ts), ts, spans


def _differential(
    make: Callable[[int], Callable], args: Sequence, n_lo: int, n_hi: int, reps: int, stamped: bool = False
) -> Timing:
    """Per-call time from the median walls of ``make(n_lo)`` and ``make(n_hi)`` (jitted
    functions of n calls): the fixed dispatch and sync cost cancels. With
    ``stamped``, the functions return ``(outputs, stamps)`` and the per-call device
    time is the same differential of the median stamp spans."""
    lo, lo_ts, lo_sp = _median_wall(make(n_lo), args, reps, stamped)
    hi, hi_ts, hi_sp = _median_wall(make(n_hi), args, reps, stamped)
    per = max(hi - lo, 1e-9) / (n_hi - n_lo)
    diffs = [(h - l) / (n_hi - n_lo) for h, l in zip(sorted(hi_ts), sorted(lo_ts))]
    spread = (max(diffs) - min(diffs)) / per if per > 0 else float("nan")
    dev = max(statistics.median(hi_sp) - statistics.median(lo_sp), 1e-9) / (n_hi - n_lo) if stamped else None
    return Timing(per, spread, n_lo, n_hi, dev)


def _joined(outs):
    """All calls' outputs as one array per dtype (one concatenate per jit call)."""
    by_dtype: dict = {}
    for x in jax.tree_util.tree_leaves(outs):
        by_dtype.setdefault(jnp.dtype(x.dtype), []).append(x.reshape(-1))
    return tuple(jnp.concatenate(xs) for xs in by_dtype.values())


def rotated_program(
    step: Callable[..., jax.Array],
    n: int,
    *,
    join: bool = True,
    stamp: Callable[..., jax.Array] | None = None,
    stamp_args: int = 1,
    **jit_kw,
) -> Callable:
    """The jitted program :func:`time_rotated` times: ``step(i, *args)`` for i < n, the
    outputs joined per dtype (``join``) or returned one by one. With a ``stamp``
    (:func:`gpu_stamp`) it returns ``(outputs, i32[2] stamps)``: one stamp before the
    calls, which read the first ``stamp_args`` arguments through an elementwise op on it
    (so every call must read one of them), one after them on every output."""

    def bits(x):
        # a 1-byte float (e4m3) goes to the stamp and the add as its bits
        one_byte_float = jnp.dtype(x.dtype).itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating)
        return jax.lax.bitcast_convert_type(x, jnp.uint8) if one_byte_float else x

    def after(x, t0):
        # + 0 unless the stamp hits one value in 2**32: XLA cannot fold it, so a call
        # reading the result waits for the first stamp.
        xb = bits(x)
        xb = xb + (t0[0] == 0x5EED).astype(xb.dtype)
        return jax.lax.bitcast_convert_type(xb, x.dtype) if xb.dtype != x.dtype else xb

    def many(*a):
        if stamp is not None:
            t0 = stamp(bits(a[0]))
            a = tuple(after(x, t0) for x in a[:stamp_args]) + tuple(a[stamp_args:])
        outs = tuple(step(i, *a) for i in range(n))
        res = _joined(outs) if join else outs
        if stamp is None:
            return res
        return res, jnp.concatenate([t0, stamp(*jax.tree_util.tree_leaves(res))])

    return jax.jit(many, **jit_kw)


def time_rotated(
    step: Callable[..., jax.Array],
    args: Sequence,
    *,
    n_lo: int = 2,
    n_hi: int = 12,
    reps: int = 7,
    graph: bool | str = False,
    join: bool = True,
    device: bool = False,
    stamp_args: int = 1,
) -> Timing:
    """Time ``step(i, *args)`` (i a Python int: which rotation) inside one jit.

    Every call's outputs leave the jit (so nothing is dead code and no call is
    deduplicated) without per-call work on them: a reduction per call would add a
    kernel and a launch gap per call, a large share of a batch-1 decode. With
    ``join=True`` (default) they leave as one concatenated array per dtype: the
    calls' outputs are then buffers inside the program, as a layer's attention
    output is inside a serving step. The concatenation copies every output once
    more, a cost per call that the differential does not cancel: negligible for
    a decode's small output, but for outputs of 100 MB (a long prefill, a merge, a
    large matmul) it adds hundreds of us per call to a kernel XLA cannot write into
    the joined buffer (a custom call: Mosaic, Triton, FA3, cuDNN, cuBLAS), so time
    those with ``join=False``. That returns every output as its own array, a fresh
    runtime buffer per call and execution: on the H200 hosts that cost the batch-1
    decode rows several us per call (docs/PERF.md), which times the harness, not
    the op.

    ``graph=True`` compiles the calls as XLA command buffers (CUDA graphs), as the
    serving engine runs its step: launch gaps between kernels shrink. ``graph="off"``
    turns command buffers off entirely; ``False`` keeps XLA's defaults.

    ``device=True`` (on a GPU) also measures the GPU time per call
    (:attr:`Timing.device_seconds`): a :func:`gpu_stamp` before the calls, which all
    read ``args[0]`` (a float array) through an elementwise op on that stamp, and one
    after them, on all their outputs. This is how CUDA events around a replayed CUDA
    graph time a kernel (the peers' method): the host's per-execution work is out. A step
    whose calls do not all read ``args[0]`` passes ``stamp_args``: the first that many
    arguments go through the stamp.
    The device figure comes from a second pair of programs, so the wall figure is
    the plain calls'.
    """
    kw = (
        {"compiler_options": NO_GRAPH_OPTIONS}
        if graph == "off"
        else {"compiler_options": GRAPH_OPTIONS}
        if graph
        else {}
    )
    make = lambda n, stamp=None: rotated_program(step, n, join=join, stamp=stamp, stamp_args=stamp_args, **kw)

    t = _differential(make, args, n_lo, n_hi, reps)
    stamp = gpu_stamp() if device else None
    if stamp is None:
        return t
    # A second pair of programs with the stamps: the wall figure above stays the
    # plain calls' (the stamps and the elementwise op on args[0] are not in it).
    try:
        d = _differential(lambda n: make(n, stamp), args, n_lo, n_hi, reps, stamped=True)
    except Exception as e:  # noqa: BLE001 - the stamp kernel may not build
        warnings.warn(f"time_rotated: no device time ({type(e).__name__}: {str(e)[:200]})")
        return t
    return dataclasses.replace(t, device_seconds=d.device_seconds)


# Command buffers that also take the loop itself (CUDA conditional nodes): a
# whole ``fori_loop`` of calls runs as one graph launch, no host work per call.
LOOP_GRAPH_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,WHILE,CONDITIONAL"}


def time_loop(
    step: Callable[..., jax.Array], args: Sequence, *, n_lo: int = 8, n_hi: int = 64, reps: int = 7, graph: bool = True
) -> Timing:
    """Time ``step(i, *args)`` (``i`` a traced int32) called ``n`` times by a
    ``lax.fori_loop`` inside one jit; per-call time is differential as in
    :func:`time_rotated`.

    With ``graph=True`` the loop and its body are one XLA command buffer (CUDA
    graph with conditional nodes): the host launches once per jit call, so the
    per-call figure is the device's time per call, launch latency between kernels
    included, as a serving engine that replays a captured decode step sees it.
    Without graphs every iteration is launched from the host.
    """
    kw = {"compiler_options": LOOP_GRAPH_OPTIONS} if graph else {}

    def make(n):
        def many(*a):
            out0 = jax.eval_shape(lambda: step(jnp.int32(0), *a))
            init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out0)
            return jax.lax.fori_loop(0, n, lambda i, _: step(i, *a), init)

        return jax.jit(many, **kw)

    return _differential(make, args, n_lo, n_hi, reps)


def _copy_step(i: int, *a):
    """Call ``i`` of the JAX copy-bandwidth program: no two calls alike (XLA merges equal
    ones: ``a[i % 4] + 1.0`` left 4 of 10 adds in the compiled program)."""
    return a[i % 4] + float(i + 1)


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> tuple[float, str]:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), and how.

    Prefers torch (cudaMemcpy, CUDA events), the figure docs/PERF.md uses; falls
    back to a JAX elementwise copy timed the same way as kernels.
    """
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
            y = torch.empty_like(x)
            for _ in range(3):
                y.copy_(x)
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                y.copy_(x)
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3)
            del x, y
            torch.cuda.empty_cache()
            return nbytes / statistics.median(ts), "torch copy_"
    except Exception:  # noqa: BLE001 - torch missing or without CUDA
        pass
    n = nbytes // 2 // 4 // 4
    xs = [jnp.full((n,), float(i), jnp.float32) for i in range(4)]
    t = time_rotated(_copy_step, xs, n_lo=2, n_hi=10)
    return (n * 4 * 2) / t.seconds, "jax elementwise"


def no_gpu(bench: str, hint: str = "") -> bool:
    """True, after one line saying so, when JAX has no GPU here: ``bench`` has nothing to
    do (its ``main`` then returns 1). ``hint``: appended in parentheses."""
    if jax.default_backend() == "gpu":
        return False
    more = f" ({hint})" if hint else ""
    print(f"bench {bench} needs a GPU (jax default backend is {jax.default_backend()}); nothing to do{more}")
    return True


def announce_device() -> tuple[float, str, str]:
    """Measures the copy ceiling and prints the run's device line; returns
    ``(copy bytes/s, how it was measured, device kind)``."""
    copy_bw, how = copy_bandwidth()
    dev = jax.devices()[0].device_kind
    print(f"device {dev}; jax {jax.__version__}; copy bandwidth {copy_bw / 1e12:.2f} TB/s ({how})")
    return copy_bw, how, dev


def print_table(args, bench: str, caption: str, header, rows, meta: dict) -> None:
    """The closing table under its caption, then ``--json`` / ``--plot`` (:func:`save_outputs`)."""
    print()
    print(caption)
    print(fmt_table(header, rows))
    save_outputs(args, bench, header, rows, dict(meta, jax=jax.__version__))


_WALL_NOTED = []


def device_or_wall(t) -> float:
    """``t``'s GPU time per call, or its wall time where the device gave no clock stamps
    (said once per process: the table's "device" columns then hold wall time)."""
    if t.device_seconds is not None:
        return t.device_seconds
    if not _WALL_NOTED:
        _WALL_NOTED.append(True)
        print("note: no GPU clock stamps on this device; the 'device' columns hold wall time", flush=True)
    return t.seconds


def rotation_pages(needed_pages: int, page_bytes: int, *, min_pool_bytes: int = 4 * L2_BYTES) -> int:
    """Pool size (pages) so that rotating page tables over it defeats the L2."""
    return max(needed_pages, -(-min_pool_bytes // page_bytes))


def page_rotations(
    rng: np.random.Generator, bs: int, max_pages: int, page_bytes: int, *, min_rot: int = 4
) -> tuple[np.ndarray, int]:
    """``(tables i32[num_rot, bs, max_pages], num_pages)``: page tables for calls that take
    them in turn, so that no call finds its pages in the L2 from an earlier call. A call that
    reads at least 8x the L2 flushes it by itself: ``min_rot`` random tables over a pool of
    at least 4x the L2. A smaller call gets disjoint tables (one permutation of the pool cut
    into pieces), enough of them that a cycle reads 4x the L2: a random table per rotation
    would share about the call's share of the pool with the next one, and a call of 2x the
    L2 still found about 4% of its pages there (an LRU model of a split-KV read order)."""
    need = bs * max_pages
    call_bytes = need * page_bytes
    if call_bytes >= 8 * L2_BYTES or need == 0:
        num_pages = rotation_pages(need, page_bytes)
        return random_page_tables(rng, min_rot, bs, max_pages, num_pages), num_pages
    num_rot = max(min_rot, -(-4 * L2_BYTES // call_bytes))
    num_pages = num_rot * need
    perm = rng.permutation(num_pages).astype(np.int32)
    return perm.reshape(num_rot, bs, max_pages), num_pages


def batch_lengths(rng: np.random.Generator, bs: int, length: int, uneven: bool) -> np.ndarray:
    """i32[bs]: every request ``length`` long, or (``uneven``) lengths drawn uniformly from
    ``length // 8`` to ``length``, as a serving batch's are spread."""
    if not uneven:
        return np.full((bs,), length, np.int32)
    return rng.integers(length // 8, length + 1, bs).astype(np.int32)


def random_page_tables(rng: np.random.Generator, num_rot: int, bs: int, max_pages: int, num_pages: int) -> np.ndarray:
    """i32[num_rot, bs, max_pages]: each rotation a random set of distinct pages."""
    need = bs * max_pages
    out = np.empty((num_rot, bs, max_pages), np.int32)
    for r in range(num_rot):
        if need <= num_pages:
            out[r] = rng.permutation(num_pages)[:need].reshape(bs, max_pages)
        else:
            out[r] = rng.integers(0, num_pages, (bs, max_pages))
    return out


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (also readable as plain text)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def write_results(path: str, bench: str, header: Sequence[str], rows: Sequence[Sequence[object]], meta: dict) -> None:
    """Writes a benchmark's table and the run's facts (device, versions, ceilings) as JSON
    (``{"bench", "header", "rows", ...meta}``, cells as printed) for ``jattn.bench.plot``;
    nothing when ``path`` is empty."""
    if not path:
        return
    import json

    with open(path, "w") as f:
        json.dump(_results(bench, header, rows, meta), f, indent=1)
    print(f"results written to {path}")


def _results(bench: str, header, rows, meta: dict) -> dict:
    """A benchmark's table as ``jattn.bench.plot`` reads it: cells as printed."""
    return dict(bench=bench, header=list(header), rows=[[str(c) for c in r] for r in rows], **meta)


def add_output_args(ap) -> None:
    """The ``--json`` and ``--plot`` options every benchmark takes."""
    ap.add_argument("--json", default="", help="also write the table (and the run's facts) to this JSON file")
    ap.add_argument(
        "--plot",
        default="",
        help="also draw the table (jattn, the peers, the ceiling) to this PNG (needs matplotlib; else "
        "`python -m jattn.bench.plot RESULTS.json OUT.png` draws it from --json elsewhere)",
    )


def save_outputs(args, bench: str, header, rows, meta: dict) -> None:
    """Writes ``--json`` and draws ``--plot`` when they were asked for."""
    write_results(args.json, bench, header, rows, meta)
    if args.plot:
        from jattn.bench import plot

        print(plot.draw(_results(bench, header, rows, meta), args.plot))


def select_rows(rows, spec: str, extra: tuple = ()) -> tuple[list, set]:
    """``(the rows named in spec, the extra names in it)``: ``spec`` is comma-separated
    labels of ``rows`` (objects with a ``label``) or of ``extra`` (named steps that are not
    rows), timed in the order given so that a short GPU lease reaches the rows named first;
    repeats count once. An empty ``spec`` names every row and every extra. Raises
    ``ValueError`` naming an unknown label and the choices."""
    by_label = {r.label: r for r in rows}
    want = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    unknown = [w for w in want if w not in by_label and w not in extra]
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)}; choose from {', '.join([*by_label, *extra])}")
    if not want:
        return list(rows), set(extra)
    return [by_label[w] for w in want if w in by_label], {w for w in want if w in extra}
