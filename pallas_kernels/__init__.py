"""jattn's kernels (import name ``jattn.pallas_kernels``).

One module per kernel family (kernel body, launch wrapper, jitted entry), its
static configuration apart, and the shared pieces in one place each:

* ``mosaic_decode``: paged MHA/GQA decode on Mosaic GPU (Hopper);
  ``decode_tuning``: its block sizes, kernel options, choosers and capability checks.
* ``combine``: the split-KV merge (a Triton kernel through jax-triton, or XLA ops).
* ``mosaic_common``: Mosaic GPU helpers shared by kernels (``plgpu.kernel`` across
  JAX releases, shared-memory swizzles, layout hints the interpreter skips).
* ``triton_glue``: launching Triton-language kernels from JAX (jax-triton, imported
  lazily) or under Triton's CPU interpreter on torch tensors.
* ``interpret``: the Mosaic GPU interpreter (CPU tests of Mosaic kernels).

Nothing here imports a kernel module at package import: ``jattn.ops`` loads them
on first dispatch.
"""
