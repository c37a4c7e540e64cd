"""Diagnostics (GPU): is XLA's command buffer what costs the batch-1 decode its host time?

For the batch-1 mosaic decode, n calls in one jit, under XLA's default command-buffer
setting, under ``FUSION,CUSTOM_CALL`` and with command buffers off:

1. the custom calls in the compiled program;
2. host dispatch (until the call returns) and wall time to ready;
3. the host-side trace events of those calls, summed by name (what XLA's runtime
   spends the dispatch on: thunk execution, command-buffer recording/update, the
   Mosaic GPU FFI handler, kernel launches);
4. per-call time by the benchmark's differential method (48 calls).

Other modes: ``timeline`` (host thunks and device kernels of one jit on one clock),
``spans`` / ``spans-joined`` (profiled host and device time against unprofiled wall
for 2/12/48 calls), ``hostbreak``, ``donated``, ``vlog`` (see each function).

    python scripts/diag_cmdbuf.py [4096,32768 | timeline | spans | ...]
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jattn.bench.profile import trace_events
from diag_launch import dispatch_and_wall  # the sibling script (this folder is on sys.path)


def _options(name):
  from jattn.bench import common
  return {"default": {}, "FUSION,CUSTOM_CALL": {"compiler_options": common.GRAPH_OPTIONS},
          "off": {"compiler_options": common.NO_GRAPH_OPTIONS}}[name]


def host_events(fn, args, reps=3, top=22):
  host, _ = trace_events(fn, args, reps=reps)
  tot = collections.Counter()
  cnt = collections.Counter()
  for _, dur, name in host:
    name = re.sub(r"\d+", "#", name)[:90]
    tot[name] += dur
    cnt[name] += 1
  for name, ns in tot.most_common(top):
    print(f"     {ns / reps / 1e3:9.1f} us/jit-call  x{cnt[name] / reps:6.1f}  {name}")

def main():
  from jattn.bench import common
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096,32768").split(",")]
  rng = np.random.default_rng(0)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, 48)
    for name in ("default", "FUSION,CUSTOM_CALL", "off"):
      kw = _options(name)
      n = 6
      many = jax.jit(lambda qs, k, v, t, lens: tuple(
          md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens) for i in range(n)), **kw)
      # (Command buffers are formed from the thunks, after the HLO: the compiled HLO
      # text does not show them; the host events below do, as command_buffer_#.)
      txt = many.lower(qs, k, v, tables, lens).compile().as_text()
      targets = collections.Counter(re.findall(r"custom_call_target=\"([^\"]+)\"", txt))
      print(f"--- 1x{L}, {n} calls in one jit, command buffers {name}: custom calls "
            f"{dict(targets)}", flush=True)
      d, w = dispatch_and_wall(many, (qs, k, v, tables, lens), reps=30)
      print(f"   host dispatch {d:.1f} us ({d / n:.1f}/call); wall to ready {w:.1f} us "
            f"({w / n:.1f}/call)", flush=True)
      print("   host trace events (sum per jit call):")
      host_events(many, (qs, k, v, tables, lens))

      def step(i, qs, k, v, t, lens):
        return md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens)
      graph = {"default": False, "FUSION,CUSTOM_CALL": True, "off": "off"}[name]
      for n_hi in (12, 48):
        t = common.time_rotated(step, (qs, k, v, tables, lens), n_hi=n_hi, graph=graph)
        print(f"   differential per call (2..{n_hi} calls): {t.seconds * 1e6:.1f} us "
              f"({kv_bytes / t.seconds / 1e12:.2f} TB/s), spread {t.spread:.2f}", flush=True)
    del qs, k, v


def timelines(lengths=(4096, 32768), n=6):
  """Host thunk events and device kernels of one n-call jit, on one clock."""
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  rng = np.random.default_rng(1)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, n)
    for name in ("default", "off"):
      many = jax.jit(lambda qs, k, v, t, lens: tuple(
          md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens) for i in range(n)), **_options(name))
      args = (qs, k, v, tables, lens)
      host, dev = trace_events(many, args, reps=3, warmup=3, pause_s=0.002)
      execs = sorted(e for e in host if "ExecuteThunks" in e[2])
      if not execs:
        print("no ExecuteThunks events")
        continue
      t0, d0, _ = execs[-1]
      t_end = t0 + d0 + 2e6
      keep = [e for e in host if t0 - 50e3 <= e[0] <= t_end and not e[2].startswith("$")]
      keep += [(s, d, "GPU  " + nm) for s, d, nm in dev if t0 - 50e3 <= s <= t_end]
      keep.sort()
      print(f"--- 1x{L}, {n} calls, command buffers {name}: timeline from ExecuteThunks start")
      for s, d, nm in keep[:140]:
        print(f"   {(s - t0) / 1e3:9.2f}  dur {d / 1e3:8.2f}  {nm[:80]}")
    del qs, k, v


def spans(lengths=(4096, 32768), ns=(2, 12, 48), modes=("default", "off"), join=False):
  """Per n-call jit: host ExecuteThunks time, device span and busy time (profiled),
  beside the unprofiled wall time: which one grows by the benchmark's per-call figure."""
  from jattn.bench import common
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  rng = np.random.default_rng(2)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, max(ns))
    args = (qs, k, v, tables, lens)
    for name in modes:
      for n in ns:
        many = jax.jit(lambda qs, k, v, t, lens, n=n: (common._joined if join else tuple)(tuple(
            md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens) for i in range(n))),
            **_options(name))
        for _ in range(3):
          jax.block_until_ready(many(*args))
        walls = []
        for _ in range(15):
          t0 = time.perf_counter()
          jax.block_until_ready(many(*args))
          walls.append((time.perf_counter() - t0) * 1e6)
        reps = 4
        host, dev = trace_events(many, args, reps=reps, warmup=0, pause_s=0.003)
        host = [e for e in host if "ExecuteThunks" in e[2]]
        rows = []
        for j, (hs, hd, _) in enumerate(host):
          nxt = host[j + 1][0] if j + 1 < len(host) else float("inf")
          ks = [e for e in dev if hs <= e[0] < nxt]
          if not ks:
            continue
          first, last = ks[0][0], max(e[0] + e[1] for e in ks)
          busy = sum(e[1] for e in ks)
          dec = [e[1] for e in ks if "paged_decode" in e[2]]
          rows.append((hd / 1e3, (first - hs) / 1e3, (last - first) / 1e3, busy / 1e3,
                       statistics.median(dec) / 1e3 if dec else 0.0, len(ks)))
        med = lambda i: statistics.median(r[i] for r in rows) if rows else float("nan")
        print(f"1x{L} {name:7s} n={n:2d}: wall {statistics.median(walls):8.1f} us | profiled: "
              f"host thunks {med(0):7.1f}, GPU starts +{med(1):6.1f}, device span {med(2):7.1f} "
              f"({med(2) / n:5.1f}/call), busy {med(3):7.1f}, decode kernel {med(4):5.1f}, "
              f"{med(5):.0f} kernels", flush=True)
    del qs, k, v


