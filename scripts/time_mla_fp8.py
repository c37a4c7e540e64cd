"""Probe: where the FP8 MLA decode kernel's time goes, by ablation (GPU only).

    python scripts/time_mla_fp8.py [VARIANT ...]

Times the Mosaic MLA decode at 64 x 4096, 16 heads, q_len 1 (GPU time per call, the
``bench mla`` harness) in bf16 and FP8, and FP8 builds of the kernel with one piece of
work removed by patching the kernel's source in memory: ``noupcast`` (the producer
does not write the V slot), ``nopv`` (no ``P V`` wgmma), ``noqk`` (no ``Q K^T``
wgmma); and ``up8bit``, the upcast loading e4m3 in the 8-bit ``wgmma`` register layout
(four to a thread and vector). Ablated builds compute wrong outputs; they only say what
each piece costs.
A variant joins tokens with ``+``: patch names, ``land=N`` (``N`` landing slots), ``vregs``
(``MLADecodeConfig.v_regs``: V^T read into registers, no upcast slot), ``split=C``
(with ``vregs``: warpgroup 0's value columns), ``q8`` (the query
given in e4m3, as the MLA backend gives it: no row scales). ``len=N`` sets the request
length of every row (default 4096), ``nobf16`` skips the bf16 build.

``trace`` (alone, or with ``land=N``, ``vregs``, ``q8``) runs the FP8 kernel once under the Mosaic GPU
profiler and prints, per named region of the kernel (``jax.named_scope``), its count
and mean and total cycles per warpgroup, and the mean cycles between the starts of
warpgroup 0's successive ``Q K^T``: where each warpgroup's time goes block by block.
``trace bf16`` traces the 2-byte kernel instead; ``heads=``, ``batch=`` and ``len=`` set
the row (the profiler's buffer is shared memory: beside the bf16 kernel's Q tile and
two-slot ring it fits, counted, up to ``len=1024``).
"""

from __future__ import annotations

import sys
import types

import jax
import numpy as np

PATCHES = {
    "noupcast": [("v_smem.at[:, pl.ds(c, 64)][...] = kv_smem.at[slot, :, pl.ds(c, 64)][...].astype(dtype)", "pass")],
    "nopv": [("plgpu.wgmma(acc_ref, p, v)", "pass")],
    "noqk": [("plgpu.wgmma(acc_ref, q_smem, k.T)", "pass")],
    # the upcast loads e4m3 four to a thread and vector (32-bit loads), stores f16 so
    "up8bit": [
        (
            "v_smem.at[:, pl.ds(c, 64)][...] = kv_smem.at[slot, :, pl.ds(c, 64)][...].astype(dtype)",
            "v_smem.at[:, pl.ds(c, 64)][...] = cast_layout(kv_smem.at[slot, :, pl.ds(c, 64)][...], "
            "plgpu.Layout.WGMMA_8BIT, interpret=interp).astype(dtype)",
        )
    ],
    # the producer does not wait for the P V before, warpgroup 0 not for the upcast
    "nocycle": [("plgpu.barrier_wait(v_free.at[0])", "pass"), ("plgpu.barrier_wait(v_ready.at[0])", "pass")],
}


def kernel_options(tokens):
    """``MLADecodeConfig`` overrides named by the tokens: ``vregs`` / ``novregs`` (``v_regs``),
    ``split=C`` (``v_split``)."""
    out = []
    if "vregs" in tokens or "novregs" in tokens:
        out.append(("v_regs", "vregs" in tokens))
    out += [("v_split", int(t[6:])) for t in tokens if t.startswith("split=")]
    return out


def variant_query(tokens, qs):
    """The queries as a variant names them: in e4m3 with ``q8`` (as the MLA backend gives
    them), else as drawn (bf16, quantised per row by the wrapper on an FP8 cache)."""
    if "q8" not in tokens:
        return qs
    from jattn.mla_rope import quantize_query_fp8

    return quantize_query_fp8(qs)


def patched_run(names, extra=()):
    """The kernel module's ``run`` with the named pieces removed (and ``extra`` source
    replacements made)."""
    from jattn.pallas_kernels import mosaic_mla_kernel as mk

    src = open(mk.__file__).read()
    for name, pairs in [*((n, PATCHES[n]) for n in names), ("extra", extra)]:
        for old, new in pairs:
            if old not in src:
                raise SystemExit(f"patch {name}: source line not found")
            src = src.replace(old, new)
    mod = types.ModuleType(f"mla_kernel_{'_'.join(names)}")
    sys.modules[mod.__name__] = mod
    exec(compile(src, mk.__file__, "exec"), mod.__dict__)
    return mod.run


