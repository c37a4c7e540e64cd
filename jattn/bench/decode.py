"""``python -m jattn bench decode``: paged MHA/GQA decode, Llama-3-8B shape by default.

32 q heads, 8 kv heads, head_dim 128, bf16 (plus q_len 4 verify and FP8 KV rows);
``--heads`` and ``--head-dim`` time other geometries (e.g. ``--heads 64/8`` for Llama-3-70B
on one GPU, ``--heads 28/4`` for a KV head count that is not a multiple of 8).
For each (page size, batch, length): jattn's mosaic kernel time per call, achieved
TB/s (K and V bytes read once), percent of the device copy bandwidth measured in
the same run, and JAX's own ``jax.experimental.pallas.ops.gpu.paged_attention`` on
the same data where it runs. Page tables rotate over a pool larger than L2.

Two times per call: the wall time of many calls inside one jitted program (XLA's
host work per call included), and the GPU time between two ``%globaltimer``
stamps around the calls (``common.time_rotated(device=True)``), which is what
CUDA events around a replayed CUDA graph measure - how the peers in docs/PERF.md
were timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jattn.bench import common

SHAPES = ((1, 4096), (1, 32768), (16, 4096), (64, 4096), (128, 2048), (256, 1024), (32, 16384))
HQ, HKV, D = 32, 8, 128  # the geometry of every row; main() sets it from --heads / --head-dim
HEADER = (
    "page",
    "batch x len",
    "q_len",
    "kv",
    "splits",
    "jattn us",
    "TB/s",
    "% copy",
    "device us",
    "device TB/s",
    "JAX paged_attention TB/s (device)",
    "triton us (device)",
    "triton TB/s (device)",
    "FA3 us",
    "FA3 TB/s",
    "FA3 device us",
    "FA3 device TB/s",
)


def _setup(bs, length, page_size, q_len, kv_dtype, rng, num_q, uneven=False):
    max_pages = -(-length // page_size)
    itemsize = jnp.dtype(kv_dtype).itemsize
    page_bytes = 2 * page_size * HKV * D * itemsize
    tables, num_pages = common.page_rotations(rng, bs, max_pages, page_bytes)
    k = jax.random.normal(jax.random.key(1), (num_pages, page_size, HKV, D), jnp.float32)
    v = jax.random.normal(jax.random.key(2), (num_pages, page_size, HKV, D), jnp.float32)
    if kv_dtype == jnp.float8_e4m3fn:
        k, v = (k * 0.5).astype(kv_dtype), (v * 0.5).astype(kv_dtype)
    else:
        k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    # one distinct q per call: identical calls inside one jit would be deduplicated
    qs = jax.random.normal(jax.random.key(3), (num_q, bs * q_len, HQ, D), jnp.bfloat16)
    lens = common.batch_lengths(rng, bs, length, uneven)
    kv_bytes = 2 * int(lens.sum()) * HKV * D * itemsize
    return qs, k, v, jnp.asarray(tables), jnp.asarray(lens), kv_bytes


def parse_shapes(spec: str) -> list[tuple[int, int, bool]]:
    """``"1x4096,64x4096u"`` -> ``[(1, 4096, False), (64, 4096, True)]``: batch x length, a
    trailing ``u`` for lengths spread from length/8 to length."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        uneven = item.endswith("u")
        bs, length = item.removesuffix("u").split("x")
        out.append((int(bs), int(length), uneven))
    return out


def parse_heads(spec: str, head_dim: int) -> tuple[int, int, int]:
    """``"32/8"``, ``128`` -> ``(32, 8, 128)``: query heads / KV heads and the head size, the
    query heads a multiple of the KV heads."""
    hq, _, hkv = spec.partition("/")
    if not (hq.isdigit() and hkv.isdigit() and int(hkv) > 0 and int(hq) % int(hkv) == 0):
        raise SystemExit(f"--heads {spec!r}: expected Q/KV, two positive integers, Q a multiple of KV")
    if head_dim not in (64, 128, 256):
        raise SystemExit(f"--head-dim {head_dim}: expected 64, 128 or 256")
    return int(hq), int(hkv), head_dim


