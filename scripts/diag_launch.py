"""Diagnostics (GPU): where batch-1 decode time and bridge host time go.

1. Device timeline of the batch-1 mosaic decode: every event (kernels, copies,
   memsets) of single calls and of a many-calls jit, eager and with command
   buffers, with start offsets, so launch gaps show where they are.
2. Host dispatch time of those jitted calls (time until the call returns).
3. Host cost of a jitted call against its number of inputs, outputs and donated
   buffers, and of the CUDA event calls the bridge's fences make.

    python scripts/diag_launch.py [decode] [jit]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def host_us(fn, n=300, warm=30):
  from jattn.bench.bridge import _host_us
  return _host_us(fn, n, warm)


def dispatch_us(step, args, n=50):
  """Host time until ``jit(step(0, *args))`` returns, the GPU idle before each call."""
  jf = jax.jit(lambda *a: step(0, *a))
  jax.block_until_ready(jf(*args))
  ds = []
  for _ in range(n):
    t0 = time.perf_counter()
    o = jf(*args)
    ds.append(time.perf_counter() - t0)
    jax.block_until_ready(o)
  return statistics.median(ds) * 1e6


def dispatch_and_wall(fn, args, reps=20):
  """Medians (us) of the host time until ``fn(*args)`` returns and until its result is
  ready, the GPU idle before each call."""
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    ts.append(((t1 - t0) * 1e6, (time.perf_counter() - t0) * 1e6))
    del out
  return statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)


def timeline(fn, args, label, reps=3):
  from jattn.bench import profile as prof
  calls = prof.profile_calls(fn, [args] * reps, warmup=1)
  c = calls[-1]
  t0 = c.kernels[0].start_ns
  print(f"--- {label}: span {c.span_us:.1f} us, busy {c.busy_us:.1f} us, {len(c.kernels)} events")
  prev_end = t0
  for k in c.kernels[:60]:
    gap = (k.start_ns - prev_end) / 1e3
    print(f"   +{(k.start_ns - t0) / 1e3:8.2f} us  dur {k.dur_ns / 1e3:7.2f}  gap {gap:6.2f}  {k.name[:70]}")
    prev_end = max(prev_end, k.start_ns + k.dur_ns)


def decode_diag():
  from jattn.bench import common
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  rng = np.random.default_rng(0)
  for L in (4096, 32768):
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, 16)
    one = jax.jit(lambda q, k, v, t, lens: md.mha_decode(q, k, v, t, lens))
    timeline(one, (qs[0], k, v, tables[0], lens), f"1x{L} single call")
    for graph in (False, True):
      kw = {"compiler_options": common.GRAPH_OPTIONS} if graph else {}
      n = 6
      many = jax.jit(lambda qs, k, v, t, lens: tuple(
          md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens) for i in range(n)), **kw)
      timeline(many, (qs, k, v, tables, lens), f"1x{L} {n} calls in one jit, graph={graph}", reps=2)
      d, w = dispatch_and_wall(many, (qs, k, v, tables, lens))
      print(f"   host dispatch of the {n}-call jit: {d:.1f} us ({d / n:.1f}/call); wall to ready "
            f"{w:.1f} us ({w / n:.1f}/call)")
    # a single split (no combine kernel) and the combine alone
    bsz = md.choose_block_sizes(batch=1, num_kv_heads=8, head_dim=128, page_size=16,
                                max_pages=tables.shape[-1], m_rows=32, kv_itemsize=2)
    import dataclasses
    for sp in (1, 33, 66, bsz.num_splits):
      b2 = dataclasses.replace(bsz, num_splits=sp)
      f = jax.jit(lambda q, k, v, t, lens, b2=b2: md.mha_decode(q, k, v, t, lens, block_sizes=b2))
      timeline(f, (qs[0], k, v, tables[0], lens), f"1x{L} single call, splits={sp}", reps=3)
    del qs, k, v


def jit_diag():
  import torch
  dev = jax.devices()[0]
  x = jnp.ones((4,), jnp.float32)
  smalls = [jnp.full((4,), i, jnp.int32) for i in range(16)]
  rows = []
  f1 = jax.jit(lambda x: x + 1)
  rows.append(("1 in, 1 out", host_us(lambda: f1(x))))
  for nin in (4, 8, 16):
    f = jax.jit(lambda *a: sum(a[1:], a[0]))
    rows.append((f"{nin} in, 1 out", host_us(lambda f=f, nin=nin: f(*smalls[:nin]))))
  for nout in (2, 4):
    f = jax.jit(lambda x, nout=nout: tuple(x + i for i in range(nout)))
    rows.append((f"1 in, {nout} out", host_us(lambda f=f: f(x))))
  f = jax.jit(lambda *a: tuple(a[i] + 1 for i in range(4)))
  rows.append(("4 in, 4 out", host_us(lambda: f(*smalls[:4]))))
  # donation of big buffers updated in place (like the KV pool)
  for nd in (1, 2, 3):
    bigs = [jnp.zeros((1 << 22,), jnp.bfloat16) + i for i in range(3)]
    g = jax.jit(lambda x, *b: tuple(bb.at[:4].set(x.astype(bb.dtype)) for bb in b),
                donate_argnums=tuple(range(1, nd + 1)))
    state = {"b": bigs[:nd]}

    def call(g=g, state=state):
      state["b"] = g(x, *state["b"])
    rows.append((f"{nd} donated big buffers updated in place (+1 in)", host_us(call)))
  # out aliasing only (donated small out buffer)
  ob = {"o": jnp.zeros((1, 4096), jnp.bfloat16)}
  h = jax.jit(lambda x, o: o.at[0, :4].set(x.astype(o.dtype)), donate_argnums=(1,))

  def callo():
    ob["o"] = h(x, ob["o"])
  rows.append(("1 donated small out buffer", host_us(callo)))
  # torch-side CUDA calls of the fences
  ev = torch.cuda.Event()
  s = torch.cuda.current_stream()
  s2 = torch.cuda.Stream()
  rows.append(("torch.cuda.current_stream()", host_us(lambda: torch.cuda.current_stream())))
  rows.append(("torch.cuda.current_stream(device)", host_us(lambda: torch.cuda.current_stream(torch.device("cuda", 0)))))
  rows.append(("Event.record()", host_us(lambda: ev.record())))
  rows.append(("Event.record(stream)", host_us(lambda: ev.record(s2))))
  rows.append(("stream.wait_event(ev)", host_us(lambda: s2.wait_event(ev))))
  t = torch.zeros(32 * 128, dtype=torch.bfloat16, device="cuda")
  t2 = torch.zeros_like(t)
  rows.append(("torch copy_ (8 KB)", host_us(lambda: t2.copy_(t))))
  try:
    import ctypes
    cudart = None
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
      try:
        cudart = ctypes.CDLL(name)
        break
      except OSError:
        continue
    if cudart is None:
      import glob as g2
      cands = g2.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))
      cudart = ctypes.CDLL(cands[0]) if cands else None
    if cudart is not None:
      evp = ctypes.c_void_p(ev.cuda_event)
      sp = ctypes.c_void_p(s2.cuda_stream)
      rec = cudart.cudaEventRecord
      rows.append(("ctypes cudaEventRecord", host_us(lambda: rec(evp, sp))))
      wt = cudart.cudaStreamWaitEvent
      rows.append(("ctypes cudaStreamWaitEvent", host_us(lambda: wt(sp, evp, 0))))
  except Exception as e:  # noqa: BLE001
    rows.append((f"ctypes: {type(e).__name__}: {e}"[:80], float("nan")))
  torch.cuda.synchronize()
  print("--- host us per call (median)")
  for k, v in rows:
    print(f"   {v:8.1f}  {k}")


def parts_diag():
  """Per-call time (many calls in one jit, differential) of the decode's parts."""
  from jattn.bench import common
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  from jattn.pallas_kernels.split_combine import combine_splits
  rng = np.random.default_rng(0)
  for L in (4096, 32768):
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, 48)
    bsz = md.choose_block_sizes(batch=1, num_kv_heads=8, head_dim=128, page_size=16,
                                max_pages=tables.shape[-1], m_rows=32, kv_itemsize=2)
    cfg = md._Cfg(batch=1, num_pages=k.shape[0], page_size=16, max_pages=tables.shape[-1],
                  num_kv_heads=8, num_q_heads=32, head_dim=128, q_len=1, m_rows=32, q_rows=32,
                  m_tiles=1, is_causal=True, window_left=-1, logit_cap=0.0, bs=bsz, interpret=False)
    k2 = k.reshape(k.shape[0], -1, 128)
    v2 = v.reshape(v.shape[0], -1, 128)
    scale = np.asarray([1 / np.sqrt(128)], np.float32)

    def full(i, qs, k, v, t, lens):
      return md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens)

    def kern(i, qs, k, v, t, lens):
      return md._run_kernel(cfg, jnp.bfloat16, t[i % NUM_ROT], lens, scale,
                            qs[i].reshape(1, 32, 128), k2, v2)
    op, lp = kern(0, qs, k, v, tables, lens)
    ops_ = jnp.stack([op + i for i in range(8)])

    def comb(i, ops_, lp):
      return combine_splits(ops_[i % 8], lp + i, None, None, m_rows=32, num_q_heads=32,
                            out_dtype=jnp.dtype(jnp.bfloat16), interpret=False)
    for name, fn, args in (("full op", full, (qs, k, v, tables, lens)),
                           ("decode kernel only", kern, (qs, k, v, tables, lens)),
                           ("combine only", comb, (ops_, lp))):
      print(f"1x{L} {name:20s} host dispatch of one call (GPU idle): "
            f"{dispatch_us(fn, args):.1f} us", flush=True)
    for name, fn, args in (("full op", full, (qs, k, v, tables, lens)),
                           ("decode kernel only", kern, (qs, k, v, tables, lens)),
                           ("combine only", comb, (ops_, lp))):
      for graph in (False, True):
        t = common.time_rotated(fn, args, n_hi=48, graph=graph)
        print(f"1x{L} {name:20s} graph={graph}: {t.seconds * 1e6:7.1f} us/call "
              f"(spread {t.spread:.2f})", flush=True)
    del qs, k, v


if __name__ == "__main__":
  which = sys.argv[1:] or ["decode", "jit"]
  print("jax", jax.__version__, jax.devices())
  if "jit" in which:
    jit_diag()
  if "decode" in which:
    decode_diag()
  if "parts" in which:
    parts_diag()
