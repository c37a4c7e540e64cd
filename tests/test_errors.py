"""Bad inputs raise clear errors that name the argument at fault."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import ForwardMode, LayerSpec, MHABackend, MHAConfig, MLAKVCache, PagedKVCache

F32 = jnp.float32


def _decode_args(bs=2, q_len=1, hq=4, hkv=2, d=8, pages=4, ps=4):
    q = jnp.ones((bs * q_len, hq, d), F32)
    kc = jnp.ones((pages, ps, hkv, d), F32)
    pt = jnp.ones((bs, 2), jnp.int32)
    sl = jnp.full((bs,), 3, jnp.int32)
    return q, kc, kc, pt, sl


def _decode(**over):
    args = dict(zip(("q", "k_cache", "v_cache", "page_table", "cache_seqlens"), _decode_args()))
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    return jattn.mha_decode_with_kvcache(*args.values(), **kw)


# ----------------------------------------------------------------------------- shapes and dtypes

SHAPE_CASES = [
    ("q-2d", dict(q=jnp.ones((2, 32), F32)), ValueError, r"q must be \[tokens, num_q_heads, head_dim\]"),
    ("k_cache-3d", dict(k_cache=jnp.ones((4, 4, 8), F32)), ValueError, r"k_cache must be \[num_pages"),
    (
        "page_table-1d",
        dict(page_table=jnp.ones((2,), jnp.int32)),
        ValueError,
        r"page_table must be \[batch, max_pages\]",
    ),
    (
        "cache_seqlens-2d",
        dict(cache_seqlens=jnp.ones((2, 1), jnp.int32)),
        ValueError,
        r"cache_seqlens must be \[batch\]",
    ),
    ("head_dim", dict(q=jnp.ones((2, 4, 16), F32)), ValueError, r"q head_dim=16 must equal k_cache head_dim=8"),
    ("kv-heads-differ", dict(v_cache=jnp.ones((4, 4, 1, 8), F32)), ValueError, r"k_cache .* and v_cache .* differ"),
    ("q-dtype", dict(q=jnp.ones((2, 4, 8), jnp.int32)), TypeError, r"q\.dtype=int32 must be one of"),
    (
        "kv-dtype-mismatch",
        dict(v_cache=jnp.ones((4, 4, 2, 8), jnp.bfloat16)),
        TypeError,
        r"v_cache\.dtype=bfloat16 must equal k_cache\.dtype",
    ),
    (
        "k_cache-dtype",
        dict(k_cache=jnp.ones((4, 4, 2, 8), jnp.int8), v_cache=jnp.ones((4, 4, 2, 8), jnp.int8)),
        TypeError,
        r"k_cache\.dtype=int8",
    ),
    ("page_table-dtype", dict(page_table=jnp.ones((2, 2), F32)), TypeError, r"page_table\.dtype=float32 must be int32"),
    (
        "cache_seqlens-int64",
        dict(cache_seqlens=np.full(2, 3, np.int64)),
        TypeError,
        r"cache_seqlens\.dtype=int64 must be int32",
    ),
    (
        "rows-vs-batch",
        dict(cache_seqlens=jnp.ones((3,), jnp.int32)),
        ValueError,
        r"page_table has 2 rows but cache_seqlens has 3",
    ),
    (
        "heads-divisible",
        dict(q=jnp.ones((2, 3, 8), F32)),
        ValueError,
        r"num_q_heads=3 must be divisible by num_kv_heads=2",
    ),
    (
        "q-rows",
        dict(q=jnp.ones((3, 4, 8), F32)),
        ValueError,
        r"q has 3 rows; it must be batch \(2\) \* max_seqlen_q \(1\)",
    ),
    ("q-rows-multi", dict(max_seqlen_q=2), ValueError, r"q has 2 rows; it must be batch \(2\) \* max_seqlen_q \(2\)"),
    ("max_seqlen_q-negative", dict(max_seqlen_q=-1), ValueError, r"max_seqlen_q=-1 must be an int >= 0"),
    (
        "no-kv-heads",
        dict(k_cache=jnp.ones((4, 4, 0, 8), F32), v_cache=jnp.ones((4, 4, 0, 8), F32)),
        ValueError,
        r"num_q_heads=4 must be divisible by num_kv_heads=0",
    ),
    (
        "length-past-table",
        dict(cache_seqlens=jnp.array([3, 9], jnp.int32)),
        ValueError,
        r"cache_seqlens\[1\]=9 must be in \[0, 8\] \(page_table's 2 columns of page_size=4\)",
    ),
    ("length-negative", dict(cache_seqlens=np.array([3, -1], np.int32)), ValueError, r"cache_seqlens\[1\]=-1"),
    (
        "page-out-of-range",
        dict(page_table=jnp.array([[1, 0], [2, 4]], jnp.int32), cache_seqlens=jnp.array([3, 5], jnp.int32)),
        ValueError,
        r"page_table\[1, 1\]=4 out of range \[0, 4\)",
    ),
    ("sinks-shape", dict(sinks=jnp.ones((2,), F32)), ValueError, r"sinks must have shape \(4,\)"),
    ("sinks-nan", dict(sinks=jnp.array([0.0, 1.0, jnp.nan, 2.0], F32)), ValueError, r"sinks\[2\]=nan must be a finite"),
    ("sinks-inf", dict(sinks=jnp.array([0.0, jnp.inf, 1.0, 2.0], F32)), ValueError, r"sinks\[1\]=inf must be a finite"),
    (
        "sinks-int",
        dict(sinks=jnp.array([0, 1, 2, 3], jnp.int32)),
        ValueError,
        r"sinks must hold float logits .* got dtype int32",
    ),
    ("list-lengths", dict(cache_seqlens=[3, 3]), TypeError, r"cache_seqlens must be an array \[batch\], got list"),
    ("list-q", dict(q=[[[1.0] * 8] * 4] * 2), TypeError, r"q must be an array \[tokens, num_q_heads, head_dim\]"),
    (
        "head-dim-0",
        dict(q=jnp.ones((2, 4, 0), F32), k_cache=jnp.ones((4, 4, 2, 0), F32), v_cache=jnp.ones((4, 4, 2, 0), F32)),
        ValueError,
        r"head dims must be > 0",
    ),
    ("v-scale-past-f32", dict(v_scale=1e39), ValueError, r"v_scale=1e\+39 must be finite and > 0 \(in float32\)"),
    (
        "softmax-scale-str",
        dict(softmax_scale="0.3"),
        ValueError,
        r"softmax_scale must be a Python number or a scalar array, got '0\.3'",
    ),
    ("window", dict(window_left=-2), ValueError, r"window_left=-2 must be an int >= -1"),
    ("logit_cap", dict(logit_cap=-1.0), ValueError, r"logit_cap=-1.0 must be a finite Python number >= 0"),
    ("unknown-backend", dict(backend="cuda"), ValueError, r"backend='cuda' must be one of"),
    (
        "triton-decode",
        dict(backend="triton"),
        NotImplementedError,
        r"mha_decode: the triton backend (needs a CUDA GPU|cannot serve this call)",
    ),
]


@pytest.mark.parametrize("over,exc,msg", [c[1:] for c in SHAPE_CASES], ids=[c[0] for c in SHAPE_CASES])
def test_decode_bad_inputs(over, exc, msg):
    with pytest.raises(exc, match=msg):
        _decode(**over)


def test_minus_inf_sinks_and_integer_like_bounds_are_accepted():
    """A sink of -inf is no sink for that head; max_pages may be any integer scalar."""
    minus = jnp.array([-jnp.inf, 0.5, -jnp.inf, 1.0], F32)
    plain = jnp.array([-1e30, 0.5, -1e30, 1.0], F32)
    np.testing.assert_array_equal(np.asarray(_decode(sinks=minus)), np.asarray(_decode(sinks=plain)))
    for mp in (np.int64(2), np.array(2), jnp.int32(2)):
        assert jattn.plan_decode([5], page_size=4, page_table=[[1, 2]], max_pages=mp).page_table.shape == (1, 2)


def _extend(**kw):
    q, kc, vc, pt, sl = _decode_args()
    args = dict(
        q=q, k_cache=kc, v_cache=vc, page_table=pt, cache_seqlens=sl, cu_seqlens_q=jnp.array([0, 1, 2], jnp.int32)
    )
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    kw.setdefault("max_seqlen_q", 1)
    return jattn.mha_extend_with_kvcache(*args.values(), **kw)


def _prefill(**kw):
    rng = np.random.default_rng(0)
    args = dict(
        q=jnp.asarray(rng.standard_normal((5, 4, 8)), F32),
        k=jnp.asarray(rng.standard_normal((5, 2, 8)), F32),
        v=jnp.asarray(rng.standard_normal((5, 2, 8)), F32),
        cu_seqlens_q=jnp.array([0, 2, 5], jnp.int32),
    )
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    kw.setdefault("max_seqlen_q", 3)
    return jattn.mha_prefill(*args.values(), **kw)


def _mla(**kw):
    args = dict(
        q=jnp.ones((2, 4, 24), F32),
        kv_cache=jnp.ones((4, 4, 24), F32),
        page_table=jnp.ones((2, 2), jnp.int32),
        cache_seqlens=jnp.full((2,), 3, jnp.int32),
    )
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    kw.setdefault("kv_lora_rank", 16)
    kw.setdefault("softmax_scale", 0.1)
    return jattn.mla_decode_with_kvcache(*args.values(), **kw)


@pytest.mark.parametrize("op", [_extend, _prefill, _mla], ids=["extend", "prefill", "mla_decode"])
def test_triton_backend_says_why_it_cannot_run_the_call(op):
    """Prefill, extend and MLA decode have a Triton kernel: without a GPU and jax-triton, or
    outside its limits, backend="triton" says which."""
    with pytest.raises(NotImplementedError, match=r"the triton backend (needs a CUDA GPU|cannot serve this call)"):
        op(backend="triton")
    op(backend="xla")


def test_mosaic_mla_refuses_a_call_outside_its_limits():
    """An f32 query and a 24-wide latent: the mosaic MLA kernel says which rule failed."""
    with pytest.raises(NotImplementedError, match=r"mosaic backend cannot serve this call: q dtype float32"):
        _mla(backend="mosaic")


OTHER_CASES = [
    (
        "extend-cu-len",
        _extend,
        dict(cu_seqlens_q=jnp.array([0, 2], jnp.int32)),
        ValueError,
        r"cu_seqlens_q has 2 entries; it must be batch \+ 1 = 3",
    ),
    (
        "extend-cu-dtype",
        _extend,
        dict(cu_seqlens_q=jnp.array([0, 1, 2], F32)),
        TypeError,
        r"cu_seqlens_q\.dtype=float32",
    ),
    ("extend-sinks", _extend, dict(sinks=jnp.ones((4, 1), F32)), ValueError, r"sinks must have shape \(4,\)"),
    ("extend-backend", _extend, dict(backend="pallas"), ValueError, r"backend='pallas' must be one of"),
    (
        "prefill-q-2d",
        _prefill,
        dict(q=jnp.ones((5, 32), F32)),
        ValueError,
        r"q must be \[tokens, num_q_heads, head_dim_qk\]",
    ),
    (
        "prefill-kv-tokens",
        _prefill,
        dict(v=jnp.ones((4, 2, 8), F32)),
        ValueError,
        r"k .* and v .* differ in tokens/heads",
    ),
    (
        "prefill-head-dim",
        _prefill,
        dict(k=jnp.ones((5, 2, 16), F32), v=jnp.ones((5, 2, 16), F32)),
        ValueError,
        r"q head_dim_qk=8 must equal k head_dim_qk=16",
    ),
    (
        "prefill-heads",
        _prefill,
        dict(k=jnp.ones((5, 3, 8), F32), v=jnp.ones((5, 3, 8), F32)),
        ValueError,
        r"num_q_heads=4 must be divisible by num_kv_heads=3",
    ),
    ("prefill-cu-dtype", _prefill, dict(cu_seqlens_q=jnp.array([0, 2, 5], F32)), TypeError, r"cu_seqlens_q\.dtype"),
    (
        "prefill-cukv-shape",
        _prefill,
        dict(cu_seqlens_kv=jnp.array([0, 5], jnp.int32), max_seqlen_kv=5),
        ValueError,
        r"cu_seqlens_kv .* must match cu_seqlens_q",
    ),
    (
        "prefill-max-kv",
        _prefill,
        dict(cu_seqlens_kv=jnp.array([0, 1, 5], jnp.int32)),
        ValueError,
        r"max_seqlen_kv is required",
    ),
    ("prefill-k-dtype", _prefill, dict(k=jnp.ones((5, 2, 8), jnp.int32)), TypeError, r"k\.dtype=int32"),
    ("prefill-sinks", _prefill, dict(sinks=jnp.ones((3,), F32)), ValueError, r"sinks must have shape \(4,\)"),
    ("mla-width", _mla, dict(q=jnp.ones((2, 4, 20), F32)), ValueError, r"q width=20 must equal kv_cache width=24"),
    ("mla-rank", _mla, dict(kv_lora_rank=24), ValueError, r"kv_lora_rank=24 must be an int in \(0, 24\)"),
    ("mla-rows", _mla, dict(max_seqlen_q=2), ValueError, r"q has 2 rows; it must be batch \(2\) \* max_seqlen_q \(2\)"),
    (
        "mla-kv-4d",
        _mla,
        dict(kv_cache=jnp.ones((4, 4, 1, 24), F32)),
        ValueError,
        r"kv_cache must be \[num_pages, page_size",
    ),
    ("mla-page-table-dtype", _mla, dict(page_table=jnp.ones((2, 2), F32)), TypeError, r"page_table\.dtype"),
    (
        "mla-seqlens-rows",
        _mla,
        dict(cache_seqlens=jnp.ones((3,), jnp.int32)),
        ValueError,
        r"page_table has 2 rows but cache_seqlens has 3",
    ),
    (
        "mla-seqlens-2d",
        _mla,
        dict(cache_seqlens=jnp.ones((2, 1), jnp.int32)),
        ValueError,
        r"cache_seqlens must be \[batch\]",
    ),
    ("mla-backend", _mla, dict(backend="tpu"), ValueError, r"backend='tpu' must be one of"),
    # the values of concrete offsets, the static bounds they must keep, and the scales
    (
        "prefill-cu-start",
        _prefill,
        dict(cu_seqlens_q=jnp.array([1, 3, 5], jnp.int32)),
        ValueError,
        r"cu_seqlens_q\[0\]=1 must be 0",
    ),
    (
        "prefill-cu-decreasing",
        _prefill,
        dict(cu_seqlens_q=jnp.array([0, 3, 2], jnp.int32)),
        ValueError,
        r"cu_seqlens_q must be non-decreasing: cu_seqlens_q\[2\]=2 < cu_seqlens_q\[1\]=3",
    ),
    (
        "prefill-cu-past-q",
        _prefill,
        dict(cu_seqlens_q=jnp.array([0, 2, 9], jnp.int32), max_seqlen_q=7),
        ValueError,
        r"cu_seqlens_q\[-1\]=9 exceeds the 5 rows of q",
    ),
    (
        "prefill-max-seqlen-q",
        _prefill,
        dict(cu_seqlens_q=jnp.array([0, 1, 5], jnp.int32)),
        ValueError,
        r"cu_seqlens_q: request 1 has 4 tokens > max_seqlen_q=3",
    ),
    (
        "prefill-cu-kv-past-k",
        _prefill,
        dict(cu_seqlens_kv=jnp.array([0, 3, 9], jnp.int32), max_seqlen_kv=6),
        ValueError,
        r"cu_seqlens_kv\[-1\]=9 exceeds the 5 rows of k",
    ),
    (
        "prefill-max-seqlen-kv",
        _prefill,
        dict(cu_seqlens_kv=jnp.array([0, 1, 5], jnp.int32), max_seqlen_kv=2),
        ValueError,
        r"cu_seqlens_kv: request 1 has 4 tokens > max_seqlen_kv=2",
    ),
    (
        "prefill-v-dtype",
        _prefill,
        dict(v=jnp.ones((5, 2, 8), jnp.bfloat16)),
        TypeError,
        r"v\.dtype=bfloat16 must equal",
    ),
    ("prefill-cu-list", _prefill, dict(cu_seqlens_q=[0, 2, 5]), TypeError, r"cu_seqlens_q must be an int32 array"),
    ("prefill-cu-2d", _prefill, dict(cu_seqlens_q=jnp.zeros((1, 3), jnp.int32)), ValueError, r"cu_seqlens_q must be"),
    ("prefill-scale-nan", _prefill, dict(softmax_scale=float("nan")), ValueError, r"softmax_scale=nan must be finite"),
    ("prefill-k-scale-0", _prefill, dict(k_scale=0.0), ValueError, r"k_scale=0\.0 must be finite and > 0"),
    ("prefill-v-scale-neg", _prefill, dict(v_scale=jnp.float32(-2)), ValueError, r"v_scale=-2\.0 must be finite"),
    ("prefill-k-scale-vec", _prefill, dict(k_scale=jnp.ones(2)), ValueError, r"k_scale must be a Python number or a"),
    ("prefill-cap-inf", _prefill, dict(logit_cap=float("inf")), ValueError, r"logit_cap=inf must be a finite"),
    ("prefill-cap-nan", _prefill, dict(logit_cap=float("nan")), ValueError, r"logit_cap=nan must be a finite"),
    ("prefill-causal-none", _prefill, dict(is_causal=None), TypeError, r"is_causal=None must be a bool"),
    (
        "extend-max-seqlen-q",
        _extend,
        dict(cu_seqlens_q=jnp.array([0, 2, 2], jnp.int32)),
        ValueError,
        r"cu_seqlens_q: request 0 has 2 tokens > max_seqlen_q=1",
    ),
    (
        "extend-new-past-cached",
        _extend,
        dict(cu_seqlens_q=jnp.array([0, 2, 2], jnp.int32), cache_seqlens=jnp.array([1, 3], jnp.int32), max_seqlen_q=2),
        ValueError,
        r"request 0 has 2 new tokens > cache_seqlens\[0\]=1",
    ),
    ("extend-window-bool", _extend, dict(window_left=True), ValueError, r"window_left=True must be an int"),
    ("mla-kv-scale", _mla, dict(kv_scale=-1.0), ValueError, r"kv_scale=-1\.0 must be finite and > 0"),
    ("mla-scale-inf", _mla, dict(softmax_scale=float("inf")), ValueError, r"softmax_scale=inf must be finite"),
    ("mla-rank-bool", _mla, dict(kv_lora_rank=True), ValueError, r"kv_lora_rank=True must be an int"),
    ("mla-causal-none", _mla, dict(is_causal=None), TypeError, r"is_causal=None must be a bool"),
    # flags: a string or a number passed a truth test (batch_invariant="no" turned the mode on)
    ("decode-invariant-str", _decode, dict(batch_invariant="no"), TypeError, r"batch_invariant='no' must be a bool"),
    ("decode-lse-int", _decode, dict(return_lse=2), TypeError, r"return_lse=2 must be a bool"),
    ("extend-lse-str", _extend, dict(return_lse="yes"), TypeError, r"return_lse='yes' must be a bool"),
    ("prefill-lse-none", _prefill, dict(return_lse=None), TypeError, r"return_lse=None must be a bool"),
    ("mla-lse-int", _mla, dict(return_lse=1), TypeError, r"return_lse=1 must be a bool"),
]


@pytest.mark.parametrize("op,over,exc,msg", [c[1:] for c in OTHER_CASES], ids=[c[0] for c in OTHER_CASES])
def test_other_ops_bad_inputs(op, over, exc, msg):
    with pytest.raises(exc, match=msg):
        op(**over)


def test_numpy_integers_are_ints_and_bools_are_not():
    """window_left / max_seqlen_q take numpy integers like Python ones; a bool is refused."""
    _decode(window_left=np.int64(3))
    _extend(max_seqlen_q=np.int32(1))
    with pytest.raises(ValueError, match=r"max_seqlen_q=True must be an int >= 0"):
        _decode(max_seqlen_q=True)


def test_merge_and_set_buffer_bad_inputs():
    o, lse = jnp.ones((3, 2, 4), F32), jnp.zeros((3, 2), F32)
    with pytest.raises(ValueError, match=r"o_b must be \[T, H, D\]"):
        jattn.attn_merge_state(o, lse, o[0], lse)
    with pytest.raises(TypeError, match=r"o_a\.dtype=int32 must be one of"):
        jattn.attn_merge_state(o.astype(jnp.int32), lse, o, lse)
    with pytest.raises(TypeError, match=r"lse_b\.dtype=bfloat16 must be one of float32"):
        jattn.attn_merge_state(o, lse, o, lse.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"lse_a must be \[T, H\]"):
        jattn.attn_merge_state(o, lse[0], o, lse)
    with pytest.raises(ValueError, match=r"o_b must have shape \(3, 2, 4\) .*got \(3, 2, 5\)"):
        jattn.attn_merge_state(o, lse, jnp.ones((3, 2, 5), F32), lse)
    with pytest.raises(ValueError, match=r"lse_a must have shape \(3, 2\) .*got \(3, 1\)"):
        jattn.attn_merge_state(o, jnp.zeros((3, 1), F32), o, jnp.zeros((3, 1), F32))
    with pytest.raises(ValueError, match=r"lse_b must have shape \(3, 2\) .*got \(5, 2\)"):
        jattn.attn_merge_state(o, lse, o, jnp.zeros((5, 2), F32))
    kc = jnp.zeros((4, 4, 2, 8), F32)
    loc = jnp.arange(3, dtype=jnp.int32)
    k = jnp.ones((3, 2, 8), F32)
    with pytest.raises(TypeError, match=r"out_cache_loc\.dtype=float32 must be int32"):
        jattn.set_kv_buffer(kc, kc, loc.astype(F32), k, k)
    with pytest.raises(ValueError, match=r"k .*, v .* and out_cache_loc .* disagree on tokens"):
        jattn.set_kv_buffer(kc, kc, loc, jnp.ones((2, 2, 8), F32), k)
    with pytest.raises(ValueError, match=r"k rows \(2, 4\) must match k_cache's"):
        jattn.set_kv_buffer(kc, kc, loc, jnp.ones((3, 2, 4), F32), k)
    with pytest.raises(ValueError, match=r"v rows .* must match v_cache's"):
        jattn.set_kv_buffer(kc, kc, loc, k, jnp.ones((3, 1, 8), F32))
    kv = jnp.zeros((4, 4, 24), F32)
    with pytest.raises(ValueError, match=r"c_kv .* \+ k_pe .* must give 3 rows of width 24"):
        jattn.set_mla_kv_buffer(kv, loc, jnp.ones((3, 16), F32), jnp.ones((3, 4), F32))
    with pytest.raises(TypeError, match=r"out_cache_loc\.dtype"):
        jattn.set_mla_kv_buffer(kv, loc.astype(F32), jnp.ones((3, 16), F32), jnp.ones((3, 8), F32))


def test_kv_writes_check_caches_and_scales_as_the_reads_do():
    """The writes refuse what the reading ops refuse: a scale that is not finite and > 0 or not
    a scalar, a cache of a wrong dtype, K and V caches of different pages or dtypes."""
    f8 = jnp.zeros((4, 4, 2, 8), jnp.float8_e4m3fn)
    loc = jnp.arange(3, dtype=jnp.int32)
    k = jnp.ones((3, 2, 8), F32)
    for bad, msg in (
        (0.0, r"k_scale=0\.0 must be finite and > 0"),
        (-1.0, r"k_scale=-1\.0 must be finite and > 0"),
        (float("nan"), r"k_scale=nan must be finite and > 0"),
    ):
        with pytest.raises(ValueError, match=msg):
            jattn.set_kv_buffer(f8, f8, loc, k, k, k_scale=bad)
    with pytest.raises(ValueError, match=r"v_scale must be a Python number or a scalar array"):
        jattn.set_kv_buffer(f8, f8, loc, k, k, v_scale=jnp.ones((8,), F32))
    with pytest.raises(TypeError, match=r"k\.dtype=int32 must be a float dtype"):  # was cast and written
        jattn.set_kv_buffer(f8, f8, loc, k.astype(jnp.int32), k)
    latent = jnp.zeros((4, 4, 24), F32)
    with pytest.raises(TypeError, match=r"k_pe\.dtype=bool must be a float dtype"):
        jattn.set_mla_kv_buffer(latent, loc, jnp.ones((3, 16), F32), jnp.ones((3, 8), bool))
    with pytest.raises(TypeError, match=r"c_kv must be an array"):
        jattn.set_mla_kv_buffer(latent, loc, [[1.0] * 16] * 3, jnp.ones((3, 8), F32))
    with pytest.raises(TypeError, match=r"k_scale\.dtype=bfloat16 must be float32"):
        jattn.set_kv_buffer(f8, f8, loc, k, k, k_scale=jnp.asarray(0.5, jnp.bfloat16))
    with pytest.raises(TypeError, match=r"k_cache\.dtype=int32 must be one of"):
        jattn.set_kv_buffer(f8.astype(jnp.int32), f8.astype(jnp.int32), loc, k, k)
    with pytest.raises(TypeError, match=r"v_cache\.dtype=float32 must equal k_cache\.dtype"):
        jattn.set_kv_buffer(f8, f8.astype(F32), loc, k, k)
    with pytest.raises(ValueError, match=r"k_cache .* and v_cache .* differ in pages/heads"):
        jattn.set_kv_buffer(f8, f8[:2], loc, k, k)
    kv = jnp.zeros((4, 4, 24), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"kv_scale=-2\.0 must be finite and > 0"):
        jattn.set_mla_kv_buffer(kv, loc, jnp.ones((3, 16), F32), jnp.ones((3, 8), F32), kv_scale=-2.0)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_pages, page_size, R \+ r\]"):
        jattn.set_mla_kv_buffer(kv[0], loc, jnp.ones((3, 16), F32), jnp.ones((3, 8), F32))


def test_low_precision_scales_are_refused_not_rounded():
    """A bf16 / f16 scale would round the f32 softmax scale it multiplies (silently wrong)."""
    with pytest.raises(TypeError, match=r"k_scale\.dtype=bfloat16 must be float32"):
        _decode(k_scale=jnp.asarray(1.0, jnp.bfloat16))
    with pytest.raises(TypeError, match=r"softmax_scale\.dtype=float16 must be float32"):
        _decode(softmax_scale=jnp.asarray(0.3, jnp.float16))
    _decode(k_scale=jnp.asarray(1.0, F32), softmax_scale=np.float64(0.3))  # f32 arrays and numbers pass


def test_scales_whose_product_leaves_float32_are_refused():
    """Each scale may be in float32's range and their product not: the scores would be
    inf, a row seeing a positive one NaN and one seeing only negative ones empty. A scale
    that is 0 in float32 is refused too."""
    with pytest.raises(ValueError, match=r"softmax_scale \* k_scale = 1e\+40 must be finite and > 0 in float32"):
        _decode(softmax_scale=1e20, k_scale=1e20)
    with pytest.raises(ValueError, match=r"softmax_scale \* k_scale = 1[.0-9]*e-50 must be finite"):
        _decode(softmax_scale=1e-25, k_scale=1e-25)
    with pytest.raises(ValueError, match=r"v_scale=1e-46 must be finite and > 0 \(in float32\)"):
        _decode(v_scale=1e-46)
    _decode(softmax_scale=1e19, k_scale=1e19)  # 1e38: in range
    with pytest.raises(ValueError, match=r"softmax_scale \* k_scale"):  # a concrete array scale too
        _decode(softmax_scale=1e20, k_scale=jnp.asarray(1e20, F32))


def test_prefill_without_cu_seqlens_kv_checks_max_seqlen_kv():
    """The keys are the queries' rows: a request longer than max_seqlen_kv would lose keys."""
    q = jnp.ones((8, 2, 8), F32)
    cu = jnp.asarray([0, 8], jnp.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: request 0 has 8 tokens > max_seqlen_kv=4"):
        jattn.mha_prefill(q, q, q, cu, max_seqlen_q=8, max_seqlen_kv=4)
    jattn.mha_prefill(q, q, q, cu, max_seqlen_q=8, max_seqlen_kv=8)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be \[batch \+ 1\] with at least one entry"):
        jattn.mha_prefill(q, q, q, cu[:0], max_seqlen_q=8)


# ----------------------------------------------------------------------------- planners


PT = np.array([[1, 2, 3], [4, 5, 6]])

PLAN_CASES = [
    (
        "page-id-too-large",
        lambda: jattn.plan_decode([20, 5], page_size=8, page_table=[[1, 9, 3], [4, 5, 6]], num_pages=8),
        ValueError,
        r"page_table\[0, 1\]=9 out of range \[0, 8\)",
    ),
    (
        "page-id-negative",
        lambda: jattn.plan_decode([20, 5], page_size=8, page_table=[[1, 2, -3], [4, 5, 6]], num_pages=8),
        ValueError,
        r"page_table\[0, 2\]=-3 out of range",
    ),
    (
        "dummy-page-used",
        lambda: jattn.plan_decode([20, 9], page_size=8, page_table=[[1, 2, 3], [4, 0, 6]], num_pages=8),
        ValueError,
        r"page_table\[1, 1\] is the reserved dummy page 0",
    ),
    (
        "seq-lens-lt-q-len",
        lambda: jattn.plan_decode([5, 1], page_size=8, page_table=PT, q_len=2),
        ValueError,
        r"seq_lens\[1\]=1 < q_len=2",
    ),
    (
        "too-few-columns",
        lambda: jattn.plan_decode([25, 1], page_size=8, page_table=PT),
        ValueError,
        r"seq_lens\[0\]=25 needs 4 pages of page_size=8 but page_table has only 3 columns",
    ),
    (
        "float-seq-lens",
        lambda: jattn.plan_decode(np.array([2.5, 1.0]), page_size=8, page_table=PT),
        TypeError,
        r"seq_lens must hold integers",
    ),
    (
        "page-table-and-req-to-page",
        lambda: jattn.plan_decode([5, 1], page_size=8, page_table=PT, req_to_page=PT, req_pool_indices=[0, 1]),
        ValueError,
        r"pass either page_table or \(req_to_page, req_pool_indices\)",
    ),
    (
        "no-page-table",
        lambda: jattn.plan_decode([5, 1], page_size=8),
        ValueError,
        r"page_table or both req_to_page and req_pool_indices are required",
    ),
    (
        "req-pool-index-range",
        lambda: jattn.plan_decode([5, 1], page_size=8, req_to_page=PT, req_pool_indices=[0, 2]),
        ValueError,
        r"req_pool_indices\[1\]=2 out of range \[0, 2\) of req_to_page",
    ),
    (  # a bad page named in the caller's own array: row 1 of req_to_page, batch row 0
        "req-to-page-entry-range",
        lambda: jattn.plan_decode([5], page_size=8, req_to_page=PT, req_pool_indices=[1], num_pages=2),
        ValueError,
        r"req_to_page\[1, 0\]=4 out of range \[0, 2\)",
    ),
    (
        "req-to-page-columns",
        lambda: jattn.plan_decode([25], page_size=8, req_to_page=PT, req_pool_indices=[1]),
        ValueError,
        r"seq_lens\[0\]=25 needs 4 pages of page_size=8 but req_to_page has only 3 columns",
    ),
    (
        "page-table-rows",
        lambda: jattn.plan_decode([5, 1, 1], page_size=8, page_table=PT),
        ValueError,
        r"page_table has 2 rows but seq_lens has 3",
    ),
    (
        "batch-over-buckets",
        lambda: jattn.plan_decode([1, 1], page_size=8, page_table=PT, batch_buckets=(1,)),
        ValueError,
        r"batch size=2 exceeds the largest bucket 1",
    ),
    (
        "page-size",
        lambda: jattn.plan_decode([1, 1], page_size=0, page_table=PT),
        ValueError,
        r"page_size=0 must be a positive int",
    ),
    (
        "q-len",
        lambda: jattn.plan_decode([1, 1], page_size=8, page_table=PT, q_len=0),
        ValueError,
        r"q_len=0 must be a positive int",
    ),
    (
        "max-pages",
        lambda: jattn.plan_decode([20, 1], page_size=8, page_table=PT, max_pages=2),
        ValueError,
        r"max_pages=2 is less than the 3 pages a request needs",
    ),
    (
        "extend-prefix-inconsistent",
        lambda: jattn.plan_extend([10, 5], [3, 5], page_size=8, page_table=PT, extend_prefix_lens=[7, 1]),
        ValueError,
        r"lengths inconsistent: extend_prefix_lens\[1\]=1 \+ extend_seq_lens\[1\]=5 != seq_lens\[1\]=5",
    ),
    (
        "extend-prefix-count",
        lambda: jattn.plan_extend([10, 5], [3, 5], page_size=8, page_table=PT, extend_prefix_lens=[7]),
        ValueError,
        r"extend_prefix_lens has 1 entries but seq_lens has 2",
    ),
    (
        "extend-negative-seq-len",  # was "extend_seq_lens[0]=0 exceeds seq_lens[0]=-3"
        lambda: jattn.plan_extend([-3, 5], [0, 5], page_size=8, page_table=PT),
        ValueError,
        r"seq_lens\[0\]=-3 is negative",
    ),
    (
        "uint64-past-int64",  # the int64 cast wrapped it to a negative length in the message
        lambda: jattn.plan_extend(np.array([2**63 + 5, 5], np.uint64), [3, 5], page_size=8, page_table=PT),
        ValueError,
        r"seq_lens\[0\]=9223372036854775813 overflows int64",
    ),
    (
        "extend-gt-seq",
        lambda: jattn.plan_extend([10, 5], [3, 6], page_size=8, page_table=PT),
        ValueError,
        r"extend_seq_lens\[1\]=6 exceeds seq_lens\[1\]=5",
    ),
    (
        "extend-negative",
        lambda: jattn.plan_extend([10, 5], [3, -1], page_size=8, page_table=PT),
        ValueError,
        r"extend_seq_lens\[1\]=-1 is negative",
    ),
    (
        "extend-count",
        lambda: jattn.plan_extend([10, 5], [3], page_size=8, page_table=PT),
        ValueError,
        r"extend_seq_lens has 1 entries but seq_lens has 2",
    ),
    (
        "extend-dummy",
        lambda: jattn.plan_extend([10, 5], [3, 5], page_size=8, page_table=[[1, 0, 3], [4, 5, 6]]),
        ValueError,
        r"page_table\[0, 1\] is the reserved dummy page",
    ),
    (
        "decode-max-pages-float",
        lambda: jattn.plan_decode([5], page_size=4, page_table=[[1, 2]], max_pages=2.0),
        ValueError,
        r"max_pages=2\.0 must be an int >= 1",
    ),
    (
        "extend-token-bucket",
        lambda: jattn.plan_extend([10, 5], [10, 5], page_size=8, page_table=PT, token_buckets=(8,)),
        ValueError,
        r"num tokens=15 exceeds the largest bucket 8",
    ),
]


@pytest.mark.parametrize("fn,exc,msg", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_planner_bad_inputs(fn, exc, msg):
    with pytest.raises(exc, match=msg):
        fn()


# ----------------------------------------------------------------------------- caches, backends, registry


def test_cache_and_backend_bad_inputs():
    with pytest.raises(ValueError, match=r"kv cache dtype=int8 must be one of"):
        PagedKVCache.create(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=8, dtype="int8")
    with pytest.raises(ValueError, match=r"num_pages=1 must be >= 2"):
        MLAKVCache.create(num_layers=1, num_pages=1, page_size=4)
    with pytest.raises(KeyError, match=r"no attention backend named 'flash'"):
        jattn.get_backend("flash")
    with pytest.raises(ValueError, match=r"backend 'mha' serves \['MHA'\], not 'MLA'"):
        jattn.get_backend("mha", arch="MLA")
    cfg = MHAConfig(
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=8,
        page_size=4,
        context_len=32,
        num_pages=8,
        kv_cache_dtype="float32",
        kernel_backend="xla",
        batch_buckets=(2, 4),
    )
    be = MHABackend(cfg)
    r2p = np.arange(1, 17).reshape(2, 8) % 8 + (np.arange(1, 17).reshape(2, 8) % 8 == 0)
    with pytest.raises(ValueError, match=r"extend_seq_lens is required"):
        be.init_forward_metadata(2, [0, 1], [5, 5], r2p, ForwardMode.EXTEND)
    with pytest.raises(ValueError, match=r"bs=3 is not one of the buckets"):
        be.init_forward_metadata_capture_cuda_graph(3)
    md = be.init_forward_metadata(1, [0], [6], r2p, ForwardMode.EXTEND, extend_seq_lens=[2])
    cache = PagedKVCache.create(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=8, dtype="float32")
    layer = LayerSpec(0, 2, 1, 8)
    x = jnp.ones((md.num_tokens, 2, 8), F32)
    with pytest.raises(ValueError, match=r"pass save_kv_cache=True, or kv_in_cache=True"):
        be.forward_extend(x, x[:, :1], x[:, :1], layer, cache, md, save_kv_cache=False)
    # A plan of another page size than the cache's would address the wrong slots.
    cache8 = PagedKVCache.create(num_layers=1, num_pages=4, page_size=8, num_kv_heads=1, head_dim=8, dtype="float32")
    with pytest.raises(ValueError, match=r"metadata.page_size=4 differs from the KV cache's page_size=8"):
        be.forward_extend(x, x[:, :1], x[:, :1], layer, cache8, md)
    dmd = be.init_forward_metadata(1, [0], [6], r2p, ForwardMode.DECODE)
    with pytest.raises(ValueError, match=r"k and v must both be given"):
        be.forward_decode(x[:2], x[:2, :1], None, layer, cache, dmd)


def test_kv_writes_drop_out_of_range_slots_negative_included():
    """A slot outside the pool (negative or past the end) writes nothing: it never wraps
    around onto another request's page."""
    rng = np.random.default_rng(11)
    kc = jnp.asarray(rng.standard_normal((4, 4, 1, 8)), F32)
    k = jnp.asarray(rng.standard_normal((3, 1, 8)), F32)
    loc = jnp.array([-1, 16, 5], jnp.int32)
    nk, nv = jattn.set_kv_buffer(kc, kc, loc, k, k)
    want = np.asarray(kc).reshape(16, 1, 8).copy()
    want[5] = np.asarray(k[2])
    np.testing.assert_array_equal(np.asarray(nk).reshape(16, 1, 8), want)
    kv = jnp.asarray(rng.standard_normal((4, 4, 12)), F32)
    out = jattn.set_mla_kv_buffer(kv, jnp.array([-3], jnp.int32), k[:1, 0, :8], k[:1, 0, :4])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(kv))


# ----------------------------------------------------------------------------- cache-corrupting plans (issue 13)


def test_planners_refuse_duplicate_write_slots_but_allow_shared_prefix_pages():
    with pytest.raises(ValueError, match=r"new tokens 0 and 1 would both write slot 8 \(page 2, offset 0\)"):
        jattn.plan_decode([5, 5], page_size=4, page_table=[[1, 2], [3, 2]])
    with pytest.raises(ValueError, match=r"new tokens 0 and 2 would both write slot 8"):
        jattn.plan_extend([6, 6], [2, 2], page_size=4, page_table=[[1, 2], [1, 2]])
    with pytest.raises(ValueError, match=r"would both write slot"):  # spec verify: q_len tokens each
        jattn.plan_decode([6, 7], page_size=4, page_table=[[1, 2], [3, 2]], q_len=3)
    # the clash is named by the plan's token indices, padding rows before it counted
    with pytest.raises(ValueError, match=r"new tokens 2 and 3 would both write slot 8"):
        jattn.plan_decode([0, 0, 5, 5], page_size=4, page_table=[[0, 0], [0, 0], [1, 2], [1, 2]])
    # a read-only shared prefix page (page 1) is fine; so are zero-length padding rows
    md = jattn.plan_decode([5, 7, 0], page_size=4, page_table=[[1, 2], [1, 3], [0, 0]])
    assert len(set(md.out_cache_loc[:2].tolist())) == 2


def test_planner_and_backend_input_bounds():
    with pytest.raises(ValueError, match=r"prefix_lens\[1\]=-2 is negative"):
        jattn.plan_prefix_chunks([3, -2], [[1, 2], [3, 4]], page_size=4, chunk_size=4)
    with pytest.raises(ValueError, match=r"page_size=0 must be a positive int"):
        jattn.plan_prefix_chunks([3, 2], [[1, 2], [3, 4]], page_size=0, chunk_size=4)
    be = MHABackend(MHAConfig(num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4, context_len=16, num_pages=8))
    r2p = np.array([[1, 2, 3, 4], [5, 6, 7, 0]])
    with pytest.raises(ValueError, match=r"bs=-1 must be in \[0, 2\]"):
        be.init_forward_metadata(-1, [0, 1], [3, 4], r2p)
    with pytest.raises(ValueError, match=r"bs=3 must be in \[0, 2\] \(the entries of req_pool_indices\)"):
        be.init_forward_metadata(3, [0, 1], [3, 4], r2p)
    with pytest.raises(ValueError, match=r"entries of extend_seq_lens"):
        be.init_forward_metadata(2, [0, 1], [3, 4], r2p, ForwardMode.EXTEND, extend_seq_lens=[1])


def test_planner_types_buckets_and_int32_range():
    """Planner arguments of the wrong type, empty buckets, explicit token buckets below 16,
    and slots past int32 (which would wrap onto other pages) get errors naming them."""
    pt = [[1, 2], [3, 4]]
    for bad in (4.0, None, True):
        with pytest.raises(ValueError, match=r"page_size=.* must be a positive int"):
            jattn.plan_decode([5, 3], page_size=bad, page_table=pt)
    with pytest.raises(ValueError, match=r"q_len=True must be a positive int"):
        jattn.plan_decode([5, 3], page_size=4, page_table=pt, q_len=True)
    with pytest.raises(TypeError, match=r"is_causal=None must be a bool"):
        jattn.plan_decode([5, 3], page_size=4, page_table=pt, is_causal=None)
    with pytest.raises(ValueError, match=r"the batch size buckets are empty"):
        jattn.plan_decode([5, 3], page_size=4, page_table=pt, batch_buckets=())
    with pytest.raises(ValueError, match=r"group_size=2\) needs prefix_pages"):
        jattn.plan_decode([5, 3], page_size=4, page_table=pt, group_size=2)
    # explicit token buckets are taken as given (the 16-row floor is for the default ones)
    md = jattn.plan_extend([5, 3], [3, 2], page_size=4, page_table=pt, token_buckets=(8,))
    assert md.out_cache_loc.shape == (8,)
    with pytest.raises(ValueError, match=r"num tokens=9 exceeds the largest bucket 8"):
        jattn.plan_extend([5, 6], [3, 6], page_size=4, page_table=pt, token_buckets=(8,))
    assert jattn.plan_extend([5, 3], [3, 2], page_size=4, page_table=pt).out_cache_loc.shape == (16,)
    with pytest.raises(
        ValueError, match=r"out_cache_loc\[\d+\]=\d+ \(a slot: page \* page_size \+ offset\) overflows int32"
    ):
        jattn.plan_decode([5, 3], page_size=64, page_table=[[2**26, 2], [4, 5]])
    with pytest.raises(ValueError, match=r"out_cache_loc\[\d+\]=\d+ .* overflows int32"):
        jattn.plan_extend([5, 3], [1, 1], page_size=64, page_table=[[2**26, 2], [4, 5]])
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=2147483653 \(a length\) overflows int32"):
        jattn.plan_decode([2**31 + 5, 3], page_size=2**30, page_table=[[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=r"slots\[\d+\]=\d+ .* overflows int32"):
        jattn.plan_prefix_chunks([3, 2], [[2**26, 2], [3, 4]], page_size=64, chunk_size=4)
    with pytest.raises(ValueError, match=r"page_table has 2 rows but prefix_lens has 3 requests"):
        jattn.plan_prefix_chunks([3, 2, 1], pt, page_size=4, chunk_size=4)
    with pytest.raises(ValueError, match=r"prefix_lens\[0\]=9 needs 3 pages"):
        jattn.plan_prefix_chunks([9, 2], pt, page_size=4, chunk_size=4)
    with pytest.raises(ValueError, match=r"chunk_size=2.5 must be a positive int"):
        jattn.plan_prefix_chunks([3, 2], pt, page_size=4, chunk_size=2.5)


def test_unused_page_entries_and_traced_lengths_pass_the_value_check():
    """Entries past a request's pages may hold anything (the kernels never read them),
    and under jit the lengths are traced: only the metadata builders check them."""
    q, kc, vc, _, _ = _decode_args()
    pt = jnp.array([[1, -7], [2, 99]], jnp.int32)  # second column unused at length 3
    out = jattn.mha_decode_with_kvcache(q, kc, vc, pt, jnp.array([3, 4], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()
    jitted = jax.jit(jattn.mha_decode_with_kvcache)
    assert jitted(q, kc, vc, jnp.ones((2, 2), jnp.int32), jnp.array([3, 9], jnp.int32)).shape == q.shape


def test_mla_decode_refuses_a_length_past_its_page_table():
    q = jnp.ones((1, 2, 24), F32)
    kv = jnp.ones((4, 4, 24), F32)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]=9 must be in \[0, 8\]"):
        jattn.mla_decode_with_kvcache(
            q, kv, jnp.zeros((1, 2), jnp.int32), jnp.array([9], jnp.int32), kv_lora_rank=16, softmax_scale=0.2
        )


def test_mla_decode_needs_softmax_scale():
    kv = jnp.ones((4, 4, 24), F32)
    with pytest.raises(ValueError, match=r"softmax_scale is required for MLA decode"):
        jattn.mla_decode_with_kvcache(
            jnp.ones((2, 2, 24), F32),
            kv,
            jnp.ones((2, 1), jnp.int32),
            jnp.ones((2,), jnp.int32),
            kv_lora_rank=16,
            softmax_scale=None,
        )


def test_negative_max_seqlen_is_refused():
    """max_seqlen_q = 0 is an empty call (tests/test_reference_ops.py); below 0 is an error."""
    q, kc, vc, pt, sl = _decode_args()
    cu = jnp.array([0, 1, 2], jnp.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q=-1 must be an int >= 0"):
        jattn.mha_extend_with_kvcache(q, kc, vc, pt, sl, cu, max_seqlen_q=-1)
    with pytest.raises(ValueError, match=r"max_seqlen_q=-2 must be an int >= 0"):
        jattn.mha_prefill(q, kc[0], vc[0], cu, max_seqlen_q=-2)
    with pytest.raises(ValueError, match=r"max_seqlen_kv=-1 must be an int >= 0"):
        jattn.mha_prefill(q, kc[0], vc[0], cu, cu, max_seqlen_q=1, max_seqlen_kv=-1)
    with pytest.raises(ValueError, match=r"max_seqlen_q=-1 must be an int >= 0"):
        _mla(max_seqlen_q=-1)


def test_mla_decode_e4m3_query_needs_e4m3_cache_and_equals_bf16():
    """An e4m3 query is accepted with an e4m3 latent cache only; elsewhere it is the same
    call as its values in bf16 (the output is bf16)."""
    rng = np.random.default_rng(3)
    q8 = jnp.asarray(rng.standard_normal((2, 2, 24)), jnp.float8_e4m3fn)
    kv = jnp.asarray(rng.standard_normal((4, 4, 24)), F32)
    pt, lens = jnp.array([[0, 1], [2, 3]], jnp.int32), jnp.array([7, 3], jnp.int32)
    kw = dict(kv_lora_rank=16, softmax_scale=0.2)
    with pytest.raises(TypeError, match=r"q.dtype=float8_e4m3fn needs a float8_e4m3fn kv_cache"):
        jattn.mla_decode_with_kvcache(q8, kv, pt, lens, **kw)
    kv8 = kv.astype(jnp.float8_e4m3fn)
    out = jattn.mla_decode_with_kvcache(q8, kv8, pt, lens, kv_scale=0.5, backend="xla", **kw)
    want = jattn.mla_decode_with_kvcache(q8.astype(jnp.bfloat16), kv8, pt, lens, kv_scale=0.5, backend="xla", **kw)
    assert out.dtype == jnp.bfloat16 and np.array_equal(np.asarray(out, F32), np.asarray(want, F32))


def test_cu_seqlens_one_row_past_the_tokens_is_refused():
    """``cu_seqlens_q[-1]`` / ``cu_seqlens_kv[-1]`` one past the rows of ``q`` / ``k`` (the
    off-by-one a caller makes most) is refused by name, as a far larger one is: the last
    request would read a row that does not exist (an index XLA clamps silently)."""
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=6 exceeds the 5 rows of q"):
        _prefill(cu_seqlens_q=jnp.array([0, 2, 6], jnp.int32), max_seqlen_q=4)
    with pytest.raises(ValueError, match=r"cu_seqlens_kv\[-1\]=6 exceeds the 5 rows of k"):
        _prefill(cu_seqlens_kv=jnp.array([0, 2, 6], jnp.int32), max_seqlen_kv=4)
