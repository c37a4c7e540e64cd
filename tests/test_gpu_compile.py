"""Compile coverage of the Mosaic GPU kernels (marker ``gpu``): every kernel configuration
the dispatch can pick over a grid of head counts, head dims, KV dtypes, query lengths and
kernel options is lowered and compiled for the GPU, not run.

The Mosaic GPU interpreter (CPU CI) accepts programs the GPU compiler rejects, and the
compiler's layout inference changes between JAX releases: a configuration no run-time
test happens to draw can fail to compile on the GPU's JAX alone. Compiling is quick next
to running, so this grid is wider than the run-time tests' (which check the numbers).
Inputs are abstract (``jax.ShapeDtypeStruct``): nothing is allocated or executed.

``JATTN_LOWER_ONLY=1`` runs the grid on a machine without a GPU: each configuration is
lowered for CUDA (the Pallas lowering and the Mosaic GPU layout inference of the JAX
installed there) and not compiled.
"""

from __future__ import annotations

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import pytest

from jattn.pallas_kernels import mosaic_decode, mosaic_mla, mosaic_prefill
from jattn.pallas_kernels.interpret import on_gpu

pytestmark = pytest.mark.gpu

_BF16, _FP8, _I32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.int32


def _s(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _compile(fn, *args):
    if os.environ.get("JATTN_LOWER_ONLY") == "1":
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(jax, "default_backend", lambda: "gpu")  # the kernels' "GPU here?" check
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        return
    if not on_gpu():
        pytest.skip("needs a GPU (or JATTN_LOWER_ONLY=1)")
    jax.jit(fn).lower(*args).compile()


# ------------------------------------------------------------------ paged decode (both kernels)

_DECODE_HEADS = [(1, 1), (1, 8), (2, 16), (4, 4), (8, 64)]  # (KV heads, query heads)
_DECODE_OPTIONS = {
    "default": mosaic_decode.KernelOptions(),
    "no_overlap": mosaic_decode.KernelOptions(overlap_qk=False),
    "all_heads": mosaic_decode.KernelOptions(heads_kernel=False),
    "balanced": mosaic_decode.KernelOptions(heads_kernel=False, fp8_heads=False, balanced_splits=True),
}
_DECODE_GRID = [
    dict(hkv=hkv, hq=hq, d=d, kv=kv, q_len=q_len, opt=opt)
    for (hkv, hq), d, kv, q_len, opt in itertools.product(
        _DECODE_HEADS, (64, 128), ("bf16", "fp8"), (1, 4), [o for o in _DECODE_OPTIONS if o != "balanced"]
    )
]
# the all-heads kernel with balanced splits (the split size read after the lengths)
_DECODE_GRID += [
    dict(hkv=8, hq=32, d=128, kv=kv, q_len=q_len, opt="balanced", **extra)
    for kv, q_len, extra in (("bf16", 1, {}), ("fp8", 1, {}), ("bf16", 4, {}), ("bf16", 1, dict(window_left=100)))
]
# features on one GQA shape each: window, logit cap, sinks, non-causal draft block, page 64
_DECODE_GRID += [
    dict(hkv=8, hq=32, d=128, kv=kv, q_len=q_len, opt="default", **extra)
    for kv in ("bf16", "fp8")
    for q_len in (1, 4)
    for extra in (
        dict(window_left=100),
        dict(logit_cap=30.0),
        dict(sinks=True),
        dict(is_causal=False),
        dict(page_size=64),
        dict(return_lse=True),
    )
]

# one KV head at q_len 1 with a window, which the per-KV-head kernel does not serve: it stays
# on the all-heads kernel, whose build of one KV head at q_len 1 fails layout inference on
# jax 0.11 except with a window (with a cap or sinks it failed: refused, test_mosaic_decode_heads)
_DECODE_GRID += [
    dict(hkv=1, hq=hq, d=d, kv="bf16", q_len=1, opt="default", window_left=100) for hq in (1, 8) for d in (64, 128)
]


def _id(case: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items())


@pytest.mark.parametrize("c", _DECODE_GRID, ids=_id)
def test_decode_compiles(c):
    bs, width, ps = 4, 16, c.get("page_size", 16)
    kv_dtype = _FP8 if c["kv"] == "fp8" else _BF16
    q = _s((bs * c["q_len"], c["hq"], c["d"]), _BF16)
    cache = _s((bs * width + 1, ps, c["hkv"], c["d"]), kv_dtype)
    table, lens = _s((bs, width), _I32), _s((bs,), _I32)
    sinks = _s((c["hq"],), jnp.float32) if c.get("sinks") else None
    scales = dict(k_scale=0.5, v_scale=2.0) if c["kv"] == "fp8" else {}

    def fn(q, k, v, table, lens, *maybe_sinks):
        return mosaic_decode.mha_decode(
            q, k, v, table, lens,
            max_seqlen_q=c["q_len"], is_causal=c.get("is_causal", True),
            window_left=c.get("window_left", -1), logit_cap=c.get("logit_cap", 0.0),
            sinks=maybe_sinks[0] if maybe_sinks else None, return_lse=c.get("return_lse", False),
            options=_DECODE_OPTIONS[c["opt"]], **scales,
        )  # fmt: skip

    _compile(fn, q, cache, cache, table, lens, *([sinks] if sinks is not None else []))


# ------------------------------------------------------------------ ragged prefill and paged extend

_PREFILL_OPTIONS = {
    "default": None,
    "prefetch": mosaic_prefill.PrefillOptions(prefetch_k=True),
    "overlap": mosaic_prefill.PrefillOptions(overlap_pv=True),
    "persistent": mosaic_prefill.PrefillOptions(persistent=True),
    "l2": mosaic_prefill.PrefillOptions(l2_section_kib=16384),
}
_PREFILL_GRID = [
    dict(d=d, dv=dv, paged=paged, kv=kv, opt=opt)
    for (d, dv), paged, kv, opt in itertools.product(
        mosaic_prefill.SUPPORTED_HEAD_DIMS, (False, True), ("bf16", "fp8"), _PREFILL_OPTIONS
    )
    # the persistent launch stages its output outside the K/V ring: equal head dims only
    if not (opt == "persistent" and d != dv)
]


@pytest.mark.parametrize("c", _PREFILL_GRID, ids=_id)
def test_prefill_compiles(c):
    bs, tq, hq, hkv = 3, 512, 16, 4
    kv_dtype = _FP8 if c["kv"] == "fp8" else _BF16
    q = _s((tq, hq, c["d"]), _BF16)
    cu_q = _s((bs + 1,), _I32)
    scales = dict(k_scale=0.5, v_scale=2.0) if c["kv"] == "fp8" else {}
    kw = dict(return_lse=True, clean_edges=True, options=_PREFILL_OPTIONS[c["opt"]], **scales)
    if c["paged"]:
        ps, width = 16, 64
        k = _s((bs * width + 1, ps, hkv, c["d"]), kv_dtype)
        v = _s((bs * width + 1, ps, hkv, c["dv"]), kv_dtype)
        fn = functools.partial(mosaic_prefill.mha_extend, **kw)
        _compile(fn, q, k, v, _s((bs, width), _I32), _s((bs,), _I32), cu_q)
    else:
        k, v = _s((2 * tq, hkv, c["d"]), kv_dtype), _s((2 * tq, hkv, c["dv"]), kv_dtype)
        fn = functools.partial(mosaic_prefill.mha_prefill, **kw)
        _compile(fn, q, k, v, cu_q, _s((bs + 1,), _I32))


# ------------------------------------------------------------------ MLA absorbed decode

_MLA_GRID = [
    dict(heads=heads, kv=kv, q_len=q_len, rows=rows, splits=splits)
    for heads, kv, q_len, rows, splits in itertools.product(
        (16, 128), ("bf16", "fp8"), (1, 2), (False, True), (None, 1)
    )
    if not (rows and (heads * q_len > 32 or kv == "fp8"))  # keys as rows: 2-byte KV, at most 32 query rows
]
# balanced splits (the split size from the lengths, read by the kernel after them)
_MLA_GRID += [dict(heads=h, kv=kv, q_len=1, rows=False, splits="balanced") for h in (16, 128) for kv in ("bf16", "fp8")]


@pytest.mark.parametrize("c", _MLA_GRID, ids=_id)
def test_mla_decode_compiles(c):
    bs, width, ps, rank = 4, 8, 64, 512
    fp8 = c["kv"] == "fp8"
    q = _s((bs * c["q_len"], c["heads"], rank + 64), _FP8 if fp8 else _BF16)
    cache = _s((bs * width + 1, ps, rank + 64), _FP8 if fp8 else _BF16)

    def fn(q, cache, table, lens):
        return mosaic_mla.mla_decode(
            q, cache, table, lens, kv_lora_rank=rank, softmax_scale=0.07, max_seqlen_q=c["q_len"],
            kv_scale=0.5 if fp8 else 1.0, return_lse=True, keys_as_rows=c["rows"],
            **({"balanced_splits": True} if c["splits"] == "balanced" else {"num_splits": c["splits"]}),
        )  # fmt: skip

    _compile(fn, q, cache, _s((bs, width), _I32), _s((bs,), _I32))


# ------------------------------------------------------------------ edge sizes, every entry point

# The smallest and emptiest arrays each entry takes (one request, a page table of 0 or 1
# columns, 1 query row, 0 key rows, row counts not a multiple of 8): TMA descriptors and
# page lookups are where such sizes broke (a 0-row array has no descriptor).
_EDGE_GRID = (
    [dict(op="decode", bs=bs, width=w, q_len=ql) for bs in (1, 3) for w in (0, 1) for ql in (1, 4)]
    + [dict(op="mla", bs=bs, width=w, q_len=1) for bs in (1, 3) for w in (0, 1)]
    + [dict(op="prefill", t=t, tk=tk) for t in (0, 1, 9) for tk in (0, 1, 9)]
    + [dict(op="extend", t=t, width=w) for t in (0, 1, 9) for w in (0, 1)]
)


def _edge_call(c):
    """``(fn, args)`` of one edge-size call; abstract inputs."""
    if c["op"] == "decode":
        q, cache = _s((c["bs"] * c["q_len"], 32, 128), _BF16), _s((5, 16, 8, 128), _BF16)
        fn = functools.partial(mosaic_decode.mha_decode, max_seqlen_q=c["q_len"], return_lse=True)
        return fn, (q, cache, cache, _s((c["bs"], c["width"]), _I32), _s((c["bs"],), _I32))
    if c["op"] == "mla":
        q, cache = _s((c["bs"], 16, 576), _BF16), _s((5, 64, 576), _BF16)
        fn = functools.partial(mosaic_mla.mla_decode, kv_lora_rank=512, softmax_scale=0.07, return_lse=True)
        return fn, (q, cache, _s((c["bs"], c["width"]), _I32), _s((c["bs"],), _I32))
    q = _s((c["t"], 8, 128), _BF16)
    if c["op"] == "prefill":
        k = _s((c["tk"], 2, 128), _BF16)
        fn = functools.partial(mosaic_prefill.mha_prefill, max_seqlen_q=16, max_seqlen_kv=16, return_lse=True)
        return fn, (q, k, k, _s((2,), _I32), _s((2,), _I32))
    cache = _s((5, 16, 2, 128), _BF16)
    fn = functools.partial(mosaic_prefill.mha_extend, max_seqlen_q=16, return_lse=True)
    return fn, (q, cache, cache, _s((1, c["width"]), _I32), _s((1,), _I32), _s((2,), _I32))


@pytest.mark.parametrize("c", _EDGE_GRID, ids=_id)
def test_edge_sizes_compile(c):
    fn, args = _edge_call(c)
    _compile(fn, *args)
