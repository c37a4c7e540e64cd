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
for 2/12/48 calls), ``hostbreak``, ``donated``, ``vlog``, ``seq`` (XLA's command-buffer
log per back-to-back execution; count it with ``vlog_summary.py``), ``walls`` (output
and metadata variants), ``stamps`` (wall against %globaltimer device spans per n),
``stamphlo`` (see each function).

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


def _step(i, qs, k, v, t, lens):
  """Call i of the rotated harness: bench decode's batch-1 decode, page table i % NUM_ROT."""
  from jattn.bench.decode import NUM_ROT
  from jattn.pallas_kernels import mosaic_decode as md
  return md.mha_decode(qs[i], k, v, t[i % NUM_ROT], lens)


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
  from jattn.bench.decode import _setup
  lengths = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096,32768").split(",")]
  rng = np.random.default_rng(0)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, 48)
    for name in ("default", "FUSION,CUSTOM_CALL", "off"):
      kw = _options(name)
      n = 6
      many = common.rotated_program(_step, n, join=False, **kw)
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

      graph = {"default": False, "FUSION,CUSTOM_CALL": True, "off": "off"}[name]
      for n_hi in (12, 48):
        t = common.time_rotated(_step, (qs, k, v, tables, lens), n_hi=n_hi, graph=graph)
        print(f"   differential per call (2..{n_hi} calls): {t.seconds * 1e6:.1f} us "
              f"({kv_bytes / t.seconds / 1e12:.2f} TB/s), spread {t.spread:.2f}", flush=True)
    del qs, k, v


def timelines(lengths=(4096, 32768), n=6):
  """Host thunk events and device kernels of one n-call jit, on one clock."""
  from jattn.bench import common
  from jattn.bench.decode import _setup
  rng = np.random.default_rng(1)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, n)
    for name in ("default", "off"):
      many = common.rotated_program(_step, n, join=False, **_options(name))
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
  from jattn.bench.decode import _setup
  rng = np.random.default_rng(2)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, max(ns))
    args = (qs, k, v, tables, lens)
    for name in modes:
      for n in ns:
        many = common.rotated_program(_step, n, join=join, **_options(name))
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
  from jattn.bench.decode import _setup
  rng = np.random.default_rng(3)
  qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, max(ns))
  args = (qs, k, v, tables, lens)
  for n in ns:
    many = common.rotated_program(_step, n)
    print(f"--- 1x{L}, {n} calls, outputs joined, XLA defaults: host events per jit call")
    host_events(many, args, reps=4, top=40)


def donated(lengths=(4096, 32768), ns=(2, 48), reps=9):
  """Per-call differential under XLA's defaults with the joined outputs written into a
  donated buffer (the same address every execution) against a fresh output buffer:
  does a changed output address make XLA redo the Mosaic calls' recording?"""
  walls(lengths, ns, reps, variants=("fresh out", "donated out"))


def vlog(L=4096, n=4, execs=4):
  """A few executions of an n-call joined jit, with markers on stderr, for reading
  XLA's command-buffer VLOG lines (run with TF_CPP_VMODULE set) between them."""
  from jattn.bench import common
  from jattn.bench.decode import _setup
  rng = np.random.default_rng(5)
  qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, n)
  f = common.rotated_program(_step, n)
  for e in range(execs):
    print(f"===== execution {e} begins", file=sys.stderr, flush=True)
    jax.block_until_ready(f(qs, k, v, tables, lens))
    print(f"===== execution {e} ends", file=sys.stderr, flush=True)


def _variant_call(variant, n, L, rng):
  """A zero-argument call running one execution of an n-call joined jit, per variant:

  * ``fresh out``: the harness's way (same inputs every execution, a fresh output);
  * ``donated out``: the output written into a donated buffer (stable address);
  * ``fresh meta``: page tables and lengths transferred anew every execution, as a
    serving step's metadata is;
  * ``staged meta``: the same fresh metadata, copied inside the jit into donated
    persistent buffers that the kernels read (stable addresses for the Mosaic calls).
  """
  from jattn.bench import common
  from jattn.bench.decode import _setup
  qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, n)
  t_host, l_host = np.asarray(tables), np.asarray(lens)

  def body(qs, k, v, t, lens):
    return common._joined(tuple(_step(i, qs, k, v, t, lens) for i in range(n)))[0]

  st = {}
  if variant == "fresh out":
    f = jax.jit(body)
    call = lambda: f(qs, k, v, tables, lens)
  elif variant == "donated out":
    g = jax.jit(lambda buf, *a: buf.at[:].set(body(*a)), donate_argnums=0)
    st["buf"] = jnp.zeros(jax.eval_shape(body, qs, k, v, tables, lens).shape, jnp.bfloat16)

    def call():
      st["buf"] = g(st["buf"], qs, k, v, tables, lens)
      return st["buf"]
  elif variant == "fresh meta":
    f = jax.jit(body)
    call = lambda: f(qs, k, v, jax.device_put(t_host), jax.device_put(l_host))
  elif variant == "staged meta":
    def staged(tb, lb, t_new, l_new, qs, k, v):
      tb, lb = tb.at[:].set(t_new), lb.at[:].set(l_new)
      return tb, lb, body(qs, k, v, tb, lb)
    g = jax.jit(staged, donate_argnums=(0, 1))
    st["t"], st["l"] = jnp.zeros_like(tables), jnp.zeros_like(lens)

    def call():
      st["t"], st["l"], out = g(st["t"], st["l"], jax.device_put(t_host),
                                jax.device_put(l_host), qs, k, v)
      return out
  else:
    raise ValueError(variant)
  return call, kv_bytes


VARIANTS = ("fresh out", "donated out", "fresh meta", "staged meta")


