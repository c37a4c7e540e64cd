"""``python -m jattn bench mla``: DeepSeek MLA absorbed paged decode on the GPU.

The latent cache is ``[pages, 64, 576]`` (512 latent + 64 rope columns), the output
512 wide. Each row (batch, length, heads, q_len, lengths even or uneven, cache
dtype) times jattn's Mosaic GPU kernel (also with the split choice its default does
not take: ``balanced_splits`` flipped) and its Triton kernel (where
jax-triton imports) beside JAX's reference path (XLA) on the same data, one line per
backend, in GPU time per call (``common.time_rotated(device=True)``, each output
its own array), and reports the achieved bandwidth (each request's latent rows counted
once, whatever a kernel rereads; the query and output counted too) against the copy
bandwidth measured in the same run, and TFLOP/s (``2 * rows * L * (576 + 512)``)
against the bf16 matmul rate. Page tables rotate over a pool larger than L2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench import common

R, W, PAGE = 512, 576, 64
HEADER = ("row", "backend", "us (GPU)", "TB/s", "% copy", "TFLOP/s", "% matmul", "xla us", "speedup")
SCALE = 1.0 / 192**0.5


@dataclasses.dataclass(frozen=True)
class Row:
    bs: int
    length: int
    heads: int
    q_len: int = 1
    uneven: bool = False  # lengths spread from length/8 to length (mean ~length/2)
    fp8: bool = False

    @property
    def label(self) -> str:
        extra = (" uneven" if self.uneven else "") + (" fp8" if self.fp8 else "")
        return f"{self.bs}x{self.length} h{self.heads} q{self.q_len}{extra}"


ROWS = (
    Row(64, 4096, 16),
    Row(128, 4096, 16),
    Row(1, 32768, 16),
    Row(64, 4096, 16, q_len=2),
    Row(64, 4096, 16, uneven=True),
    Row(64, 4096, 128),
    Row(128, 4096, 128),
    Row(64, 4096, 128, q_len=2),
    Row(64, 4096, 128, uneven=True),  # whether balanced splits pay at two row tiles
    Row(64, 4096, 16, fp8=True),
    Row(128, 4096, 16, fp8=True),
    Row(1, 32768, 16, fp8=True),
    Row(64, 4096, 16, q_len=2, fp8=True),
    Row(64, 4096, 128, fp8=True),
    Row(64, 4096, 16, uneven=True, fp8=True),  # and with an FP8 cache
)


def lengths(row: Row, rng) -> np.ndarray:
    return common.batch_lengths(rng, row.bs, row.length, row.uneven)


def row_bytes_flops(row: Row, lens: np.ndarray, q_itemsize: int = 2) -> tuple[float, float]:
    """Bytes the op needs (each request's latent rows once, q at ``q_itemsize`` bytes, the
    2-byte out) and FLOPs. The same count for every backend given the same query: a kernel
    that reads the latent once per row tile (the Mosaic kernel's 64 rows: twice at 128
    heads) moves more than this, so its TB/s here is not its memory rate; at 128 heads
    TFLOP/s is the figure."""
    itemsize = 1 if row.fp8 else 2
    m_rows = row.q_len * row.heads
    kv = float(lens.sum()) * W * itemsize
    qo = row.bs * m_rows * (W * q_itemsize + R * 2)
    flops = 2.0 * m_rows * float(lens.sum()) * (W + R)
    return kv + qo, flops


def _setup(row: Row, rng, num_q: int):
    lens = lengths(row, rng)
    max_pages = -(-int(lens.max()) // PAGE)
    dtype = jnp.float8_e4m3fn if row.fp8 else jnp.bfloat16
    page_bytes = PAGE * W * jnp.dtype(dtype).itemsize
    tables, num_pages = common.page_rotations(rng, row.bs, max_pages, page_bytes)
    kv = (jax.random.normal(jax.random.key(1), (num_pages, PAGE, W), jnp.float32) * 0.5).astype(dtype)
    qs = jax.random.normal(jax.random.key(2), (num_q, row.bs * row.q_len, row.heads, W), jnp.bfloat16)
    return qs, kv, jnp.asarray(tables), jnp.asarray(lens), lens


def sweep_tunings(spec: str) -> list:
    """The Triton launch choices of ``--sweep``: groups separated by '|', each the product of
    ``field=v1,v2`` lists separated by ';' over :class:`triton_mla.Tuning`'s defaults, and
    optionally led by ``fp8:`` or ``bf16:`` (then it times only rows of that cache dtype).
    Returns ``[(tuning, only)]`` with ``only`` None, "fp8" or "bf16" (none for '')."""
    import itertools

    from jattn.pallas_kernels import triton_mla

    fields = {f.name for f in dataclasses.fields(triton_mla.Tuning)}
    out = []
    for group in spec.split("|"):
        group = group.strip()
        only = None
        for tag in ("fp8", "bf16"):
            if group.startswith(tag + ":"):
                only, group = tag, group[len(tag) + 1 :]
        axes = []
        for part in (p.strip() for p in group.split(";")):
            if not part:
                continue
            name, _, values = part.partition("=")
            if name.strip() not in fields:
                raise ValueError(f"unknown field {name.strip()!r}; choose from {', '.join(sorted(fields))}")
            axes.append([(name.strip(), int(v)) for v in values.split(",") if v.strip()])
        if axes:
            out += [
                (dataclasses.replace(triton_mla.DEFAULT_TUNING, **dict(combo)), only)
                for combo in itertools.product(*axes)
            ]
    return out


def tuning_label(tuning) -> str:
    """``triton m32 n64 w4 s2 v2``: a Triton launch choice as a backend column."""
    t = tuning
    extra = (f" x{t.swap}" if t.swap else "") + (f" f{t.fp8_math}" if t.fp8_math else "")
    extra += " p" if t.prefetch else ""
    return f"triton m{t.block_m} n{t.block_n} w{t.num_warps} s{t.num_stages} v{t.waves}{extra}"


def time_calls(label: str, call, arrays, n_hi: int):
    """GPU seconds per ``call(q, kv, page_table, lens)`` on the rotated ``arrays`` (the
    queries and page tables rotate), or None, printed under ``label``, when it fails
    (a backend that cannot run the row, a launch that does not fit)."""
    qs, kv, tables, lens = arrays

    def step(i, qs, kv, tables, lens):
        return call(qs[i], kv, tables[i % len(tables)], lens)

    try:
        t = common.time_rotated(step, (qs, kv, tables, lens), n_hi=n_hi, reps=3, join=False, device=True)
        return common.device_or_wall(t)
    except Exception as e:  # noqa: BLE001
        print(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        return None


def _profile(row: Row, arrays, kw, nbytes: float) -> str:
    """The device kernels of one Mosaic call (the decode kernel, the combine, any glue)."""
    import jattn
    from jattn.bench import profile as prof

    qs, kv, tables, lens = arrays

    @jax.jit
    def one(q, table):  # jitted as in a serving step: the scales are constants
        return jattn.mla_decode_with_kvcache(q, kv, table, lens, backend="mosaic", **kw)

    try:
        summ = prof.summarize(prof.profile_calls(one, [(qs[i], tables[i % len(tables)]) for i in range(8)]))
    except Exception as e:  # noqa: BLE001
        return f"{row.label}: profile failed {type(e).__name__}: {str(e)[:200]}"
    return f"{row.label}: {nbytes / (summ.span_us * 1e-6) / 1e12:.2f} TB/s over the span\n" + summ.table()


def fp8_against_bf16(out: list[list[str]]) -> list[str]:
    """Issue 15's FP8 figure from the table's rows: for each FP8 row whose bf16 twin (the
    same label without `` fp8``) was timed, the fastest Mosaic column of each and the FP8
    tokens/s over the bf16 tokens/s (the same tokens, so the time ratio)."""
    best: dict[str, tuple[float, str]] = {}
    for cells in out:
        label, backend, us = cells[0], cells[1], cells[2]
        if backend.startswith("mosaic") and us != "-":
            t = float(us)
            if label not in best or t < best[label][0]:
                best[label] = (t, backend)
    lines = []
    for label, (t8, b8) in best.items():
        twin = label[: -len(" fp8")] if label.endswith(" fp8") else None
        if twin in best:
            t16, b16 = best[twin]
            lines.append(f"{label}: {t8:.1f} us ({b8}) against bf16 {t16:.1f} us ({b16}): {t16 / t8:.2f}x tokens/s")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m jattn bench mla", description=__doc__)
    ap.add_argument(
        "--rows",
        default="",
        help="comma-separated row labels, timed in that order (default: all): " + ", ".join(r.label for r in ROWS),
    )
    ap.add_argument("--no-xla", action="store_true", help="time jattn only")
    ap.add_argument(
        "--sweep",
        default="",
        help="also time the Triton kernel at these launch choices (triton_mla.Tuning fields), the "
        "product of ';'-separated lists, e.g. 'block_n=32,64;num_warps=4,8;num_stages=2,3'; several "
        "such groups separated by '|', each optionally led by 'fp8:' or 'bf16:' (rows of that cache only)",
    )
    ap.add_argument("--no-mosaic", action="store_true", help="do not time the Mosaic kernel")
    ap.add_argument(
        "--mosaic-splits",
        default="",
        help="also time the Mosaic kernel at these split counts (comma-separated; default: its own choice only)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile the Mosaic call per row: device span, kernel time, each kernel",
    )
    common.add_output_args(ap)
    args = ap.parse_args(argv if argv is not None else sys.argv[1:])
    try:
        tunings = sweep_tunings(args.sweep)
    except (TypeError, ValueError) as e:
        ap.error(f"--sweep: {e}")
    try:
        mosaic_splits = [int(v) for v in args.mosaic_splits.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--mosaic-splits: {args.mosaic_splits!r} is not a comma-separated list of integers")
    try:
        rows, _ = common.select_rows(ROWS, args.rows)
    except ValueError as e:
        ap.error(f"--rows: {e}")
    if common.no_gpu("mla"):
        return 1
    import jattn
    from jattn.bench.prefill import matmul_rate
    from jattn.pallas_kernels import mosaic_mla, mosaic_mla_heads, triton_glue, triton_mla

    triton_mla_runs = triton_glue.available()

    copy_bw, how = common.copy_bandwidth()
    rate = matmul_rate()
    print(
        f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; copy {copy_bw / 1e12:.2f} TB/s ({how}); "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )
    header = list(HEADER)
    out, profiles = [], []
    rng = np.random.default_rng(0)
    n_hi = 8
    for row in rows:
        qs, kv, tables, lens, lens_np = _setup(row, rng, n_hi)
        nbytes, flops = row_bytes_flops(row, lens_np)
        kw = dict(kv_lora_rank=R, softmax_scale=SCALE, max_seqlen_q=row.q_len, is_causal=True)

        arrays = (qs, kv, tables, lens)

        def timed(backend, arrs=arrays, column=None):
            def call(q, kv, table, lens):
                return jattn.mla_decode_with_kvcache(q, kv, table, lens, backend=backend, **kw)

            return time_calls(f"{row.label}: {column or backend}", call, arrs, n_hi)

        def timed_tuning(tuning):
            def call(q, kv, table, lens):
                return triton_mla.mla_decode(q, kv, table, lens, tuning=tuning, **kw)

            return time_calls(f"{row.label}: {tuning_label(tuning)}", call, arrays, n_hi)

        def timed_keys_as_rows():
            def call(q, kv, table, lens):
                return mosaic_mla.mla_decode(q, kv, table, lens, keys_as_rows=True, **kw)

            return time_calls(f"{row.label}: mosaic keys as rows", call, arrays, n_hi)

        def timed_other_splits(balanced):
            """The split choice this row's default does not take (``balanced_splits``)."""
            label = "mosaic balanced" if balanced else "mosaic even splits"

            def call(q, kv, table, lens):
                return mosaic_mla.mla_decode(q, kv, table, lens, balanced_splits=balanced, **kw)

            return label, time_calls(f"{row.label}: {label}", call, arrays, n_hi)

        def timed_splits(splits):
            def call(q, kv, table, lens):
                return mosaic_mla.mla_decode(q, kv, table, lens, num_splits=splits, **kw)

            return time_calls(f"{row.label}: mosaic s{splits}", call, arrays, n_hi)

        def timed_q_e4m3():
            """The query quantised by the caller (as the MLA backend's FP8 path does): no
            quantisation step inside the timed call."""
            from jattn.mla_rope import quantize_query_fp8

            return timed("mosaic", (quantize_query_fp8(qs), kv, tables, lens), "mosaic q e4m3")

        why = mosaic_mla.unsupported_reason(qs[0], kv, kv_lora_rank=R, max_seqlen_q=row.q_len)
        if args.no_mosaic:
            why = "--no-mosaic"
        elif why:
            print(f"{row.label}: the mosaic kernel refuses it ({why})")
        ref = None if args.no_xla else timed("xla")
        kernels = [] if args.no_mosaic else [("mosaic", None if why else timed("mosaic"))]
        if not why:
            kernels += [(f"mosaic s{sp}", timed_splits(sp)) for sp in mosaic_splits]
            balanced = mosaic_mla.balanced_by_default(row.bs)
            kernels.append(timed_other_splits(not balanced))
            if mosaic_mla_heads.unsupported_reason(qs[0], kv, **kw) is None:
                kernels.append(("mosaic keys as rows", timed_keys_as_rows()))
            if row.fp8:
                kernels.append(("mosaic q e4m3", timed_q_e4m3()))
            if args.profile:
                profiles.append(_profile(row, arrays, kw, nbytes))
                print(profiles[-1], flush=True)
        if triton_mla_runs:
            kernels.append(("triton", timed("triton")))
            for tuning, only in tunings:
                if only is None or only == ("fp8" if row.fp8 else "bf16"):
                    kernels.append((tuning_label(tuning), timed_tuning(tuning)))
        if ref is not None:
            kernels.append(("xla", ref))
        for backend, s in kernels:
            cells = [row.label, backend]
            # the e4m3 query column reads a 1-byte query
            moved = row_bytes_flops(row, lens_np, q_itemsize=1)[0] if backend == "mosaic q e4m3" else nbytes
            if s is None:
                cells += ["-"] * 7
            else:
                cells += [
                    f"{s * 1e6:.1f}",
                    f"{moved / s / 1e12:.2f}",
                    f"{100 * moved / s / copy_bw:.0f}",
                    f"{flops / s / 1e12:.0f}",
                    f"{100 * flops / s / rate:.0f}",
                    "-" if ref is None else f"{ref * 1e6:.1f}",
                    "-" if ref is None else f"{ref / s:.1f}x",
                ]
            out.append(cells)
            print(" | ".join(cells), flush=True)
    print(common.fmt_table(header, out))
    ratios = fp8_against_bf16(out)
    if ratios:
        print("FP8 cache against the bf16 cache (fastest Mosaic column of each):")
        print("\n".join(ratios))
    if profiles:
        print("profiles of the mosaic call (8 calls, inputs rotated, a sync after each; medians per call):")
        print("\n".join(profiles))
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, copy_tbs=copy_bw / 1e12, copy_how=how)
    common.save_outputs(args, "mla", header, out, dict(meta, matmul_tflops=rate / 1e12))


if __name__ == "__main__":
    main()
