"""Shared by the per-kernel compute-sanitizer scripts in this folder.

Each script makes one small call of one kernel (one compile, one launch) and checks the
result on the host against tests/naive.py, then prints one ``ok ...`` line: a run under
compute-sanitizer that prints no ``ok`` line did not exercise the kernel. Shapes are the
smallest that reach the code path the script is named after.

On a machine without a GPU the scripts run the Mosaic kernel under the Mosaic GPU
interpreter (a check of the scripts' logic, nothing for a sanitizer to see).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import naive  # noqa: E402  (tests/naive.py: the float64 restatement of the semantics)
import numpy as np  # noqa: E402

from jattn.pallas_kernels import mosaic_decode as md  # noqa: E402
from jattn.pallas_kernels.interpret import gpu_interpret, on_gpu, widen_cpu_pool  # noqa: E402

widen_cpu_pool()

_T0 = time.time()


def decode(
    name: str,
    *,
    lens,
    hq: int,
    hkv: int,
    d: int,
    page_size: int,
    q_len: int = 1,
    causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: bool = False,
    fp8: bool = False,
    splits: int = 1,
    max_pages: int | None = None,
    overlap_qk: bool = True,
    kernel_combine: bool = True,
    seed: int = 0,
) -> None:
    """One call of the Mosaic paged decode kernel (bf16 q; FP8 KV with scales if ``fp8``),
    ``splits`` KV splits per request, checked against naive float64 attention."""
    rng = np.random.default_rng(seed)
    # NaN in unused pages and page tails; max_pages widens the page table past the need
    pool = naive.Pool(rng, lens, page_size, extra_pages=1, max_pages=max_pages)
    ks, vs = (0.37, 0.61) if fp8 else (1.0, 1.0)
    k = pool.fill(rng, (hkv, d), scale=3 * ks if fp8 else 1.0)
    v = pool.fill(rng, (hkv, d), scale=3 * vs if fp8 else 1.0)
    if fp8:
        kc, vc = naive.quantize_fp8(k, ks), naive.quantize_fp8(v, vs)
    else:
        kc, vc = (np.asarray(x).astype(jnp.bfloat16) for x in (k, v))
    q = rng.standard_normal((len(lens) * q_len, hq, d)).astype(jnp.bfloat16)
    sk = (rng.standard_normal(hq) * 2).astype(np.float32) if sinks else None
    kw = dict(
        max_seqlen_q=q_len,
        is_causal=causal,
        window_left=window_left,
        logit_cap=logit_cap,
        k_scale=ks,
        v_scale=vs,
    )
    bsz = md.choose_block_sizes(
        batch=len(lens),
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        max_pages=pool.page_table.shape[1],
        m_rows=q_len * hq,
        kv_itemsize=1 if fp8 else 2,
    )
    if not on_gpu():
        # The interpreter refuses a CTA with more KV blocks than ring stages (the producer
        # leaves the last free-barrier phases unobserved): on the CPU, split finer.
        blocks = -(-pool.page_table.shape[1] * page_size // (bsz.block_tokens * bsz.pages_per_block))
        splits = max(splits, -(-blocks // bsz.num_stages))
    bsz = dataclasses.replace(bsz, num_splits=splits)
    args = [jnp.asarray(x) for x in (q, kc, vc, pool.page_table, pool.lens)]
    opts = md.KernelOptions(overlap_qk=overlap_qk, kernel_combine=kernel_combine)

    def call():
        sinks_j = None if sk is None else jnp.asarray(sk)
        out, lse = md.mha_decode(*args, sinks=sinks_j, return_lse=True, block_sizes=bsz, options=opts, **kw)
        return np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    out, lse = run_here(call)
    truth, truth_lse = naive.mha_decode(q, kc, vc, pool.page_table, pool.lens, sinks=sk, **kw)
    err = check(name, out, lse, truth, truth_lse, tol=3e-2 if fp8 else 2e-2)
    report(name, f"splits={bsz.num_splits} block={bsz.block_tokens}x{bsz.pages_per_block} max_err={err:.2e}")


def run_here(call):
    """``call()`` on the GPU, or under the Mosaic GPU interpreter where there is none."""
    if on_gpu():
        return call()
    with gpu_interpret():
        return call()


def check(name: str, out, lse, truth, truth_lse, *, tol: float) -> float:
    """The kernel's ``(out, lse)`` against the float64 truth: no NaN, within ``tol``, the
    same empty rows. Returns the largest absolute error."""
    assert not np.isnan(out).any(), f"{name}: NaN in the output"
    err = float(np.abs(out - truth).max(initial=0.0))
    assert np.allclose(out, truth, atol=tol, rtol=tol), f"{name}: max error {err:.3e}"
    assert np.array_equal(np.isneginf(lse), np.isneginf(truth_lse)), f"{name}: empty rows differ"
    return err


def report(name: str, detail: str) -> None:
    where = jax.devices()[0].device_kind if on_gpu() else "cpu (interpreted)"
    print(f"ok {name} on {where}: {detail} ({time.time() - _T0:.1f}s)", flush=True)


def prefill(
    name: str,
    *,
    q_lens,
    prefix=None,
    page_size: int = 0,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
    causal: bool = True,
    window_left: int = -1,
    logit_cap: float = 0.0,
    sinks: bool = False,
    seed: int = 0,
) -> None:
    """One call of the Mosaic prefill kernel: a ragged prefill (``page_size`` 0) or a paged
    extend over ``prefix`` cached keys per request (bf16), checked against naive."""
    from jattn.pallas_kernels import mosaic_prefill as mp

    rng = np.random.default_rng(seed)
    dv = dv or d
    prefix = prefix or [0] * len(q_lens)
    if not on_gpu():  # interpreted: every tile is simulated, so a logic check at a smaller size
        q_lens, prefix, hq = [min(n, 20) for n in q_lens], [min(p, 40) for p in prefix], hkv
    kv_lens = [p + n for p, n in zip(prefix, q_lens)]
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pad = 3  # NaN rows past the ragged totals
    q = np.full((int(cu_q[-1]) + pad, hq, d), np.nan, np.float32)
    q[: cu_q[-1]] = rng.standard_normal((int(cu_q[-1]), hq, d))
    q = q.astype(jnp.bfloat16)
    sk = (rng.standard_normal(hq) * 2).astype(np.float32) if sinks else None
    kw = dict(is_causal=causal, window_left=window_left, logit_cap=logit_cap)
    sinks_j = None if sk is None else jnp.asarray(sk)
    if page_size:
        pool = naive.Pool(rng, kv_lens, page_size, extra_pages=1)
        kc = pool.fill(rng, (hkv, d)).astype(jnp.bfloat16)
        vc = pool.fill(rng, (hkv, dv)).astype(jnp.bfloat16)
        args = [jnp.asarray(x) for x in (q, kc, vc, pool.page_table, pool.lens, cu_q)]

        def call():
            return mp.mha_extend(*args, sinks=sinks_j, return_lse=True, **kw)

        truth, truth_lse = naive.mha_extend(q, kc, vc, pool.page_table, pool.lens, cu_q, sinks=sk, **kw)
    else:
        cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        k = np.full((int(cu_kv[-1]) + pad, hkv, d), np.nan, np.float32)
        v = np.full((int(cu_kv[-1]) + pad, hkv, dv), np.nan, np.float32)
        k[: cu_kv[-1]] = rng.standard_normal((int(cu_kv[-1]), hkv, d))
        v[: cu_kv[-1]] = rng.standard_normal((int(cu_kv[-1]), hkv, dv))
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        args = [jnp.asarray(x) for x in (q, k, v, cu_q, cu_kv)]

        def call():
            return mp.mha_prefill(*args, sinks=sinks_j, return_lse=True, **kw)

        truth, truth_lse = naive.mha_prefill(q, k, v, cu_q, cu_kv, sinks=sk, **kw)
    out, lse = run_here(call)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    err = check(name, out, lse, truth, truth_lse, tol=3e-2)
    report(name, f"{int(cu_q[-1])} query rows, max_err={err:.2e}")


def mla(
    name: str, *, lens, heads: int, page_size: int, q_len: int = 1, causal: bool = True, seed: int = 0,
    keys_as_rows: bool = False,
) -> None:  # fmt: skip
    """One call of the Mosaic MLA absorbed decode (bf16, latent 512 + 64, NaN in unused
    pages and page tails; its choice of splits; with ``keys_as_rows`` the keys-as-rows
    kernel), checked against naive float64 attention."""
    from jattn.pallas_kernels import mosaic_mla as mm

    rank, width = 512, 576
    rng = np.random.default_rng(seed)
    if not on_gpu():  # interpreted: a logic check at a smaller size
        lens, heads = [min(n, 70) for n in lens], min(heads, 8)
    pool = naive.Pool(rng, lens, page_size, extra_pages=1)
    kv = pool.fill(rng, (width,), scale=0.5).astype(jnp.bfloat16)
    q = (rng.standard_normal((len(lens) * q_len, heads, width)) * 0.5).astype(jnp.bfloat16)
    kw = dict(kv_lora_rank=rank, softmax_scale=1.0 / np.sqrt(192.0), max_seqlen_q=q_len, is_causal=causal)
    args = [jnp.asarray(x) for x in (q, kv, pool.page_table, pool.lens)]

    def call():
        out, lse = mm.mla_decode(*args, return_lse=True, keys_as_rows=keys_as_rows, **kw)
        return np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    out, lse = run_here(call)
    truth, truth_lse = naive.mla_decode(q, kv, pool.page_table, pool.lens, **kw)
    err = check(name, out, lse, truth, truth_lse, tol=3e-2)
    report(name, f"{out.shape[0]} query rows x {heads} heads, max_err={err:.2e}")
