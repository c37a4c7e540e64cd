import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import inspect
_OUT_KW = "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"

def k_notma(reps=0):
  def body(x_ref, o_ref):
    x = x_ref[...] + 1.0
    o_ref[...] = x
    if reps:
      @pl.when(x_ref[0, 0] < -1e30)  # never true here: a larger module, no more device work
      def _():
        y = x
        for _ in range(reps):
          y = y * 1.0001 + 0.5
        o_ref[...] = y
  return plgpu.kernel(body, **{_OUT_KW: jax.ShapeDtypeStruct((128, 128), jnp.float32)}, grid=(1,), grid_names=("x",))

def k_tma(n_in):
  def body(*refs):
    ins, o_ref, smem, bar = refs[:n_in], refs[n_in], refs[n_in+1], refs[n_in+2]
    for i, r in enumerate(ins):
      plgpu.copy_gmem_to_smem(r, smem.at[i], bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    plgpu.copy_smem_to_gmem(smem.at[0], o_ref)
    plgpu.wait_smem_to_gmem(0)
  def entry(*refs):
    pl.run_scoped(lambda s, b: body(*refs, s, b), plgpu.SMEM((n_in, 64, 64), jnp.float32),
                  plgpu.Barrier(num_arrivals=n_in, num_barriers=1))
  return plgpu.kernel(entry, **{_OUT_KW: jax.ShapeDtypeStruct((64, 64), jnp.float32)}, grid=(1,), grid_names=("x",))

def k_shape(grid, smem_kb, wgs):
  """A kernel that does almost nothing, with the decode kernel's launch shape."""
  def entry(x_ref, o_ref):
    def body(big, small):
      del big  # allocated, not used: the launch reserves it
      wg = lax.axis_index("wg")
      g = lax.axis_index("g")

      @pl.when((wg == 0) & (g == 0))
      def _():
        small[...] = x_ref[...] + 1.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(small, o_ref)
        plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(body, plgpu.SMEM((smem_kb * 1024 // 512, 256), jnp.bfloat16),
                  plgpu.SMEM((64, 64), jnp.float32), collective_axes="wg")
  return plgpu.kernel(entry, **{_OUT_KW: jax.ShapeDtypeStruct((64, 64), jnp.float32)},
                      grid=(grid,), grid_names=("g",), num_threads=wgs, thread_name="wg")


if __name__ == "__main__":
  import sys
  x = jnp.ones((128, 128), jnp.float32)
  ys = [jnp.full((64, 64), i, jnp.float32) for i in range(6)]
  if jax.default_backend() != "gpu":
    import re
    for reps in (0, 100, 400):
      txt = jax.jit(k_notma(reps)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
      print("reps", reps, "backend_config chars", max(len(m) for m in re.findall(r'backend_config = [^\n]*', txt)))
    for name, f, a in (("notma", k_notma(), (x,)), ("tma1", k_tma(1), ys[:1]), ("tma5", k_tma(5), ys[:5])):
      try:
        jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",))
        print(name, "lowers")
      except Exception as e:
        print(name, "FAILS", type(e).__name__, str(e)[:300])
    sys.exit()

  sys.path.insert(0, ".")
  from jattn.bench import common
  from diag_launch import dispatch_us
  k0, k1, k5 = k_notma(), k_tma(1), k_tma(5)
  kb1, kb2 = k_notma(100), k_notma(250)
  xs = [x + i for i in range(48)]
  y1 = [ys[0] + i for i in range(48)]
  if "shape" in sys.argv:
    for grid, kb, wgs in ((1, 1, 1), (132, 1, 1), (1, 200, 1), (132, 200, 2), (132, 1, 2)):
      kk = k_shape(grid, kb, wgs)
      t = common.time_rotated(lambda i, *a, kk=kk: kk(a[i]), y1, n_hi=48)
      print(f"grid {grid:3d} smem {kb:3d} KB warpgroups {wgs}: {t.seconds*1e6:6.1f} us/call", flush=True)
    sys.exit()
  y1 = [ys[0] + i for i in range(48)]
  for name, f, step, args in (
      ("no TMA", k_notma(), lambda i, *a: k0(a[i]), xs),
      ("no TMA, 100 extra ops never run", None, lambda i, *a: kb1(a[i]), xs),
      ("no TMA, 250 extra ops never run", None, lambda i, *a: kb2(a[i]), xs),
      ("1 TMA load + 1 TMA store", None, lambda i, *a: k1(a[i]), y1),
      ("5 TMA loads + 1 TMA store", None, lambda i, *a: k5(a[i], *a[48:52]), y1 + ys[1:5])):
    for graph in (False, True):
      t = common.time_rotated(step, args, n_hi=48, graph=graph)
      if not graph:
        print(f"{name:30s} host dispatch of one call: {dispatch_us(step, args):.1f} us")
      print(f"{name:30s} graph={graph}: {t.seconds*1e6:6.1f} us/call", flush=True)
