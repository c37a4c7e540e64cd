"""f32 operands in the Triton kernels get full f32 products, not TF32.

Triton's ``tl.dot`` rounds f32 operands to TF32 (a 10-bit mantissa) on sm80+ unless told
otherwise, which would break the f32 contract of docs/SEMANTICS.md without any error. The
kernels take the ``input_precision`` of their dots from ``triton_glue.dot_precision``.
CPU: every ``tl.dot`` of the three kernel sources passes it, and each launch's constexprs
ask for ``"ieee"`` on f32 queries only. GPU (marker ``gpu``): f32 decode and MLA decode
against the f32 reference at a tolerance TF32 products miss (the prefill kernel takes bf16 and
fp16 queries only).
"""

from __future__ import annotations

import inspect
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jattn.pallas_kernels import triton_decode, triton_glue, triton_mla, triton_prefill
from jattn.pallas_kernels.interpret import on_gpu

KERNELS = {
    "decode": triton_decode._decode_kernel,
    "prefill": triton_prefill._prefill_kernel,
    "mla": triton_mla._mla_kernel,
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_dot_takes_the_launch_precision(name):
    src = inspect.getsource(KERNELS[name])
    dots = len(re.findall(r"\btl\.dot\(", src))
    assert dots >= 2
    assert src.count("input_precision=DOT_PREC") == dots


def test_dot_precision_is_ieee_for_f32_only():
    torch = pytest.importorskip("torch")
    for dt in (jnp.float32, np.dtype("float32"), jnp.zeros(1).dtype, torch.float32):
        assert triton_glue.dot_precision(dt) == "ieee", dt
    for dt in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, torch.bfloat16, torch.float16):
        assert triton_glue.dot_precision(dt) == "tf32", dt


@pytest.mark.parametrize("dtype, want", [(jnp.float32, "ieee"), (jnp.bfloat16, "tf32")])
def test_each_launch_asks_for_its_precision(dtype, want):
    pt = jnp.zeros((2, 4), jnp.int32)
    q = jnp.zeros((2, 8, 128), dtype)
    kc = jnp.zeros((16, 16, 2, 128), dtype)
    kw = dict(q_len=1, is_causal=True, window_left=-1, logit_cap=0.0, params={})
    assert triton_decode._constexprs(q, kc, pt, **kw)["DOT_PREC"] == want
    kv = jnp.zeros((16, 2, 128), dtype)
    kw = dict(paged=False, is_causal=True, window_left=-1, logit_cap=0.0, has_sinks=False, bm=64, bn=64)
    assert triton_prefill._constexprs(q, kv, kv, pt, **kw)["DOT_PREC"] == want
    qm, cache = jnp.zeros((2, 16, 576), dtype), jnp.zeros((16, 64, 576), dtype)
    got = triton_mla.constexprs(qm, cache, pt, kv_lora_rank=512, q_len=1, is_causal=True, params={})
    assert got["DOT_PREC"] == want


def _paged(rng, lens, page, tail, count=1):
    """``count`` page pools of NaN holding each request's tokens (fresh normals, ``tail`` wide)
    at the permuted pages of one table, and that table."""
    per = max(-(-n // page) for n in lens) + 1
    pages = len(lens) * per + 3
    table = rng.permutation(pages)[: len(lens) * per].reshape(len(lens), per).astype(np.int32)
    caches = []
    for _ in range(count):
        cache = np.full((pages, page) + tail, np.nan, np.float32)
        for b, n in enumerate(lens):
            t = np.arange(n)
            cache[table[b, t // page], t % page] = rng.standard_normal((n,) + tail)
        caches.append(cache)
    return caches, table


def _close(out, want, lse, want_lse, seen):
    out, want = np.asarray(out)[seen], np.asarray(want)[seen]
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], atol=2e-5, rtol=2e-5)


def _skip_without_triton():
    if not on_gpu() or not triton_glue.available():
        pytest.skip("needs a GPU with jax-triton")


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 3])
def test_gpu_f32_decode_is_full_precision(q_len):
    import jattn
    from jattn import reference

    _skip_without_triton()
    rng = np.random.default_rng(1)
    lens = tuple(max(n, q_len) for n in (97, 0, 1, 700))  # a query sees its own key
    (k, v), table = _paged(rng, lens, 16, (2, 128), count=2)
    q = (rng.standard_normal((len(lens) * q_len, 8, 128)) * 3).astype(np.float32)  # sharp scores
    args = tuple(jnp.asarray(a) for a in (q, k, v, table, np.asarray(lens, np.int32)))
    kw = dict(max_seqlen_q=q_len, is_causal=True, return_lse=True)
    out, lse = jattn.mha_decode_with_kvcache(*args, backend="triton", **kw)
    want, want_lse = reference.mha_decode(*args, **kw)
    _close(out, want, lse, want_lse, slice(None))


@pytest.mark.gpu
def test_gpu_f32_mla_decode_is_full_precision():
    import jattn
    from jattn import reference

    _skip_without_triton()
    rng = np.random.default_rng(3)
    lens = (97, 1, 0, 700)
    (kv,), table = _paged(rng, lens, 64, (576,))
    q = (rng.standard_normal((len(lens), 16, 576)) * 2).astype(np.float32)
    args = tuple(jnp.asarray(a) for a in (q, kv, table, np.asarray(lens, np.int32)))
    kw = dict(kv_lora_rank=512, softmax_scale=1 / 192**0.5, return_lse=True)
    out, lse = jattn.mla_decode_with_kvcache(*args, backend="triton", **kw)
    want, want_lse = reference.mla_decode(*args, **kw)
    _close(out, want, lse, want_lse, np.asarray(lens) > 0)