def decode(row, land, q, kv, table, lens, options=()):
    """The Mosaic MLA decode of ``row`` (q_len 1, the bench's scale) with ``land`` landing slots
    and ``options``, ``(field, value)`` pairs of ``MLADecodeConfig``."""
    from jattn.bench import mla
    from jattn.pallas_kernels import mosaic_mla

    return mosaic_mla._mla_decode(
        q,
        kv,
        table,
        lens,
        mla.SCALE,
        1.0,
        kv_lora_rank=mla.R,
        max_seqlen_q=1,
        is_causal=True,
        return_lse=False,
        num_splits=mosaic_mla.choose_num_splits(row.bs, -(-row.heads // 64), row.length // 64),
        score_scale=mla.SCALE,
        land_stages=land,
        interpret=False,
        options=tuple(options),
    )


def trace(variants, length, heads=16, batch=64):
    """The FP8 kernel (``bf16`` among the variants: the 2-byte one) once under the Mosaic GPU
    profiler; the regions' statistics."""
    import glob
    import json
    import os
    import tempfile

    from jattn.bench import mla
    from jattn.pallas_kernels import mosaic_mla

    land = next((int(v[5:]) for v in variants if v.startswith("land=")), 2)
    options = kernel_options(variants)
    out_dir = tempfile.mkdtemp(prefix="mla_trace_")
    fp8 = "bf16" not in variants
    # ranges a warpgroup records per block: up to 6 with FP8, 3 in bf16 (wait, Q K^T or P, P V)
    space = length // 64 * (6 if fp8 else 3) + 16
    mosaic_mla.run = patched_run(
        [],
        extra=[
            (
                "plgpu.CompilerParams(approx_math=True)",
                f"plgpu.CompilerParams(approx_math=True, profile_space={space}, profile_dir={out_dir!r})",
            )
        ],
    )
    rng = np.random.default_rng(0)
    row = mla.Row(batch, length, heads, fp8=fp8)
    qs, kv, tables, lens, lens_np = mla._setup(row, rng, 2)
    qs = variant_query(variants, qs)
    out = decode(row, land, qs[0], kv, tables[0], lens, options)
    jax.block_until_ready(out)
    jax.effects_barrier()
    files = glob.glob(os.path.join(out_dir, "*.json"))
    if not files:
        raise SystemExit(f"no trace in {out_dir}")
    events = json.load(open(files[0]))["traceEvents"]
    stats, stacks, qk_starts = {}, {}, {}
    for e in events:
        key = e["tid"]
        if e["ph"] == "B":
            stacks.setdefault(key, []).append((e["name"], e["ts"]))
            if e["name"] == "wg0_qk":
                qk_starts.setdefault(key, []).append(e["ts"])
        else:
            name, t0 = stacks[key].pop()
            st = stats.setdefault(name, [0, 0.0])
            st[0] += 1
            st[1] += (e["ts"] - t0) * 1e3  # the dump writes clock cycles as ns, then / 1e3
    ctas = len({e["tid"] for e in events if e["name"] == "wg0_qk"})
    print(f"trace: land={land} {options}, {ctas} CTAs, {len(events)} events; cycles per occurrence, and per CTA")
    for name in sorted(stats):
        n, tot = stats[name]
        print(f"  {name:18s} n/CTA {n / ctas:6.1f}  mean {tot / n:8.1f}  per CTA {tot / ctas:10.0f}")
    gaps = [np.diff(v) * 1e3 for v in qk_starts.values() if len(v) > 1]
    if gaps:
        g = np.concatenate(gaps)
        print(
            f"  wg0 block period: mean {g.mean():.0f} cycles, median {np.median(g):.0f}, p90 {np.percentile(g, 90):.0f}"
        )


def main(variants):
    from jattn.bench import mla
    from jattn.pallas_kernels import mosaic_mla

    rng = np.random.default_rng(0)
    n_hi = 8
    length = next((int(v[4:]) for v in variants if v.startswith("len=")), 4096)
    heads = next((int(v[6:]) for v in variants if v.startswith("heads=")), 16)
    batch = next((int(v[6:]) for v in variants if v.startswith("batch=")), 64)
    variants = [v for v in variants if not v.startswith(("len=", "heads=", "batch="))]
    if "trace" in variants:
        return trace(variants, length, heads, batch)
    base_run = mosaic_mla.run
    for fp8 in (False, True) if "nobf16" not in variants else (True,):
        row = mla.Row(batch, length, heads, fp8=fp8)
        qs, kv, tables, lens, lens_np = mla._setup(row, rng, n_hi)
        nbytes, flops = mla.row_bytes_flops(row, lens_np)
        todo = ["base"] + ([v for v in variants if v != "nobf16"] if fp8 else [])
        for v in todo:
            tokens = v.split("+")
            land = next((int(t[5:]) for t in tokens if t.startswith("land=")), mosaic_mla.FP8_LAND_STAGES)
            options = kernel_options(tokens)
            patches = [t for t in tokens if t in PATCHES]
            mosaic_mla.run = patched_run(patches) if patches else base_run
            arrays = (variant_query(tokens, qs), kv, tables, lens)
            jax.clear_caches()

            def call(q, kv, table, lens, land=land, row=row, options=options):
                return decode(row, land, q, kv, table, lens, options)

            s = mla.time_calls(f"{row.label} {v}", call, arrays, n_hi)
            if s:
                print(
                    f"{row.label} {v}: {s * 1e6:.1f} us  {nbytes / s / 1e12:.2f} TB/s  {flops / s / 1e12:.0f} TFLOP/s",
                    flush=True,
                )
    mosaic_mla.run = base_run


if __name__ == "__main__":
    main(sys.argv[1:])
