"""``TorchMHABackend(kernels="triton_native")`` against the default JAX path.

One engine scenario (a ragged prefill, an extend over a cached prefix, decode steps, a
target verify, a DFLASH draft block, a CUDA-graph bucket with padding requests) runs
through both backends on two pools that start equal and NaN-filled (unused slots and
pages hold NaN: nothing may read them). Every layer output and the pools afterwards
must agree. CPU: the native path runs under Triton's interpreter (a
``TRITON_INTERPRET=1`` subprocess, fp16: the interpreter's bf16 dots are wrong), the
JAX path on XLA. GPU (marker ``gpu``): bf16 and FP8 pools, and the native decode
captured in a torch CUDA graph replays a later step's plan to the eager values.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from interpreted import run_in_interpreter

from jattn.pallas_kernels.interpret import on_gpu

PAGE_SIZE = 4
SCENARIOS = {
    "fp16": dict(),
    "fp16_window_cap_sinks": dict(window=3, cap=5.0, sinks=True),
}


def scenario(kernels: str, *, device: str, dtype: str, kv: str, window=-1, cap=0.0, sinks=False, seed=0):
    """Runs the steps on a fresh pool; returns ``{name: array}`` of every output and the
    final pools (float32)."""
    import torch

    from jattn import ForwardMode, MHAConfig
    from jattn.bridge import AttentionLayer, TorchKVPool, TorchMHABackend

    tdt = getattr(torch, dtype)
    kvdt = torch.float8_e4m3fn if kv == "float8_e4m3fn" else tdt
    hq, hkv, d, ps, spec, num_pages, nl = 4, 2, 64, PAGE_SIZE, 2, 40, 2
    cfg = MHAConfig(
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        context_len=64,
        num_pages=num_pages,
        dtype=dtype,
        kv_cache_dtype=kv,
        spec_num_tokens=spec,
        kernel_backend="xla" if device == "cpu" else None,
    )
    pool = TorchKVPool(
        num_layers=nl, num_pages=num_pages, page_size=ps, num_kv_heads=hkv, head_dim=d, dtype=kvdt, device=device
    )
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.full(b.shape, float("nan"), device=device))
    be = TorchMHABackend(cfg, device=device, kernels=kernels, **({"kv_writer": "torch"} if device == "cpu" else {}))
    fp8 = kvdt == torch.float8_e4m3fn
    layers = [
        AttentionLayer(
            i,
            hq,
            hkv,
            d,
            sliding_window_size=window,
            logit_cap=cap,
            k_scale=0.05 if fp8 else None,
            v_scale=0.03 if fp8 else None,
        )
        for i in range(nl)
    ]
    g = torch.Generator().manual_seed(seed)
    sink_t = (torch.randn(hq, generator=g)).to(device) if sinks else None
    rng = np.random.default_rng(seed)
    req_to_page = torch.zeros(5, 9, dtype=torch.int32)  # 4 requests of at most 9 pages (36 tokens)
    perm = rng.permutation(np.arange(1, num_pages))  # page 0 is the dummy page
    req_to_page[1:] = torch.from_numpy(perm[:36].reshape(4, 9).astype(np.int32))
    rpi = torch.arange(1, 5, dtype=torch.int32)
    out = {}

    def rand(n, w):
        return (torch.randn(n, w, generator=g) * 0.5).to(tdt).to(device)

    def run(tag, n, mode, lens, fwd, **md):
        be.init_forward_metadata(4, 4, rpi, torch.tensor(lens), req_to_page, mode, **md)
        for layer in layers:
            q, k, v = rand(n, hq * d), rand(n, hkv * d), rand(n, hkv * d)
            o = getattr(be, fwd)(q, k, v, layer, None, pool, 4, save_kv_cache=True, sinks=sink_t)
            out[f"{tag}_l{layer.layer_id}"] = o.float().cpu().numpy()

    lens = [5, 0, 13, 1]
    ext = torch.tensor([5, 0, 13, 1])
    run("prefill", 19, ForwardMode.EXTEND, lens, "forward_extend", extend_seq_lens=ext)
    ext2 = [3, 2, 0, 4]
    lens = [a + b for a, b in zip(lens, ext2)]
    run("extend", 9, ForwardMode.EXTEND, lens, "forward_extend", extend_seq_lens=torch.tensor(ext2))
    for step in range(2):
        lens = [x + 1 for x in lens]
        run(f"decode{step}", 4, ForwardMode.DECODE, lens, "forward_decode")
    lens = [x + spec for x in lens]
    run("verify", 4 * spec, ForwardMode.TARGET_VERIFY, lens, "forward_decode")
    # the same verify plan through a non-causal layer: every new token sees all of its keys
    for layer in layers:
        q, k, v = rand(4 * spec, hq * d), rand(4 * spec, hkv * d), rand(4 * spec, hkv * d)
        nc = dataclasses.replace(layer, non_causal=True)
        o = be.forward_decode(q, k, v, nc, None, pool, 4, save_kv_cache=True, sinks=sink_t)
        out[f"verify_nc_l{layer.layer_id}"] = o.float().cpu().numpy()
    # a DFLASH draft block (a non-causal drafter layer), its lengths refilled on the plan
    be.init_forward_metadata(4, 0, rpi, torch.tensor(lens), req_to_page, ForwardMode.DRAFT_BLOCK)
    lens = [x + spec for x in lens]
    be.fill_block_decode_seq_lens(4, torch.tensor(lens))
    for layer in layers:
        drafter = dataclasses.replace(layer, non_causal=True)
        q, k, v = rand(4 * spec, hq * d), rand(4 * spec, hkv * d), rand(4 * spec, hkv * d)
        o = be.forward_decode(q, k, v, drafter, None, pool, 4, save_kv_cache=True, sinks=sink_t)
        out[f"draft_block_l{layer.layer_id}"] = o.float().cpu().numpy()
    # a CUDA-graph bucket: capture plan of bucket 4, replay with 3 real requests
    be.init_cuda_graph_state(4)
    be.init_forward_metadata_capture_cuda_graph(4, 4, forward_mode=ForwardMode.DECODE)
    lens = [x + 1 for x in lens]
    be.init_forward_metadata_replay_cuda_graph(3, rpi[:3], torch.tensor(lens[:3]), req_to_page, ForwardMode.DECODE)
    for layer in layers:
        q, k, v = rand(3, hq * d), rand(3, hkv * d), rand(3, hkv * d)
        o = be.forward_decode(q, k, v, layer, None, pool, 3, save_kv_cache=True, sinks=sink_t)
        out[f"bucket_l{layer.layer_id}"] = o.float().cpu().numpy()
    for i in range(nl):
        out[f"k_pool{i}"] = pool.k_buffer[i].float().cpu().numpy()
        out[f"v_pool{i}"] = pool.v_buffer[i].float().cpu().numpy()
    return out


def run_interpreted(name: str, path: str) -> None:
    kw = dict(device="cpu", dtype="float16", kv="float16", **SCENARIOS[name])
    res = {f"jax/{k}": v for k, v in scenario("jax", **kw).items()}
    res.update({f"native/{k}": v for k, v in scenario("triton_native", **kw).items()})
    np.savez(path, **res)


def _one_token_write(kernels: str, out_cache_loc, strided=False):
    """One decode token of one request (pages 20..) written with ``out_cache_loc`` (None:
    the plan's slot, 84); returns the layer's K pool as ``[slots, Hkv * D]``. ``strided``:
    k and v are every other column of wider tensors (not contiguous)."""
    import torch

    from jattn import ForwardMode, MHAConfig
    from jattn.bridge import AttentionLayer, TorchKVPool, TorchMHABackend

    cfg = MHAConfig(
        num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, context_len=64, num_pages=64,
        dtype="float16", kv_cache_dtype="float16", kernel_backend="xla",
    )  # fmt: skip
    pool = TorchKVPool(num_layers=1, num_pages=64, page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    be = TorchMHABackend(cfg, device="cpu", kernels=kernels, **({"kv_writer": "torch"} if kernels == "jax" else {}))
    r2p = torch.zeros(2, 16, dtype=torch.int32)
    r2p[1] = torch.arange(20, 36)
    be.init_forward_metadata(1, 0, torch.tensor([1]), torch.tensor([5]), r2p, ForwardMode.DECODE)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, w, generator=g).half() for w in (256, 128, 128))
    if strided:
        k, v = (torch.stack([x, -x], dim=2).reshape(1, 256)[:, ::2] for x in (k, v))
        assert not k.is_contiguous() and not v.is_contiguous()
    be.forward_decode(q, k, v, AttentionLayer(0, 4, 2, 64), out_cache_loc, pool, 1, save_kv_cache=True)
    return pool.k_buffer[0].reshape(256, 128).float().numpy()


def run_slots(name: str, path: str) -> None:
    import torch

    loc = None if name in ("plan_slot", "strided") else torch.tensor([84])  # the plan's slot, given
    kw = dict(strided=name == "strided")
    np.savez(path, jax=_one_token_write("jax", loc, **kw), native=_one_token_write("triton_native", loc, **kw))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_in_interpreter(
        tmp_path_factory,
        "test_bridge_native",
        {"run_interpreted": list(SCENARIOS), "run_slots": ["plan_slot", "caller_slot", "strided"]},
    )


def test_interpreted_native_writes_the_callers_slots(interpreted):
    """The native path writes the new token where the JAX path does: the plan's slot, 84,
    whether ``out_cache_loc`` is None or names it (other slots are refused:
    ``test_native_checks_pool_buffers_and_slots_as_the_jax_path``); k / v that are strided
    views are written as their values (the native path refused them as not contiguous)."""
    for name, slot in (("plan_slot", 84), ("caller_slot", 84), ("strided", 84)):
        res = interpreted[name]
        for kind in ("jax", "native"):
            written = np.flatnonzero(np.abs(res[kind]).sum(axis=1))
            assert written.tolist() == [slot], (name, kind, written)
        np.testing.assert_array_equal(res["jax"], res["native"])


def test_native_checks_pool_buffers_and_slots_as_the_jax_path():
    """Refused before any kernel runs, with the JAX path's messages: a pool smaller than
    the plan's page bound, a per-slot layout that is not the layer's, a plan whose page
    ids were never range-checked, slots outside the pool or not integers."""
    import torch

    from jattn import ForwardMode, MHAConfig
    from jattn.bridge import AttentionLayer, BridgeError, TorchKVPool, TorchMHABackend

    def call(cfg_pages=64, pool_pages=64, pool_heads=(2, 64), loc=None, q_dtype=torch.bfloat16, sinks=None, **md):
        cfg = MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, context_len=64,
                        num_pages=cfg_pages, kernel_backend="xla")  # fmt: skip
        pool = TorchKVPool(num_layers=1, num_pages=pool_pages, page_size=4, num_kv_heads=pool_heads[0],
                           head_dim=pool_heads[1])  # fmt: skip
        be = TorchMHABackend(cfg, device="cpu", kernels="triton_native")
        r2p = torch.zeros(2, 16, dtype=torch.int32)
        r2p[1] = torch.arange(1, 17)
        be.init_forward_metadata(1, 0, torch.tensor([1]), torch.tensor([5]), r2p, ForwardMode.DECODE, **md)
        q, kv = torch.zeros(1, 256, dtype=q_dtype), torch.zeros(1, 128, dtype=q_dtype)
        be.forward_decode(q, kv, kv, AttentionLayer(0, 4, 2, 64), loc, pool, 1, save_kv_cache=True, sinks=sinks)

    with pytest.raises(BridgeError, match=r"k_buffer\[layer 0\] has 32 pages, config\.num_pages=64"):
        call(pool_pages=32)
    with pytest.raises(BridgeError, match=r"layer 0 has 2 KV heads x 64, the pool has 4 x 32"):
        call(pool_heads=(4, 32))
    with pytest.raises(BridgeError, match=r"page ids were never range-checked: kernels='triton_native'"):
        call(cfg_pages=None)
    with pytest.raises(BridgeError, match=r"has 32 pages, but the plan's page ids were checked against num_pages=64"):
        call(cfg_pages=None, pool_pages=32, num_pages=64)
    # one page short, not only half the pages
    with pytest.raises(BridgeError, match=r"k_buffer\[layer 0\] has 63 pages, config\.num_pages=64"):
        call(pool_pages=63)
    with pytest.raises(BridgeError, match=r"has 63 pages, but the plan's page ids were checked against num_pages=64"):
        call(cfg_pages=None, pool_pages=63, num_pages=64)
    with pytest.raises(BridgeError, match=r"out_cache_loc holds slot 1000000, outside the KV pool's slots \[0, 256\)"):
        call(loc=torch.tensor([10**6]))
    with pytest.raises(BridgeError, match=r"out_cache_loc must hold integer slots"):
        call(loc=torch.tensor([1.5]))
    # a slot in the pool but not the plan's (token 4 of pages [1, 2, ...]: slot 8)
    with pytest.raises(BridgeError, match=r"out_cache_loc\[0\]=9, but the installed plan puts new token 0 at slot 8"):
        call(loc=torch.tensor([9]))
    # the caller's q (not the pool) named for a dtype the pool does not have; sinks of
    # another length than the query heads (one value was broadcast over every head)
    with pytest.raises(BridgeError, match=r"q\.dtype=torch\.float32 must be the KV pool's torch\.bfloat16"):
        call(q_dtype=torch.float32)
    with pytest.raises(BridgeError, match=r"sinks must have shape \(4,\) \(one per query head\), got \(1,\)"):
        call(sinks=torch.zeros(1))


def test_native_kernels_check_what_they_read_and_write():
    """The native launches refuse, before any kernel runs, what they would read or write
    wrongly: strided ``sinks`` in decode (the combine read them densely: 0.29 off), a
    ``v_cache`` of other pages or dtype than ``k_cache`` in the KV write (it took the slot
    count and the FP8 flag from ``k_cache``: writes past ``v_cache``, V quantised or not
    by K's dtype), q / k / v heads or dims that disagree in prefill (query heads past the
    KV heads read past ``k``); a write to a pool with no heads launches nothing."""
    import torch

    from jattn.bridge import BridgeError
    from jattn.bridge import triton_native as tn

    f16 = torch.float16
    q, kc = torch.zeros(2, 4, 64, dtype=f16), torch.zeros(3, 4, 2, 64, dtype=f16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(BridgeError, match=r"sinks with shape \(4,\) and strides \(2,\) is not contiguous"):
        tn.mha_decode(q, kc, kc, table, lens, sinks=torch.zeros(8)[::2])
    loc, k = torch.tensor([1], dtype=torch.int32), torch.zeros(1, 2, 64, dtype=f16)
    for v_cache in (torch.zeros(2, 4, 2, 64, dtype=f16), torch.zeros(3, 4, 2, 64).to(torch.float8_e4m3fn)):
        with pytest.raises(BridgeError, match=r"v_cache .* must have k_cache's dtype \(torch.float16\) and pages"):
            tn.set_kv_buffer(kc, v_cache, loc, k, k.to(v_cache.dtype) if v_cache.dtype == f16 else k)
    empty = torch.zeros(3, 4, 0, 64, dtype=f16)
    assert tn.set_kv_buffer(empty, empty, loc, k[:, :0], k[:, :0])[0] is empty
    cu = torch.tensor([0, 2], dtype=torch.int32)
    kv = torch.zeros(2, 4, 64, dtype=f16)
    with pytest.raises(BridgeError, match=r"num_q_heads=6 must be a multiple of num_kv_heads=4"):
        tn.prefill(torch.zeros(2, 6, 64, dtype=f16), kv, kv, cu)
    with pytest.raises(BridgeError, match=r"must have q's head_dim=64, and v"):
        tn.prefill(torch.zeros(2, 4, 64, dtype=f16), kv, torch.zeros(2, 2, 64, dtype=f16), cu)
    with pytest.raises(BridgeError, match=r"sinks must have 4 entries"):
        tn.prefill(torch.zeros(2, 4, 64, dtype=f16), kv, kv, cu, sinks=torch.zeros(1))


def _compare(res, atol):
    names = sorted(k[len("jax/") :] for k in res.files if k.startswith("jax/"))
    assert len(names) == 2 * 8 + 4  # 8 steps x 2 layers, 2 pools x 2 layers
    for n in names:
        a, b = res[f"jax/{n}"], res[f"native/{n}"]
        if "pool" in n:  # the same writes: equal bits, NaN where nothing was written
            # (page 0, the dummy page, takes the JAX writer's padding rows: scratch, not compared)
            a, b = a[PAGE_SIZE:], b[PAGE_SIZE:]
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=n)
            np.testing.assert_array_equal(np.nan_to_num(a), np.nan_to_num(b), err_msg=n)
        else:
            assert np.isfinite(a).all() and np.isfinite(b).all(), n
            np.testing.assert_allclose(b, a, atol=atol, rtol=atol, err_msg=n)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_interpreted_native_equals_the_jax_path(interpreted, name):
    _compare(interpreted[name], 3e-3)


def test_native_option_is_checked():
    import torch

    from jattn import MHAConfig
    from jattn.bridge import AttentionLayer, BridgeError, TorchKVPool, TorchMHABackend

    cfg = MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, num_pages=8, kernel_backend="xla")
    with pytest.raises(ValueError, match="kernels='cuda' must be 'jax' or 'triton_native'"):
        TorchMHABackend(cfg, kernels="cuda")
    be = TorchMHABackend(cfg, device="cpu", kernels="triton_native")
    pool = TorchKVPool(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=64)
    layer = AttentionLayer(0, 4, 2, 64)
    q = torch.zeros(1, 256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        be.forward_decode(q, None, None, layer, None, pool, 1)
    be.init_forward_metadata(1, 0, torch.tensor([1]), torch.tensor([3]), torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="the installed plan is a decode plan: call forward_decode"):
        be.forward_extend(q, q[:, :128], q[:, :128], layer, None, pool, 1)
    if not on_gpu():  # this process has no interpreter: CPU tensors are refused by name
        with pytest.raises(BridgeError, match="needs a CUDA device"):
            be.forward_decode(q, None, None, layer, None, pool, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn"])
def test_gpu_native_equals_the_jax_path(kv):
    torch = pytest.importorskip("torch")
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not torch.cuda.is_available() or not triton_glue.available():
        pytest.skip("needs a GPU with torch CUDA and jax-triton")

    class Res(dict):
        files = property(lambda self: list(self))

    kw = dict(device="cuda", dtype="bfloat16", kv=kv, window=3, cap=5.0, sinks=True)
    res = Res({f"jax/{k}": v for k, v in scenario("jax", **kw).items()})
    res.update({f"native/{k}": v for k, v in scenario("triton_native", **kw).items()})
    _compare(res, 6e-2 if kv == "float8_e4m3fn" else 2e-2)


@pytest.mark.gpu
def test_gpu_native_decode_replays_from_a_torch_cuda_graph():
    """Capture the layer calls of a bucket-4 decode in a torch CUDA graph; plan a later
    step into the same bucket and replay: the outputs equal an eager run of that step."""
    torch = pytest.importorskip("torch")
    from jattn import ForwardMode, MHAConfig
    from jattn.bridge import AttentionLayer, TorchKVPool, TorchMHABackend
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not torch.cuda.is_available() or not triton_glue.available():
        pytest.skip("needs a GPU with torch CUDA and jax-triton")
    hq, hkv, d, ps = 8, 2, 128, 16
    cfg = MHAConfig(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, context_len=512, num_pages=64)
    pool = TorchKVPool(num_layers=1, num_pages=64, page_size=ps, num_kv_heads=hkv, head_dim=d, device="cuda")
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    be = TorchMHABackend(cfg, kernels="triton_native")
    layer = AttentionLayer(0, hq, hkv, d)
    req_to_page = torch.arange(1, 61, dtype=torch.int32).reshape(4, 15)
    req_to_page = torch.cat([torch.zeros(1, 15, dtype=torch.int32), req_to_page])
    rpi = torch.arange(1, 5, dtype=torch.int32)
    q = torch.randn(4, hq * d, device="cuda", dtype=torch.bfloat16)
    be.init_cuda_graph_state(4)
    be.init_forward_metadata_capture_cuda_graph(4, 4, forward_mode=ForwardMode.DECODE)
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        be.forward_decode(q, None, None, layer, None, pool, 4)  # warm-up: compiles, outside the capture
        with torch.cuda.graph(g, stream=s):
            out_g = be.forward_decode(q, None, None, layer, None, pool, 4)
    lens = torch.tensor([100, 1, 37, 230])
    be.init_forward_metadata_replay_cuda_graph(4, rpi, lens, req_to_page, ForwardMode.DECODE)
    g.replay()
    torch.cuda.synchronize()
    eager = be.forward_decode(q, None, None, layer, None, pool, 4)
    torch.testing.assert_close(out_g, eager, atol=0, rtol=0)
    assert out_g.abs().sum() > 0  # the replay read the new plan, not the all-padding one


# ----------------------------------------------------------------------------- MLA


def mla_scenario(kernels: str, *, device: str, dtype: str, kv: str, seed=0):
    """``TorchMLABackend`` steps on a fresh NaN-filled latent pool: a ragged prefill (its
    latent written by the pool's writer), two decode steps, a target verify, a draft
    extend with uneven query lengths, a CUDA-graph bucket with a padding request.
    Returns ``{name: array}`` of every output and the final pool (float32)."""
    import torch

    from jattn import ForwardMode, MLAConfig
    from jattn.bridge import DRAFT_EXTEND, AttentionLayer, TorchMLABackend, TorchMLAKVPool

    tdt = getattr(torch, dtype)
    kvdt = torch.float8_e4m3fn if kv == "float8_e4m3fn" else tdt
    H, R, r, P, V, ps, num_pages, spec = 4, 64, 16, 48, 64, PAGE_SIZE, 40, 2
    cfg = MLAConfig(
        num_heads=H,
        kv_lora_rank=R,
        qk_nope_head_dim=P,
        qk_rope_head_dim=r,
        v_head_dim=V,
        page_size=ps,
        context_len=64,
        num_pages=num_pages,
        spec_num_tokens=spec,
        dtype=dtype,
        kv_cache_dtype=kv,
        kernel_backend="xla" if device == "cpu" else None,
    )
    pool = TorchMLAKVPool(
        num_layers=1, num_pages=num_pages, page_size=ps, kv_lora_rank=R, qk_rope_head_dim=r, dtype=kvdt, device=device
    )
    pool.kv_buffer[0].copy_(torch.full(pool.kv_buffer[0].shape, float("nan"), device=device))
    kw = {"kv_writer": "torch"} if device == "cpu" and kernels == "jax" else {}
    be = TorchMLABackend(cfg, pool, device=device, kernels=kernels, **kw)
    fp8 = kvdt == torch.float8_e4m3fn
    absorbed = AttentionLayer(0, H, 1, R + r, v_head_dim=R, k_scale=0.05 if fp8 else None)
    prefill_layer = AttentionLayer(0, H, H, P + r, v_head_dim=V)
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    req_to_page = torch.zeros(5, 9, dtype=torch.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    req_to_page[1:] = torch.from_numpy(perm[:36].reshape(4, 9).astype(np.int32))
    rpi = torch.arange(1, 5, dtype=torch.int32)
    out = {}

    def rand(n, w):
        return (torch.randn(n, w, generator=g) * 0.5).to(tdt).to(device)

    lens = [5, 0, 13, 1]
    ext = torch.tensor(lens)
    be.init_forward_metadata(4, 4, rpi, ext, req_to_page, ForwardMode.EXTEND, extend_seq_lens=ext)
    n = sum(lens)
    args = (rand(n, H * P), rand(n, H * P), rand(n, H * V))
    o, lse = be.forward_extend(
        *args, prefill_layer, save_kv_cache=False, q_rope=rand(n, H * r), k_rope=rand(n, r), return_lse=True
    )
    out["prefill"], out["prefill_lse"] = o.float().cpu().numpy(), lse.float().cpu().numpy()
    slots = [int(req_to_page[b + 1, t // ps]) * ps + t % ps for b in range(4) for t in range(lens[b])]
    pool.set_mla_kv_buffer(absorbed, torch.tensor(slots, device=device), rand(n, R), rand(n, r))

    def absorbed_step(tag, n, mode, fwd, **md):
        be.init_forward_metadata(4, 0, rpi, torch.tensor(lens), req_to_page, mode, **md)
        o = getattr(be, fwd)(
            rand(n, H * R), rand(n, R), None, absorbed, None, True, q_rope=rand(n, H * r), k_rope=rand(n, r)
        )
        out[tag] = o.float().cpu().numpy()

    for step in range(2):
        lens = [x + 1 for x in lens]
        absorbed_step(f"decode{step}", 4, ForwardMode.DECODE, "forward_decode")
    lens = [x + spec for x in lens]
    absorbed_step("verify", 4 * spec, ForwardMode.TARGET_VERIFY, "forward_extend")
    news = [3, 1, 2, 0]
    lens = [a + b for a, b in zip(lens, news)]
    absorbed_step("draft_extend", sum(news), DRAFT_EXTEND, "forward_extend", extend_seq_lens=torch.tensor(news))
    be.init_cuda_graph_state(4)
    be.init_forward_metadata_capture_cuda_graph(4, 4, forward_mode=ForwardMode.DECODE)
    lens = [x + 1 for x in lens]
    be.init_forward_metadata_replay_cuda_graph(3, rpi[:3], torch.tensor(lens[:3]), req_to_page, ForwardMode.DECODE)
    o = be.forward_decode(
        rand(3, H * R), rand(3, R), None, absorbed, None, True, q_rope=rand(3, H * r), k_rope=rand(3, r)
    )
    out["bucket"] = o.float().cpu().numpy()
    out["pool"] = pool.kv_buffer[0].float().cpu().numpy()
    return out


def run_interpreted_mla(name: str, path: str) -> None:
    kw = dict(device="cpu", dtype="float16", kv="float16")
    res = {f"jax/{k}": v for k, v in mla_scenario("jax", **kw).items()}
    res.update({f"native/{k}": v for k, v in mla_scenario("triton_native", **kw).items()})
    np.savez(path, **res)


@pytest.fixture(scope="module")
def interpreted_mla(tmp_path_factory):
    return run_in_interpreter(tmp_path_factory, "test_bridge_native", {"run_interpreted_mla": ["fp16"]})


def _compare_mla(res, atol):
    names = sorted(k[len("jax/") :] for k in res.files if k.startswith("jax/"))
    assert len(names) == 8  # prefill out and LSE, 5 absorbed steps, the pool
    for n in names:
        a, b = res[f"jax/{n}"], res[f"native/{n}"]
        if n == "pool":  # the pool's own writer both times: equal bits, NaN where nothing was written
            # Page 0 is the reserved dummy page, the sink of padding rows' writes: what lands
            # there is unspecified (the JAX path writes a CUDA-graph bucket's padding row
            # there, the native launch skips it), so only the pages requests hold compare.
            a, b = a[PAGE_SIZE:], b[PAGE_SIZE:]
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=n)
            np.testing.assert_array_equal(np.nan_to_num(a), np.nan_to_num(b), err_msg=n)
        else:
            assert np.isfinite(a).all() and np.isfinite(b).all(), n
            np.testing.assert_allclose(b, a, atol=atol, rtol=atol, err_msg=n)


def test_interpreted_native_mla_equals_the_jax_path(interpreted_mla):
    """``TorchMLABackend(kernels="triton_native")`` against the JAX path, every mode."""
    _compare_mla(interpreted_mla["fp16"], 3e-3)


def test_native_mla_option_is_checked():
    import torch

    from jattn import MLAConfig
    from jattn.bridge import AttentionLayer, BridgeError, TorchMLABackend, TorchMLAKVPool

    cfg = MLAConfig(
        num_heads=2, kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, page_size=4, num_pages=8
    )
    with pytest.raises(ValueError, match="kernels='cuda' must be 'jax' or 'triton_native'"):
        TorchMLABackend(cfg, kernels="cuda")
    pool = TorchMLAKVPool(num_layers=1, num_pages=8, page_size=4, kv_lora_rank=64, qk_rope_head_dim=16)
    be = TorchMLABackend(cfg, pool, device="cpu", kernels="triton_native")
    layer = AttentionLayer(0, 2, 1, 80, v_head_dim=64)
    q, qr = torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        be.forward_decode(q, None, None, layer, None, False, q_rope=qr)
    be.init_forward_metadata(1, 0, torch.tensor([1]), torch.tensor([3]), torch.tensor([[0], [1]]))
    with pytest.raises(NotImplementedError, match="cos_sin_cache"):
        be.forward_decode(q, None, None, layer, None, False, q_rope=qr, cos_sin_cache=torch.zeros(8, 16))
    if not on_gpu():  # this process has no interpreter: CPU tensors are refused by name
        with pytest.raises(BridgeError, match="needs a CUDA device"):
            be.forward_decode(q, None, None, layer, None, False, q_rope=qr)
    # the latent pool is checked as on the JAX path before any kernel runs: too few pages
    small = TorchMLAKVPool(num_layers=1, num_pages=4, page_size=4, kv_lora_rank=64, qk_rope_head_dim=16)
    be = TorchMLABackend(cfg, small, device="cpu", kernels="triton_native")
    be.init_forward_metadata(1, 0, torch.tensor([1]), torch.tensor([3]), torch.tensor([[0], [1]]))
    with pytest.raises(BridgeError, match=r"kv_buffer\[layer 0\] has 4 pages, config\.num_pages=8"):
        be.forward_decode(q, None, None, layer, None, False, q_rope=qr)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "float8_e4m3fn"])
def test_gpu_native_mla_equals_the_jax_path(kv):
    torch = pytest.importorskip("torch")
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not torch.cuda.is_available() or not triton_glue.available():
        pytest.skip("needs a GPU with torch CUDA and jax-triton")

    class Res(dict):
        files = property(lambda self: list(self))

    kw = dict(device="cuda", dtype="bfloat16", kv=kv)
    res = Res({f"jax/{k}": v for k, v in mla_scenario("jax", **kw).items()})
    res.update({f"native/{k}": v for k, v in mla_scenario("triton_native", **kw).items()})
    _compare_mla(res, 6e-2 if kv == "float8_e4m3fn" else 2e-2)


@pytest.mark.gpu
def test_gpu_native_mla_decode_replays_from_a_torch_cuda_graph():
    """The absorbed decode of a bucket-4 step (latent write included) captured in a torch
    CUDA graph, replayed on a later plan of the same bucket: equal to an eager run."""
    torch = pytest.importorskip("torch")
    from jattn import ForwardMode, MLAConfig
    from jattn.bridge import AttentionLayer, TorchMLABackend, TorchMLAKVPool
    from jattn.pallas_kernels import triton_glue

    if not on_gpu() or not torch.cuda.is_available() or not triton_glue.available():
        pytest.skip("needs a GPU with torch CUDA and jax-triton")
    H, R, r, ps = 16, 512, 64, 64
    cfg = MLAConfig(
        num_heads=H,
        kv_lora_rank=R,
        qk_nope_head_dim=128,
        qk_rope_head_dim=r,
        v_head_dim=128,
        page_size=ps,
        context_len=1024,
        num_pages=64,
    )
    pool = TorchMLAKVPool(num_layers=1, num_pages=64, page_size=ps, kv_lora_rank=R, qk_rope_head_dim=r, device="cuda")
    pool.kv_buffer[0].normal_()
    be = TorchMLABackend(cfg, pool, kernels="triton_native")
    layer = AttentionLayer(0, H, 1, R + r, v_head_dim=R)
    req_to_page = torch.arange(1, 61, dtype=torch.int32).reshape(4, 15)
    req_to_page = torch.cat([torch.zeros(1, 15, dtype=torch.int32), req_to_page])
    rpi = torch.arange(1, 5, dtype=torch.int32)
    q, qr = (torch.randn(4, H * w, device="cuda", dtype=torch.bfloat16) for w in (R, r))
    c, kr = (torch.randn(4, w, device="cuda", dtype=torch.bfloat16) for w in (R, r))
    be.init_cuda_graph_state(4)
    be.init_forward_metadata_capture_cuda_graph(4, 4, forward_mode=ForwardMode.DECODE)
    s = torch.cuda.Stream()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        be.forward_decode(q, c, None, layer, None, True, q_rope=qr, k_rope=kr)  # warm-up (compiles)
        with torch.cuda.graph(gr, stream=s):
            out_g = be.forward_decode(q, c, None, layer, None, True, q_rope=qr, k_rope=kr)
    lens = torch.tensor([300, 1, 77, 900])
    be.init_forward_metadata_replay_cuda_graph(4, rpi, lens, req_to_page, ForwardMode.DECODE)
    gr.replay()
    torch.cuda.synchronize()
    eager = be.forward_decode(q, c, None, layer, None, True, q_rope=qr, k_rope=kr)
    torch.testing.assert_close(out_g, eager, atol=0, rtol=0)
    assert out_g.abs().sum() > 0


def test_native_capture_plans_keep_their_tensors():
    """A captured bucket's plan tensors were in a bounded dict of plan shapes: once enough
    other shapes came (prefill buckets), they were dropped and freed, and the next replay
    wrote its plan into new tensors while the captured graph read the old addresses. Both
    capture entry points now keep them for good; a replay writes into them."""
    import numpy as np
    import torch

    from jattn import ForwardMode, MHAConfig
    from jattn.bridge import AttentionLayer, TorchKVPool, TorchMHABackend

    cfg = MHAConfig(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=4, context_len=256, num_pages=512,
                    kv_cache_dtype="float32", dtype="float32", kernel_backend="xla", spec_num_tokens=1)  # fmt: skip
    be = TorchMHABackend(cfg, device="cpu", kernels="triton_native")
    be.init_cuda_graph_state(8)
    be._native.maxsize = 2  # (64 in use: three other shapes here evict as 65 would)
    table = torch.arange(1, 1 + 8 * 64, dtype=torch.int32).reshape(8, 64)
    be.init_forward_metadata_capture_cuda_graph(4)
    captured = dict(be._native_plan.tensors)
    be.init_forward_metadata_out_graph(2, torch.arange(2), torch.tensor([5, 3]), table, in_capture=True)
    captured2 = dict(be._native_plan.tensors)
    for n in (1, 2, 3):  # other plan shapes: extends of n requests
        ext = torch.full((n,), 7)
        be.init_forward_metadata(n, n, torch.arange(n), ext, table, ForwardMode.EXTEND, extend_seq_lens=ext)
    be.init_forward_metadata_replay_cuda_graph(3, torch.arange(3), torch.tensor([5, 9, 2]), table)
    assert all(be._native_plan.tensors[k] is t for k, t in captured.items())
    np.testing.assert_array_equal(be._native_plan.tensors["cache_seqlens"].numpy()[:3], [5, 9, 2])
    be.init_forward_metadata_replay_cuda_graph(2, torch.arange(2), torch.tensor([6, 4]), table)
    assert all(be._native_plan.tensors[k] is t for k, t in captured2.items())
    # precompile with a value head size other than the key's (it passed K's width as V)
    pool = TorchKVPool(num_layers=1, num_pages=512, page_size=4, num_kv_heads=2, head_dim=16, head_dim_v=8,
                       dtype=torch.float32)  # fmt: skip
    jax_be = TorchMHABackend(cfg)
    jax_be.init_cuda_graph_state(4)
    jax_be.init_forward_metadata_capture_cuda_graph(2)
    jax_be.precompile([AttentionLayer(0, 4, 2, 16, v_head_dim=8)], token_to_kv_pool=pool)


def test_native_decodes_name_heads_lengths_and_rope_widths_they_cannot_take():
    """Refused before any launch (so on the CPU without the interpreter): query heads that
    are not a multiple of the cache's KV heads, ``cache_seqlens`` of another batch than
    ``page_table``, an MLA rope width that is not a power of two >= 16."""
    import torch

    from jattn.bridge import BridgeError
    from jattn.bridge import triton_native as tn

    g = torch.Generator().manual_seed(7)
    f16 = torch.float16
    kc = torch.randn(3, 4, 4, 64, generator=g).to(f16)
    table, lens = torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(BridgeError, match=r"num_q_heads=6 must be a multiple of num_kv_heads=4"):
        tn.mha_decode(torch.randn(2, 6, 64, generator=g).to(f16), kc, kc, table, lens)
    q = torch.randn(2, 4, 64, generator=g).to(f16)
    with pytest.raises(BridgeError, match=r"cache_seqlens has 3 rows, page_table 2"):
        tn.mha_decode(q, kc, kc, table, torch.tensor([3, 4, 1], dtype=torch.int32))
    for rope in (24, 8):
        w = 64 + rope
        kv = torch.randn(3, 4, w, generator=g).to(f16)
        with pytest.raises(BridgeError, match=rf"kv_lora_rank=64 and rope width {rope} must be powers of two >= 16"):
            tn.mla_decode(
                torch.randn(2, 2, w, generator=g).to(f16), kv, table, lens, kv_lora_rank=64, softmax_scale=0.1
            )