def _jax_paged_attention(qs, k, v, tables, lens, page_size):
    """JAX's Pallas-Triton paged_attention on the same data (its own layout)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa

    kp = jnp.transpose(k, (2, 0, 1, 3))  # [Hkv, pages, page_size, D], copied once
    vp = jnp.transpose(v, (2, 0, 1, 3))
    max_pages = tables.shape[-1]
    k_splits = math.gcd(16, max_pages)
    ppcb = max(1, min(8, max_pages // k_splits))

    def step(i, qs, kp, vp, tables, lens):
        return jpa.paged_attention(
            qs[i], kp, vp, tables[i % len(tables)], lens, k_splits=k_splits, pages_per_compute_block=ppcb
        )

    return step, (qs, kp, vp, tables, lens)


def _fa3_splits(bs: int, max_pages: int, page_size: int) -> list[int]:
    """Split counts tried for FA3's paged call (its JAX binding takes an explicit count):
    1, and the power of two that gives about one CTA per SM (132 on an H200) over the
    batch's KV heads, at most 64 and at most one split per 256 tokens."""
    fill = 1 << max(0, math.ceil(math.log2(max(1, 132 // max(1, bs * HKV)))))
    return sorted({1, max(1, min(64, fill, max_pages * page_size // 256))})


def _fa3_step(fa3, q_len, splits):
    """FA3's paged KV-cache attention (``flash_attn3_jax.flash_mha_with_kvcache``) on the
    same pool and tables: q as ``[bs, q_len, Hq, D]``, causal (bottom-right) for q_len > 1."""

    def step(i, qs, k, v, tables, lens):
        q = qs[i]
        out = fa3.flash_mha_with_kvcache(
            q.reshape(-1, q_len, HQ, D),
            k,
            v,
            cache_seqlens=lens,
            page_table=tables[i % len(tables)],
            is_causal=q_len > 1,
            num_splits=splits,
        )
        return out.reshape(q.shape)

    return step


def _device_timing(t):
    """``t`` with its GPU time per call as ``seconds`` (for the sweep lines)."""
    return dataclasses.replace(t, seconds=t.device_seconds) if t.device_seconds else t


def parse_options(spec: str):
    """``"overlap_qk=0,heads_row_tile=16"`` -> the kernel's ``KernelOptions`` (flags 0 or
    1, a flag chosen by the call by default too; integer fields a non-negative integer;
    unnamed fields keep their defaults)."""
    from jattn.pallas_kernels.decode_tuning import KernelOptions

    kinds = {f.name: bool if f.default is None else type(f.default) for f in dataclasses.fields(KernelOptions)}
    values = {}
    for item in filter(None, spec.split(",")):
        name, _, val = (x.strip() for x in item.partition("="))
        kind = kinds.get(name)
        if kind is bool and val in ("0", "1"):
            values[name] = val == "1"
        elif kind is int and val.isdigit():
            values[name] = int(val)
        else:
            names = ", ".join(f"{n}={'0|1' if k is bool else 'N'}" for n, k in sorted(kinds.items()))
            raise SystemExit(f"--set {item!r}: expected one of {names}")
    try:
        return KernelOptions(**values)
    except ValueError as e:  # a value the field does not take (heads_row_tile=7)
        raise SystemExit(f"--set {spec!r}: {e}") from None


def _heads_splits(bs: int, length: int, page_size: int, q_len: int, row_tile: int) -> int:
    """The per-KV-head kernel's split count for a row (its own chooser)."""
    from jattn.pallas_kernels import mosaic_decode_heads as mh

    max_pages = -(-length // page_size)
    tiles = mh.row_tiles(q_len * (HQ // HKV), row_tile)
    return mh.choose_num_splits(bs, HKV, max_pages * page_size, tiles)


def verify_ratios(header, rows) -> list[str]:
    """One line per multi-token 2-byte row: its device time against the q_len 1 row of the
    same page size and shape in the same run (the verify target compares the two;
    timings from different machines differ by several percent, so only one run's rows are
    compared)."""
    col = {name: i for i, name in enumerate(header)}
    page, shape, ql, kv, dev = (col[c] for c in ("page", "batch x len", "q_len", "kv", "device us"))

    def device_us(row):
        try:
            return float(row[dev])
        except (TypeError, ValueError):
            return None

    base = {(r[page], r[shape]): device_us(r) for r in rows if r[ql] == 1 and r[kv] == "bf16"}
    out = []
    for r in rows:
        one, t = base.get((r[page], r[shape])), device_us(r)
        if r[ql] != 1 and r[kv] == "bf16" and one and t:
            out.append(
                f"page {r[page]} {r[shape]} q_len {r[ql]}: {t:.1f} us against q_len 1's {one:.1f} "
                f"({100 * (t / one - 1):+.1f}%)"
            )
    return out


def _time_decode(fn, args, n_hi: int, q_len: int, kscale: float):
    """GPU time per call (s) of ``fn``, a paged decode with jattn's arguments, over the
    rotated page tables of ``args`` (``qs, k, v, tables, lens``): ``(seconds, None)``, or
    ``(None, the error's first line)``."""

    def step(i, qs, k, v, tables, lens):
        return fn(qs[i], k, v, tables[i % len(tables)], lens, max_seqlen_q=q_len, k_scale=kscale, v_scale=kscale)

    try:
        t = common.time_rotated(step, args, n_hi=n_hi, device=True)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__
    return common.device_or_wall(t), None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m jattn bench decode", description=__doc__)
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument(
        "--shapes",
        default=None,
        help=f"e.g. 1x4096,64x4096,64x4096u (a trailing u: lengths spread from length/8 to length; "
        f"default: {','.join(f'{b}x{n}' for b, n in SHAPES)})",
    )
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads of every row (default 32/8)")
    ap.add_argument("--head-dim", type=int, default=128, help="64, 128 or 256 (default 128)")
    ap.add_argument("--no-peer", action="store_true", help="skip JAX paged_attention")
    ap.add_argument("--no-extra", action="store_true", help="skip q_len 4 and FP8 rows")
    ap.add_argument(
        "--check",
        action="store_true",
        help="max |err| vs the f32 reference per row (FP8 rows on the e4m3-query path: the reference over that query)",
    )
    ap.add_argument(
        "--n-hi", type=int, default=12, help="calls per jit (x4 for rows under 512 MB, whose calls are short)"
    )
    ap.add_argument(
        "--splits-sweep", default="", help="e.g. 16,33,66,132: also time these split counts for batch-1 rows"
    )
    ap.add_argument(
        "--profile", action="store_true", help="also profile one call per row: device span, kernel time, kernels"
    )
    ap.add_argument(
        "--graph", action="store_true", help="also time with XLA command buffers (CUDA graphs), as the engine runs"
    )
    ap.add_argument(
        "--no-cmd-buffers",
        action="store_true",
        help="also time with XLA command buffers turned off entirely (every kernel "
        "launched from the host; XLA's defaults capture some op types)",
    )
    ap.add_argument(
        "--separate-outputs",
        action="store_true",
        help="also time with every call's output returned as its own array "
        "(the harness's earlier method, docs/PERF.md)",
    )
    ap.add_argument(
        "--loop",
        action="store_true",
        help="also time the calls inside one jitted fori_loop run as one command "
        "buffer (CUDA graph with conditional nodes): device time per call",
    )
    common.add_output_args(ap)
    ap.add_argument(
        "--invariant",
        action="store_true",
        help="also time batch-invariant mode (the split count from the page-table width, not the batch)",
    )
    ap.add_argument(
        "--heads-kernel",
        action="store_true",
        help="also time the decode kernel that the row's call does not run (the per-KV-head kernel "
        "pallas_kernels/mosaic_decode_heads.py, or the all-heads kernel where the call runs the "
        "per-KV-head one): one sweep line each",
    )
    ap.add_argument("--no-fp8", action="store_true", help="skip the FP8 KV rows")
    ap.add_argument(
        "--fp8-q-lens", default="1", help="query tokens per request of the FP8 rows (causal past 1), comma-separated"
    )
    ap.add_argument(
        "--q-lens",
        default="4",
        help="query tokens per request of the extra verify rows (causal), comma-separated",
    )
    ap.add_argument(
        "--extra-shapes",
        default="64x4096,1x32768",
        help="batch x length of the extra verify and FP8 rows, as --shapes (a trailing u: uneven lengths)",
    )
    ap.add_argument(
        "--set",
        default="",
        help="kernel options (mosaic_decode.KernelOptions fields), e.g. overlap_qk=0,kernel_combine=0 (A/B runs)",
    )
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])

    from jattn.pallas_kernels import mosaic_decode as md
    from jattn.pallas_kernels import triton_decode, triton_glue

    try:
        import flash_attn3_jax as fa3
    except ImportError:
        fa3 = None

    opts = parse_options(args.set)
    global HQ, HKV, D
    HQ, HKV, D = parse_heads(args.heads, args.head_dim)
    if common.no_gpu("decode"):
        return 1
    print(f"kernel options: {opts}")

    copy_bw, how, dev = common.announce_device()
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    shapes = [(bs, L, False) for bs, L in SHAPES] if args.shapes is None else parse_shapes(args.shapes)
    rows_spec = [(ps, bs, L, 1, jnp.bfloat16, u) for ps in page_sizes for bs, L, u in shapes]
    if not args.no_extra:
        extra_shapes = parse_shapes(args.extra_shapes)
        for ps in page_sizes:
            for ql in (int(x) for x in args.q_lens.split(",")):
                rows_spec += [(ps, bs, L, ql, jnp.bfloat16, u) for bs, L, u in extra_shapes]
            for ql in [] if args.no_fp8 else (int(x) for x in args.fp8_q_lens.split(",")):
                rows_spec += [(ps, bs, L, ql, jnp.float8_e4m3fn, u) for bs, L, u in extra_shapes]

    rng = np.random.default_rng(0)
    header = list(HEADER) + (["max err"] if args.check else [])
    rows, sweep, profiles = [], [], []
    for ps, bs, L, q_len, kv_dtype, uneven in rows_spec:
        kvname = "fp8" if kv_dtype == jnp.float8_e4m3fn else "bf16"
        label = [ps, f"{bs}x{L}" + ("u" if uneven else ""), q_len, kvname]
        itemsize = jnp.dtype(kv_dtype).itemsize
        n_hi = args.n_hi if 2 * bs * L * HKV * D * itemsize >= (512 << 20) else 4 * args.n_hi
        try:
            qs, k, v, tables, lens, kv_bytes = _setup(bs, L, ps, q_len, kv_dtype, rng, n_hi, uneven)
        except Exception as e:  # noqa: BLE001
            rows.append(label + ["-", f"setup failed: {type(e).__name__}"] + [""] * (len(header) - 6))
            continue
        reason = md.unsupported_reason(qs[0], k, v, max_seqlen_q=q_len)
        if reason is not None:
            pad = ["-"] * (len(header) - 6 - bool(args.check))
            rows.append(label + ["-", "n/a"] + pad + ([reason] if args.check else []))
            print(f"skip {label}: {reason}")
            continue
        kscale = 0.5 if kvname == "fp8" else 1.0

        def step(i, qs, k, v, tables, lens, options=opts, **extra):
            return md.mha_decode(
                qs[i],
                k,
                v,
                tables[i % len(tables)],
                lens,
                max_seqlen_q=q_len,
                k_scale=kscale,
                v_scale=kscale,
                options=options,
                **extra,
            )

        # the call runs the per-KV-head kernel where mosaic_decode routes it (splits column: "h" + its count)
        route = (qs[0], k, v, q_len, -1, 0.0, None, None, kscale, kscale)
        heads = md.routed_heads_kernel(*route, is_causal=True, options=opts) is not None
        noheads = dataclasses.replace(opts, heads_kernel=False)
        bsz = (
            None
            if heads
            else md.choose_block_sizes(
                batch=bs,
                num_kv_heads=HKV,
                head_dim=D,
                page_size=ps,
                max_pages=tables.shape[-1],
                m_rows=q_len * HQ,
                kv_itemsize=jnp.dtype(kv_dtype).itemsize,
                options=opts,
            )
        )
        try:
            t = common.time_rotated(step, (qs, k, v, tables, lens), n_hi=n_hi, device=True)
            tbs = kv_bytes / t.seconds / 1e12
            cells = [
                f"h{_heads_splits(bs, L, ps, q_len, opts.heads_row_tile)}" if heads else bsz.num_splits,
                f"{t.seconds * 1e6:.1f}",
                f"{tbs:.2f}",
                f"{100 * kv_bytes / t.seconds / copy_bw:.0f}%",
            ]
            cells += (
                ["-", "-"]
                if t.device_seconds is None
                else [f"{t.device_seconds * 1e6:.1f}", f"{kv_bytes / t.device_seconds / 1e12:.2f}"]
            )
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
            cells = ["-", f"FAILED: {msg}", "-", "-", "-", "-"]
        peer = "-"
        if not args.no_peer and q_len == 1 and kvname == "bf16":
            try:
                pstep, pargs = _jax_paged_attention(qs, k, v, tables, lens, ps)
                pt = common.time_rotated(pstep, pargs, n_hi=n_hi, device=True)
                peer = f"{kv_bytes / pt.seconds / 1e12:.2f}"
                if pt.device_seconds is not None:
                    peer += f" ({kv_bytes / pt.device_seconds / 1e12:.2f})"
                del pargs
            except Exception as e:  # noqa: BLE001
                peer = "fails: " + (str(e).splitlines()[0][:50] if str(e) else type(e).__name__)
        tri = ["-", "-"]
        targs = (qs, k, v, tables, lens)
        if triton_glue.available() and triton_decode.unsupported_reason(qs[0], k, v, max_seqlen_q=q_len) is None:
            got, err = _time_decode(triton_decode.mha_decode, targs, n_hi, q_len, kscale)
            tri = ["-", "fails: " + err[:50]] if err else [f"{got * 1e6:.1f}", f"{kv_bytes / got / 1e12:.2f}"]
        if args.heads_kernel:
            from jattn.pallas_kernels import mosaic_decode_heads as mh

            why = mh.unsupported_reason(qs[0], k, v, max_seqlen_q=q_len)
            if heads:  # the row ran the per-KV-head kernel: time the all-heads one
                other, fn = "all-heads kernel", functools.partial(md.mha_decode, options=noheads)
            elif kvname == "fp8":  # its FP8 path: the e4m3 query (V^T in registers with heads_v_regs)
                other = "per-KV-head kernel (fp8_qk" + (", v_regs)" if opts.heads_v_regs else ")")
                fn = md.heads_kernel_for(  # as mha_decode routes it with fp8_heads on (None: not served)
                    qs[0], k, v, q_len, -1, 0.0, None, None, kscale, kscale, fp8_heads=True,
                    overlap=opts.heads_overlap, glue=opts.heads_glue, v_regs=opts.heads_v_regs,
                    balanced=bool(opts.balanced_splits),
                )  # fmt: skip
            else:
                other, fn = "per-KV-head kernel", mh.mha_decode_heads
            line = f"page {ps} {bs}x{L} q_len {q_len} {kvname} {other}: "
            if why is None or heads:
                got, err = _time_decode(fn, targs, n_hi, q_len, kscale)
                line += "fails: " + err[:200] if err else f"device {got * 1e6:.1f} us, {kv_bytes / got / 1e12:.2f} TB/s"
            else:
                line += f"not served ({why})"
            sweep.append(line)
            print(line, flush=True)  # now too: a run cut off by a time limit keeps it
        fa = ["-"] * 4
        if fa3 is not None and not args.no_peer and kvname == "bf16":
            best = None
            for sp in _fa3_splits(bs, tables.shape[-1], ps):
                try:
                    fstep = _fa3_step(fa3, q_len, sp)
                    ft = common.time_rotated(fstep, (qs, k, v, tables, lens), n_hi=n_hi, device=True)
                except Exception as e:  # noqa: BLE001
                    fa = ["-", "fails: " + (str(e).splitlines()[0][:50] if str(e) else type(e).__name__), "-", "-"]
                    continue
                if best is None or (ft.device_seconds or ft.seconds) < (best.device_seconds or best.seconds):
                    best = ft
                sweep.append(
                    f"page {ps} {bs}x{L} q_len {q_len} FA3 num_splits={sp}: wall {ft.seconds * 1e6:.1f} us, "
                    f"device {(ft.device_seconds or 0) * 1e6:.1f} us"
                )
            if best is not None:
                dev_s = best.device_seconds
                fa = [
                    f"{best.seconds * 1e6:.1f}",
                    f"{kv_bytes / best.seconds / 1e12:.2f}",
                    "-" if dev_s is None else f"{dev_s * 1e6:.1f}",
                    "-" if dev_s is None else f"{kv_bytes / dev_s / 1e12:.2f}",
                ]
        # Other timing methods of the same calls (targs), each one line of the sweep.
        methods = []
        if args.graph:
            methods.append(("graph", lambda: common.time_rotated(step, targs, n_hi=n_hi, graph=True)))
        if args.separate_outputs:
            methods.append(
                ("every output its own array", lambda: common.time_rotated(step, targs, n_hi=n_hi, join=False))
            )
        if args.no_cmd_buffers:
            methods.append(("no command buffers", lambda: common.time_rotated(step, targs, n_hi=n_hi, graph="off")))
        if args.invariant:
            from jattn import ops

            inv = ops._invariant_splits(md.mha_decode, qs[0], k, tables[0], q_len)

            istep = functools.partial(step, options=md.KernelOptions(), **inv)  # the default options

            methods.append(
                (
                    f"batch-invariant ({inv['block_sizes'].num_splits} splits), device time",
                    lambda: _device_timing(common.time_rotated(istep, targs, n_hi=n_hi, device=True)),
                )
            )
        if kvname == "fp8":  # FP8's other path, same run: the all-heads kernel where the row runs
            # the per-KV-head one (KernelOptions.fp8_heads), else its other upcast (fp8_converter)
            flip = "fp8_heads" if heads else "fp8_converter"
            other = dataclasses.replace(opts, **{flip: not getattr(opts, flip)})

            cstep = functools.partial(step, options=other)

            methods.append(
                (
                    f"{flip}={int(getattr(other, flip))}, device time",
                    lambda: _device_timing(common.time_rotated(cstep, targs, n_hi=n_hi, device=True)),
                )
            )
        if args.loop:
            nrot = qs.shape[0]

            def lstep(i, qs, k, v, tables, lens):
                return md.mha_decode(
                    qs[lax.rem(i, nrot)],
                    k,
                    v,
                    tables[lax.rem(i, len(tables))],
                    lens,
                    max_seqlen_q=q_len,
                    k_scale=kscale,
                    v_scale=kscale,
                    options=opts,
                )

            methods += [
                (f"loop graph={lg}", lambda lg=lg: common.time_loop(lstep, targs, graph=lg)) for lg in (True, False)
            ]
        for how_timed, timed in methods:
            try:
                t = timed()
                sweep.append(
                    f"page {ps} {bs}x{L} q_len {q_len} {kvname} {how_timed}: "
                    f"{t.seconds * 1e6:.1f} us {kv_bytes / t.seconds / 1e12:.2f} TB/s "
                    f"(spread {t.spread:.2f})"
                )
            except Exception as e:  # noqa: BLE001
                sweep.append(f"page {ps} {bs}x{L} {how_timed}: failed {type(e).__name__}: {str(e)[:160]}")
            print(sweep[-1], flush=True)
        if args.splits_sweep and bsz is not None and bs == 1 and q_len == 1 and kvname == "bf16":
            for sp in [int(x) for x in args.splits_sweep.split(",")]:
                bsz_sp = dataclasses.replace(bsz, num_splits=sp)

                def step_sp(i, qs, k, v, tables, lens, bsz_sp=bsz_sp):
                    return md.mha_decode(qs[i], k, v, tables[i % len(tables)], lens, block_sizes=bsz_sp, options=opts)

                try:
                    ts = common.time_rotated(step_sp, (qs, k, v, tables, lens), n_hi=n_hi)
                    sweep.append(
                        f"page {ps} {bs}x{L} splits {sp}: {ts.seconds * 1e6:.1f} us "
                        f"{kv_bytes / ts.seconds / 1e12:.2f} TB/s"
                    )
                except Exception as e:  # noqa: BLE001
                    sweep.append(f"page {ps} {bs}x{L} splits {sp}: failed {type(e).__name__}")
        if args.profile:
            from jattn.bench import profile as prof

            qlist = [qs[i] for i in range(8)]
            tlist = [tables[i] for i in range(len(tables))]

            def one(q, k, v, t, lens):
                return md.mha_decode(q, k, v, t, lens, max_seqlen_q=q_len, k_scale=kscale, v_scale=kscale, options=opts)

            try:
                summ = prof.summarize(
                    prof.profile_calls(one, [(qlist[i], k, v, tlist[i % len(tables)], lens) for i in range(8)])
                )
                profiles.append(
                    f"page {ps} {bs}x{L} q_len {q_len} {kvname}: "
                    f"{kv_bytes / (summ.span_us * 1e-6) / 1e12:.2f} TB/s over the span\n" + summ.table()
                )
            except Exception as e:  # noqa: BLE001
                profiles.append(f"page {ps} {bs}x{L}: profile failed {type(e).__name__}: {str(e)[:200]}")
            print(profiles[-1], flush=True)
        row = label + cells + [peer] + tri + fa
        if args.check:
            from jattn import reference

            out = md.mha_decode(
                qs[0], k, v, tables[0], lens, max_seqlen_q=q_len, k_scale=kscale, v_scale=kscale, options=opts
            )
            q_ref = qs[0]
            if heads and kvname == "fp8":  # the e4m3-query path: against what it attends with
                from jattn.pallas_kernels import mosaic_decode_heads as mh

                q_ref = mh.fp8_qk_query(qs[0], HKV, q_len, opts.heads_row_tile)
            ref = reference.mha_decode(q_ref, k, v, tables[0], lens, max_seqlen_q=q_len, k_scale=kscale, v_scale=kscale)
            row.append(f"{float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))):.2e}")
        rows.append(row)
        print(" | ".join(str(c) for c in row), flush=True)
        del qs, k, v, tables
    print()
    print(
        f"decode: Hq={HQ} Hkv={HKV} D={D}, bf16 q; TB/s counts K+V bytes read once; "
        f"copy {copy_bw / 1e12:.2f} TB/s ({how}); {dev}"
    )
    print(
        "jattn us: wall time per call (n calls in one jit, differential of median walls: "
        "XLA's per-execution host work included); device us: GPU time per call between "
        "%globaltimer stamps around the calls (as CUDA events around a CUDA-graph replay "
        "time the peers in docs/PERF.md)"
    )
    if profiles:
        print("profiles (8 calls, inputs rotated, a sync after each; medians per call):")
        print("\n".join(profiles))
    if sweep:
        print("graph timings, split-count sweep:")
        print("\n".join(sweep))
    ratios = verify_ratios(header, rows)
    if ratios:
        print("multi-token rows against q_len 1 (device time, this run):")
        print("\n".join(ratios))
    print(common.fmt_table(header, rows))
    meta = dict(device=dev, jax=jax.__version__, copy_tbs=copy_bw / 1e12, copy_how=how)
    common.save_outputs(args, "decode", header, rows, meta)


if __name__ == "__main__":
    main()