def hostbreak(L=32768, ns=(6, 24)):
  """Which host events grow with the number of calls, outputs joined, XLA defaults."""
  from jattn.bench import common
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  rng = np.random.default_rng(3)
  qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, max(ns))
  args = (qs, k, v, tables, lens)
  for n in ns:
    many = jax.jit(lambda qs, k, v, t, lens, n=n: common._joined(tuple(
        md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens) for i in range(n))))
    print(f"--- 1x{L}, {n} calls, outputs joined, XLA defaults: host events per jit call")
    host_events(many, args, reps=4, top=40)


def donated(lengths=(4096, 32768), ns=(2, 48), reps=9):
  """Per-call differential under XLA's defaults with the joined outputs written into a
  donated buffer (the same address every execution) against a fresh output buffer:
  does a changed output address make XLA redo the Mosaic calls' recording?"""
  from jattn.bench import common
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  rng = np.random.default_rng(4)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, max(ns))
    args = (qs, k, v, tables, lens)
    res = {}
    for mode in ("fresh output", "donated output"):
      walls = {}
      for n in ns:
        def body(qs, k, v, t, lens, n=n):
          return common._joined(tuple(md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens)
                                      for i in range(n)))[0]
        if mode == "fresh output":
          f = jax.jit(body)
          call = lambda f=f: f(*args)
        else:
          g = jax.jit(lambda buf, *a, body=body: buf.at[:].set(body(*a)), donate_argnums=0)
          state = {"buf": jnp.zeros(jax.eval_shape(body, *args).shape, jnp.bfloat16)}

          def call(g=g, state=state):
            state["buf"] = g(state["buf"], *args)
            return state["buf"]
        for _ in range(3):
          jax.block_until_ready(call())
        ts = []
        for _ in range(reps):
          t0 = time.perf_counter()
          jax.block_until_ready(call())
          ts.append((time.perf_counter() - t0) * 1e6)
        walls[n] = statistics.median(ts)
      per = (walls[ns[1]] - walls[ns[0]]) / (ns[1] - ns[0])
      res[mode] = per
      print(f"1x{L} {mode:15s}: wall n={ns[0]} {walls[ns[0]]:.1f} us, n={ns[1]} "
            f"{walls[ns[1]]:.1f} us -> {per:.1f} us/call ({kv_bytes / per / 1e6:.2f} TB/s)",
            flush=True)
    del qs, k, v


def vlog(L=4096, n=4, execs=4):
  """A few executions of an n-call joined jit, with markers on stderr, for reading
  XLA's command-buffer VLOG lines (run with TF_CPP_VMODULE set) between them."""
  from jattn.bench import common
  from jattn.bench.decode import _setup, NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  rng = np.random.default_rng(5)
  qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, n)
  f = jax.jit(lambda qs, k, v, t, lens: common._joined(tuple(
      md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens) for i in range(n))))
  for e in range(execs):
    print(f"===== execution {e} begins", file=sys.stderr, flush=True)
    jax.block_until_ready(f(qs, k, v, tables, lens))
    print(f"===== execution {e} ends", file=sys.stderr, flush=True)


if __name__ == "__main__":
  print("jax", jax.__version__, jax.devices())
  print("XLA_FLAGS", os.environ.get("XLA_FLAGS"))
  if "timeline" in sys.argv[1:]:
    timelines()
  elif "vlog" in sys.argv[1:]:
    vlog()
  elif "donated" in sys.argv[1:]:
    donated()
  elif "hostbreak" in sys.argv[1:]:
    hostbreak()
  elif "spans" in sys.argv[1:]:
    spans()
  elif "spans-joined" in sys.argv[1:]:
    spans(modes=("default",), join=True)
  else:
    main()