def seq(L=32768, n=12, execs=6, variants=VARIANTS):
  """Back-to-back executions (each waited for, as the benchmark's reps are), with
  markers on stderr between them, for XLA's command-buffer VLOG lines (run with
  TF_CPP_VMODULE set; scripts/vlog_summary.py counts them per execution)."""
  rng = np.random.default_rng(6)
  for variant in variants:
    call, _ = _variant_call(variant, n, L, rng)
    for e in range(execs):
      print(f"===== {variant} | execution {e} begins", file=sys.stderr, flush=True)
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      dt = (time.perf_counter() - t0) * 1e6
      print(f"===== {variant} | execution {e} ends {dt:.0f} us", file=sys.stderr, flush=True)


def walls(lengths=(4096, 32768), ns=(2, 24), reps=9, variants=VARIANTS):
  """Per-call differential (median walls, n calls) of each variant of _variant_call."""
  rng = np.random.default_rng(7)
  for L in lengths:
    for variant in variants:
      w = {}
      for n in ns:
        call, kv_bytes = _variant_call(variant, n, L, rng)
        for _ in range(3):
          jax.block_until_ready(call())
        ts = []
        for _ in range(reps):
          t0 = time.perf_counter()
          jax.block_until_ready(call())
          ts.append((time.perf_counter() - t0) * 1e6)
        w[n] = statistics.median(ts)
      per = (w[ns[1]] - w[ns[0]]) / (ns[1] - ns[0])
      print(f"1x{L} {variant:12s}: wall n={ns[0]} {w[ns[0]]:.1f} us, n={ns[1]} {w[ns[1]]:.1f}"
            f" us -> {per:.1f} us/call ({kv_bytes / per / 1e6:.2f} TB/s)", flush=True)


def stamps(lengths=(32768, 4096), ns=(2, 6, 12, 24, 48), reps=11, modes=("default", "off")):
  """Wall time against the device time between two %globaltimer stamps that
  bracket the n calls (no profiler; the program ``bench.common.time_rotated`` times
  with ``device=True``): per n, and per call by differential."""
  from jattn.bench import common
  from jattn.bench.decode import _setup
  stamp = common.gpu_stamp()
  rng = np.random.default_rng(8)
  for L in lengths:
    qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, max(ns))
    args = (qs, k, v, tables, lens)
    for mode in modes:
      rows = {}
      for n in ns:
        f = common.rotated_program(_step, n, stamp=stamp, **_options(mode))
        for _ in range(3):
          jax.block_until_ready(f(*args))
        walls, devs = [], []
        for _ in range(reps):
          t0 = time.perf_counter()
          _, st = jax.block_until_ready(f(*args))
          walls.append((time.perf_counter() - t0) * 1e6)
          devs.append(common._span_us(st))
        rows[n] = (statistics.median(walls), statistics.median(devs), min(devs), max(devs))
        print(f"1x{L} {mode:8s} n={n:3d}: wall {rows[n][0]:8.1f} us, device (stamps) "
              f"{rows[n][1]:8.1f} us (min {rows[n][2]:.1f}, max {rows[n][3]:.1f}), "
              f"wall - device {rows[n][0] - rows[n][1]:7.1f}", flush=True)
      for a, b in zip(ns, ns[1:]):
        dw = (rows[b][0] - rows[a][0]) / (b - a)
        dd = max((rows[b][1] - rows[a][1]) / (b - a), 1e-3)
        print(f"   n {a}->{b}: per call wall {dw:6.1f} us ({kv_bytes / dw / 1e6:.2f} TB/s), "
              f"device {dd:6.1f} us ({kv_bytes / dd / 1e6:.2f} TB/s)", flush=True)
    del qs, k, v


def stamphlo(L=32768, n=4):
  """Where the stamps and the calls sit in XLA's optimized program (command-buffer
  computations, custom calls, fusions), plain and stamped, XLA's defaults."""
  from jattn.bench import common
  from jattn.bench.decode import _setup
  rng = np.random.default_rng(9)
  qs, k, v, tables, lens, kv_bytes = _setup(1, L, 16, 1, jnp.bfloat16, rng, n)
  for name, st in (("plain", None), ("stamped", common.gpu_stamp())):
    many = common.rotated_program(_step, n, stamp=st)
    txt = many.lower(qs, k, v, tables, lens).compile().as_text()
    print(f"--- {name}: {n} calls")
    comp = None
    for line in txt.splitlines():
      m = re.match(r"^(ENTRY )?%?([\w.-]+) .*\{$", line.strip()) if line and not line.startswith(" ") else None
      if m:
        comp = m.group(2)
        continue
      if comp and ("command_buffer" in comp or comp.startswith("main")) and (
          "custom-call" in line or " fusion(" in line or " call(" in line
          or "command_buffer" in line):
        op = re.search(r"= \S+ (\w[\w-]*)\(", line)
        tgt = re.search(r'custom_call_target="([^"]+)"', line)
        calls = re.search(r"to_apply=%?([\w.-]+)|calls=%?([\w.-]+)", line)
        print(f"   [{comp[:28]}] {op.group(1) if op else '?'} "
              f"{tgt.group(1) if tgt else ''} {(calls.group(1) or calls.group(2)) if calls else ''}")


if __name__ == "__main__":
  print("jax", jax.__version__, jax.devices())
  print("XLA_FLAGS", os.environ.get("XLA_FLAGS"))
  modes = {"timeline": timelines, "vlog": vlog, "stamphlo": stamphlo, "stamps": stamps,
           "seq": seq, "walls": walls, "donated": donated, "hostbreak": hostbreak,
           "spans": spans, "spans-joined": lambda: spans(modes=("default",), join=True)}
  picked = [m for m in modes if m in sys.argv[1:]]
  (modes[picked[0]] if picked else main)()
