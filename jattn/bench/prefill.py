"""``python -m jattn bench prefill``: ragged prefill / paged extend on the GPU.

Rows are (head dims, heads, request lengths, and for an extend the paged prefix).
Each row times jattn's Mosaic GPU kernel beside the peers that run here:
FlashAttention-3 (``flash-attn3-jax``: varlen for prefill, paged KV cache for
extend), cuDNN (``jax.nn.dot_product_attention``, equal lengths only) and torch's
``scaled_dot_product_attention`` with its flash and cuDNN backends (equal-length
prefill only, CUDA events), and reports TFLOP/s (causal FLOPs count only the
visible half) against the measured bf16 matmul rate. Every figure is GPU time per
call: JAX calls inside one jit with distinct inputs, each output its own array,
between two GPU clock stamps (``jattn.bench.common.time_rotated(join=False,
device=True)``: joining 100 MB outputs would copy each once more per call), torch
calls between CUDA events.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import statistics
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench import common
from jattn.pallas_kernels.mosaic_prefill_config import PrefillOptions

# 16 request lengths spread geometrically from 128 to 8192 tokens.
RAGGED16 = tuple(int(round(128 * 64 ** (j / 15))) for j in range(16))


@dataclasses.dataclass(frozen=True)
class Row:
    """One benchmark row: ``lens`` new tokens per request; an extend (``prefix`` > 0)
    attends over ``prefix`` cached tokens plus its own, in a paged cache."""

    label: str
    hq: int
    hkv: int
    d: int
    dv: int
    causal: bool
    lens: tuple[int, ...]
    prefix: int = 0
    page_size: int = 64
    fp8: bool = False  # the extend's caches in FP8 e4m3 (scale 1)

    @property
    def extend(self) -> bool:
        return self.prefix > 0

    @property
    def equal_lengths(self) -> bool:
        return len(set(self.lens)) == 1

    def scaled(self, scale: int) -> Row:
        """The same row with lengths and prefix divided by ``scale`` (CPU tests)."""
        return dataclasses.replace(
            self,
            lens=tuple(max(1, n // scale) for n in self.lens),
            prefix=max(1, self.prefix // scale) if self.prefix else 0,
        )


ROWS = (
    Row("1x4096", 32, 8, 128, 128, True, (4096,)),
    Row("4x4096", 32, 8, 128, 128, True, (4096,) * 4),
    Row("4x4096 mha", 32, 32, 128, 128, True, (4096,) * 4),
    Row("1x16384", 32, 8, 128, 128, True, (16384,)),
    Row("ragged mix", 32, 8, 128, 128, True, (8192, 2048, 1000, 512, 512, 97, 1)),
    Row("ragged 16", 32, 8, 128, 128, True, RAGGED16),
    Row("4x4096 nc", 32, 8, 128, 128, False, (4096,) * 4),
    Row("4x4096 d64", 32, 8, 64, 64, True, (4096,) * 4),
    Row("4x4096 d256", 16, 4, 256, 256, True, (4096,) * 4),
    Row("4x4096 mla", 16, 16, 192, 128, True, (4096,) * 4),
    Row("mla 128h", 128, 128, 192, 128, True, (4096,) * 2),
    Row("extend 16x512/4096", 32, 8, 128, 128, True, (512,) * 16, prefix=4096, page_size=64),
    Row("extend 16x512/4096 fp8", 32, 8, 128, 128, True, (512,) * 16, prefix=4096, page_size=64, fp8=True),
)


def row_flops(row: Row) -> float:
    """Attention FLOPs of a row: 2 * (query, key) pairs * Hq * (D + Dv). A causal query
    i (0-based) of a request sees ``prefix + i + 1`` keys, a non-causal one all
    ``prefix + n``."""
    pairs = 0
    for n in row.lens:
        pairs += n * row.prefix + (n * (n + 1) // 2 if row.causal else n * n)
    return 2.0 * pairs * row.hq * (row.d + row.dv)


@dataclasses.dataclass
class RowInputs:
    """A row's arrays: ``args`` is what the jattn and FA3 steps take, ``(q, k, v, cu)``
    for a prefill (ragged ``[tokens, H, D]``) and ``(q, k_cache, v_cache, page_table,
    cache_seqlens, cu)`` for an extend (caches ``[pages, page_size, Hkv, D]``)."""

    row: Row
    args: tuple
    flops: float
    cu_seqlens: np.ndarray
    page_table: np.ndarray | None = None
    cache_seqlens: np.ndarray | None = None


def build_row(row: Row, *, scale: int = 1, seed: int = 0) -> RowInputs:
    """The inputs and FLOP count of ``row`` (lengths divided by ``scale``)."""
    if scale != 1:
        row = row.scaled(scale)
    rng = np.random.default_rng(seed)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    t_tok = sum(row.lens)
    cu = np.concatenate([[0], np.cumsum(row.lens)]).astype(np.int32)
    q = jax.random.normal(kq, (t_tok, row.hq, row.d), jnp.bfloat16)
    flops = row_flops(row)
    if not row.extend:
        k = jax.random.normal(kk, (t_tok, row.hkv, row.d), jnp.bfloat16)
        v = jax.random.normal(kv, (t_tok, row.hkv, row.dv), jnp.bfloat16)
        return RowInputs(row, (q, k, v, jnp.asarray(cu)), flops, cu)
    seqlens = np.asarray([row.prefix + n for n in row.lens], np.int32)
    pages_per = -(-int(seqlens.max()) // row.page_size)
    bs = len(row.lens)
    num_pages = bs * pages_per
    # every request its own pages, scattered over the pool: no page used twice
    table = rng.permutation(num_pages).astype(np.int32).reshape(bs, pages_per)
    k_cache = jax.random.normal(kk, (num_pages, row.page_size, row.hkv, row.d), jnp.bfloat16)
    v_cache = jax.random.normal(kv, (num_pages, row.page_size, row.hkv, row.dv), jnp.bfloat16)
    if row.fp8:
        k_cache, v_cache = k_cache.astype(jnp.float8_e4m3fn), v_cache.astype(jnp.float8_e4m3fn)
    args = (q, k_cache, v_cache, jnp.asarray(table), jnp.asarray(seqlens), jnp.asarray(cu))
    return RowInputs(row, args, flops, cu, table, seqlens)


def triton_step(row: Row, launch: tuple[int, int, int, int] | None = None):
    """The Triton kernel's timed step for ``row`` (``step(i, *RowInputs.args)``), at the
    launch ``(block_m, block_n, num_warps, num_stages)`` or the default (None)."""
    from jattn.pallas_kernels import triton_prefill

    kw = {} if launch is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), launch))
    if row.extend:

        def step(i, q, kc, vc, pt, sl, cu):
            return triton_prefill.mha_extend(q, kc, vc, pt, sl, cu, is_causal=row.causal, k_scale=1.0 + 1e-3 * i, **kw)

    else:

        def step(i, q, k, v, cu):
            return triton_prefill.mha_prefill(q, k, v, cu, is_causal=row.causal, k_scale=1.0 + 1e-3 * i, **kw)

    return step


def parse_launches(text: str) -> list[tuple[int, int, int, int] | None]:
    """``--triton-sweep`` launches: comma-separated ``BMxBNwWsS`` (``128x64w8s3``: block_m
    128, block_n 64, 8 warps, 3 stages) or ``default`` (None: the kernel's own choice)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == "default":
            out.append(None)
            continue
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", item)
        if m is None:
            raise ValueError(f"launch {item!r}: write BMxBNwWsS (e.g. 128x64w8s3) or default")
        out.append(tuple(int(g) for g in m.groups()))
    return out


def parse_options(text: str) -> list[tuple[str, PrefillOptions | None]]:
    """``'default;overlap_pv=1,block_kv=64'`` -> ``[(label, PrefillOptions or None)]``."""
    fields = {f.name for f in dataclasses.fields(PrefillOptions)}
    # integer fields by their annotations (``int``, ``int | None``); the rest are flags
    ints = {f.name for f in dataclasses.fields(PrefillOptions) if "int" in str(f.type)}
    out = []
    for spec in (text or "default").split(";"):
        spec = spec.strip()
        if spec in ("", "default"):
            out.append(("", None))
            continue
        kw = {}
        for item in spec.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in fields or not value.strip().isdigit():
                raise ValueError(f"{item!r}: expected NAME=INT with NAME one of {', '.join(sorted(fields))}")
            kw[name] = int(value) if name in ints else bool(int(value))
        out.append((spec, PrefillOptions(**kw)))
    return out


def triton_sweep(specs, launches) -> tuple[list[str], list[list[str]]]:
    """Time the Triton kernel alone at each launch on each row: TFLOP/s (GPU time per
    call, as the table's) and, beside each launch after the first, the largest
    difference of its output from the first launch's (a launch that computes something
    else shows here). A launch that fails (shared memory, registers) costs its cell only."""
    header = ["row"] + ["default" if x is None else "{}x{}w{}s{}".format(*x) for x in launches]
    out = []
    for spec in specs:
        inp = build_row(spec)
        row, first = [spec.label], None
        for launch in launches:
            step = triton_step(spec, launch)
            try:
                o = np.asarray(jax.jit(step, static_argnums=0)(0, *inp.args), np.float32)
                bad = int((~np.isfinite(o)).sum())
                diff = "" if first is None else f" d={float(np.abs(o - first).max()):.1e}"
                first = o if first is None else first
                t = common.time_rotated(step, inp.args, n_lo=1, n_hi=4, reps=3, join=False, device=True)
                s = common.device_or_wall(t)
                row.append(f"{inp.flops / s / 1e12:.0f}{diff}" + (f" nonfinite={bad}" if bad else ""))
            except Exception as e:  # noqa: BLE001 - a launch that does not fit costs its cell
                print(f"{spec.label} {header[len(row)]}: {type(e).__name__}: {str(e)[:300]}")
                row.append("-")
        out.append(row)
        print(" | ".join(row), flush=True)
    return header, out


def matmul_rate(n: int = 8192) -> float:
    """bf16 matmul FLOP/s of this device: products of large square random matrices, a
    different pair for each call (no elementwise pass before the product, nothing for XLA
    to share between calls)."""
    keys = jax.random.split(jax.random.key(0), 5)
    xs = [jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys]
    # Both programs read all five, each through the stamp's elementwise op: those passes are
    # in both and cancel in the difference (a program that left some unread would drop them).
    n_lo, n_hi = MATMUL_CALLS
    t = common.time_rotated(_matmul_step, xs, n_lo=n_lo, n_hi=n_hi, reps=3, join=False, device=True, stamp_args=5)
    return 2 * n**3 / common.device_or_wall(t)


MATMUL_CALLS = (5, 10)  # matmul_rate's two programs: each reads all five matrices


def _matmul_step(i, *xs):
    """Call ``i`` of :func:`matmul_rate`: ten distinct ordered pairs for i < 10, each of the
    five matrices read in every five consecutive calls."""
    return xs[i % 5] @ xs[(i + 1 + i // 5) % 5]


def _torch_cuda():
    """torch when it sees a CUDA device, else None (imported only when asked)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


TORCH_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")


def torch_sdpa_seconds(torch, row: Row, backend: str, *, calls: int = 10, reps: int = 3) -> float | None:
    """Seconds per call of torch's ``scaled_dot_product_attention`` on ``[B, H, S, D]``
    bf16 CUDA tensors with one SDPA backend (an equal-length prefill row), CUDA events
    around ``calls`` calls after a warm-up, median of ``reps``. GQA runs with
    ``enable_gqa=True``, else (a backend that refuses it) with the KV heads repeated.
    None, with the reason printed, when the backend refuses the row."""
    try:
        return _torch_sdpa_seconds(torch, row, backend, calls, reps)
    finally:
        torch.cuda.empty_cache()


def _torch_sdpa_seconds(torch, row: Row, backend: str, calls: int, reps: int) -> float | None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s = len(row.lens), row.lens[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h, d: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = mk(row.hq, row.d), mk(row.hkv, row.d), mk(row.hkv, row.dv)
    tries = [("mha", k, v, {})]
    if row.hq != row.hkv:
        rep = row.hq // row.hkv
        tries = [
            ("enable_gqa", k, v, dict(enable_gqa=True)),
            ("repeated kv", k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), {}),
        ]
    why = []
    for how, kk, vv, kw in tries:

        def call(kk=kk, vv=vv, kw=kw):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=row.causal, **kw)

        with sdpa_kernel(getattr(SDPBackend, backend)), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                call()  # warm-up
                torch.cuda.synchronize()
            except RuntimeError as e:
                msgs = [str(x.message).splitlines()[0][:200] for x in w] + [str(e).splitlines()[0][:200]]
                why.append(f"{how}: " + "; ".join(msgs))
                continue
            ts = []
            for _ in range(reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(calls):
                    call()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e-3 / calls)
        if how == "repeated kv":
            print(f"{row.label}: torch {backend} refused enable_gqa ({why[0][:300]}); timed with the KV heads repeated")
        return statistics.median(ts)
    print(f"{row.label}: torch {backend} refused: {' | '.join(why)[:600]}")
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m jattn bench prefill", description=__doc__)
    ap.add_argument(
        "--rows",
        default="",
        help="comma-separated row labels, timed in that order (default: all): "
        + ", ".join(r.label for r in ROWS)
        + ", merge",
    )
    ap.add_argument("--no-peers", action="store_true", help="time jattn only")
    common.add_output_args(ap)
    ap.add_argument(
        "--clean-edges",
        default="default",
        help="the kernel's clean_edges option: default, on, off, or both (two jattn columns)",
    )
    ap.add_argument(
        "--options",
        default="",
        help="';'-separated PrefillOptions sets, each a jattn column, e.g. 'default;overlap_pv=1' "
        "(fields: " + ", ".join(f.name for f in dataclasses.fields(PrefillOptions)) + ")",
    )
    ap.add_argument(
        "--triton-sweep",
        default="",
        help="time only the Triton kernel, at each of these launches (comma-separated BMxBNwWsS, "
        "e.g. 128x64w8s3, or default), on the chosen rows",
    )
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])
    cleans = {"default": [None], "on": [True], "off": [False], "both": [False, True]}.get(args.clean_edges)
    if cleans is None:
        ap.error(f"--clean-edges {args.clean_edges!r}: choose default, on, off or both")
    try:
        option_sets = parse_options(args.options)
    except ValueError as e:
        ap.error(f"--options: {e}")
    # jattn columns: (label, clean_edges, options); the first is the main column
    variants = [
        (" ".join(x for x in ("clean" if clean else "", label) if x), clean, opts)
        for clean in cleans
        for label, opts in option_sets
    ]
    try:
        rows, extras = common.select_rows(ROWS, args.rows, extra=("merge",))
    except ValueError as e:
        ap.error(f"--rows: {e}")
    if common.no_gpu("prefill"):
        return 1
    from jattn.pallas_kernels import mosaic_prefill as mp
    from jattn.pallas_kernels import triton_glue, triton_prefill

    if args.triton_sweep and args.plot:
        ap.error("--plot: the --triton-sweep table has no chart (--json keeps it)")
    if args.triton_sweep:
        try:
            launches = parse_launches(args.triton_sweep)
        except ValueError as e:
            ap.error(f"--triton-sweep: {e}")
        print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; Triton kernel alone, TFLOP/s")
        header, out = triton_sweep(rows, launches)
        print(common.fmt_table(header, out))
        common.save_outputs(args, "prefill_triton_sweep", header, out, dict(device=jax.devices()[0].device_kind))
        return
    rate = matmul_rate()
    print(f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    try:
        import flash_attn3_jax as fa3
    except ImportError:
        fa3 = None
    torch = None if args.no_peers else _torch_cuda()
    if torch is not None:
        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) SDPA peers: {', '.join(TORCH_BACKENDS)}")
    header = ["row", "Hq/Hkv", "D/Dv", "tokens", "jattn ms", "TFLOP/s", "% matmul"]
    for label, _, _ in variants[1:]:
        header += [f"{label} ms", f"{label} TFLOP/s"]
    header += ["triton TFLOP/s", "FA3 TFLOP/s", "cuDNN TFLOP/s", "torch flash TFLOP/s", "torch cuDNN TFLOP/s"]
    out = []
    for spec in rows:
        inp = build_row(spec)
        lens, d, causal, flops = spec.lens, spec.d, spec.causal, inp.flops

        def timed(fn):
            try:
                t = common.time_rotated(fn, inp.args, n_lo=1, n_hi=4, reps=3, join=False, device=True)
                return common.device_or_wall(t)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run this row
                print(f"{spec.label}: {type(e).__name__}: {str(e)[:300]}")
                return None

        tokens = f"{sum(lens)} (+{len(lens)}x{spec.prefix} cached)" if spec.extend else sum(lens)
        row = [spec.label, f"{spec.hq}/{spec.hkv}", f"{d}/{spec.dv}", tokens]
        for n, (_, clean, opts) in enumerate(variants):
            kw = dict(is_causal=causal, clean_edges=clean, options=opts)
            if spec.extend:

                def ours(i, q, kc, vc, pt, sl, cu, kw=kw):
                    return mp.mha_extend(q, kc, vc, pt, sl, cu, k_scale=1.0 + 1e-3 * i, **kw)

            else:

                def ours(i, q, k, v, cu, kw=kw):
                    return mp.mha_prefill(q, k, v, cu, k_scale=1.0 + 1e-3 * i, **kw)

            s = timed(ours)
            cols = [f"{s * 1e3:.3f}", f"{flops / s / 1e12:.0f}"] if s is not None else ["-", "-"]
            if n == 0:
                cols.append("-" if s is None else f"{100 * flops / s / rate:.0f}")
            row += cols
        peers = []
        if triton_glue.available() and triton_prefill.unsupported_reason(*inp.args[:3]) is None:
            peers.append(timed(triton_step(spec)))
        else:
            peers.append(None)
        if fa3 is not None and not args.no_peers:
            if spec.extend:
                b, n_new = len(lens), lens[0]

                def fa(i, q, kc, vc, pt, sl, cu):
                    return fa3.flash_mha_with_kvcache(
                        q.reshape(b, n_new, q.shape[1], q.shape[2]),
                        kc,
                        vc,
                        cache_seqlens=sl,
                        page_table=pt,
                        softmax_scale=(1.0 + 1e-3 * i) / math.sqrt(d),
                        is_causal=causal,
                    )

            else:

                def fa(i, q, k, v, cu):
                    return fa3.flash_mha_varlen(
                        q,
                        k,
                        v,
                        cu,
                        cu,
                        max_seqlen_q=max(lens),
                        max_seqlen_k=max(lens),
                        softmax_scale=(1.0 + 1e-3 * i) / math.sqrt(d),
                        is_causal=causal,
                    )

            peers.append(timed(fa))
        else:
            peers.append(None)
        if spec.equal_lengths and not spec.extend and not args.no_peers and d == spec.dv:
            b, n = len(lens), lens[0]

            def cudnn(i, q, k, v, cu):
                shape = lambda x: x.reshape(b, n, x.shape[1], x.shape[2])  # noqa: E731
                return jax.nn.dot_product_attention(
                    shape(q),
                    shape(k),
                    shape(v),
                    scale=(1.0 + 1e-3 * i) / math.sqrt(d),
                    is_causal=causal,
                    implementation="cudnn",
                )

            peers.append(timed(cudnn))
        else:
            peers.append(None)
        for backend in TORCH_BACKENDS:
            s = None
            if torch is not None and spec.equal_lengths and not spec.extend:
                try:
                    s = torch_sdpa_seconds(torch, spec, backend)
                except Exception as e:  # noqa: BLE001 - a torch failure costs its cell only
                    print(f"{spec.label}: torch {backend}: {type(e).__name__}: {str(e)[:300]}")
            peers.append(s)
        row += ["-" if p is None else f"{flops / p / 1e12:.0f}" for p in peers]
        out.append(row)
        print(" | ".join(str(x) for x in row), flush=True)
    print(common.fmt_table(header, out))
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, matmul_tflops=rate / 1e12)
    common.save_outputs(args, "prefill", header, out, meta)
    if "merge" in extras:
        _merge_row(np.random.default_rng(0))


def _merge_row(rng, tokens: int = 16384, hq: int = 32, d: int = 128) -> None:
    """``attn_merge_state`` (the chunked-prefix merge) on each backend that runs here:
    achieved bandwidth against the device's copy bandwidth, and the kernels in its program."""
    import jattn
    from jattn.pallas_kernels import merge_state

    o_a, o_b = (jnp.asarray(rng.standard_normal((tokens, hq, d)), jnp.bfloat16) for _ in range(2))
    l_a, l_b = (jnp.asarray(rng.standard_normal((tokens, hq)), jnp.float32) for _ in range(2))
    nbytes = 3 * o_a.size * 2 + 3 * l_a.size * 4
    copy_bw, _ = common.copy_bandwidth()
    for backend in ("xla", "triton") if merge_state.kernel_runs_here() else ("xla",):

        def step(i, o_a, l_a, o_b, l_b, backend=backend):
            return jattn.attn_merge_state(o_a, l_a + i, o_b, l_b, backend=backend)

        t = common.time_rotated(step, (o_a, l_a, o_b, l_b), n_lo=2, n_hi=12, reps=5, join=False, device=True)
        t = dataclasses.replace(t, seconds=common.device_or_wall(t))
        f = functools.partial(jattn.attn_merge_state, backend=backend)
        hlo = jax.jit(f).lower(o_a, l_a, o_b, l_b).compile().as_text()
        kernels = hlo.count("kind=kLoop") + hlo.count("kind=kInput") + hlo.count("custom_call_target")
        print(
            f"attn_merge_state [{tokens}, {hq}, {d}] bf16, {backend}: {t.seconds * 1e6:.1f} us, "
            f"{nbytes / t.seconds / 1e12:.2f} TB/s ({100 * nbytes / t.seconds / copy_bw:.0f}% of copy "
            f"{copy_bw / 1e12:.2f} TB/s); kernels: {kernels}"
        )


if __name__ == "__main__":
    main()
