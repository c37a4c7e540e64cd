"""The one place that launches Triton-language kernels: from JAX through
jax-triton, or on torch tensors under Triton's interpreter (CPU tests).

Kernel sources are plain Python functions written against ``triton.language``
(not decorated), so a kernel module imports without Triton installed: :func:`jit`
applies ``triton.jit`` when a kernel is first launched. The same source runs on
torch CPU tensors under Triton's interpreter (:func:`launch_interpreted`, in a
process started with :func:`interpreter_env`).

jax-triton imports only with a GPU build of jaxlib, so it is imported lazily
(:func:`jax_triton`), and :func:`available` says whether :func:`triton_call` can
run here. Callers fall back to XLA ops where it cannot.

Example::

    from jattn.pallas_kernels import triton_glue
    if triton_glue.available():
      out = triton_glue.triton_call(add_kernel, x, y, out_shape=x, grid=(n // 128,),
                                    BLOCK=128)
    # CPU test of the same source on torch tensors (TRITON_INTERPRET=1 process):
    triton_glue.launch_interpreted(add_kernel, (n // 128,), x_t, y_t, out_t, BLOCK=128)
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

__all__ = [
    "jax_triton",
    "available",
    "capability",
    "dot_precision",
    "jit",
    "triton_call",
    "interpreter_env",
    "launch_interpreted",
]


def dot_precision(dtype) -> str:
    """The ``input_precision`` of a kernel's ``tl.dot`` products for operands of ``dtype``
    (a JAX, numpy or torch dtype): ``"ieee"`` (full f32 products) for f32, where Triton's
    default on sm80+ would be TF32, whose 10-bit mantissa breaks the f32 contract of
    docs/SEMANTICS.md; ``"tf32"`` (the default, which 16-bit and FP8 operands ignore)
    otherwise."""
    import numpy as np  # noqa: PLC0415

    name = str(dtype) if str(dtype).startswith("torch.") else "torch." + np.dtype(dtype).name
    return "ieee" if name == "torch.float32" else "tf32"


@functools.lru_cache(maxsize=None)
def jax_triton():
    """The ``jax_triton`` module, or None where it does not import (not installed,
    or a jaxlib without GPU support)."""
    try:
        import jax_triton as jt  # noqa: PLC0415 - needs a GPU jaxlib
    except Exception:  # noqa: BLE001 - ImportError, or its own GPU check failing
        return None
    return jt


def available() -> bool:
    """True when Triton kernels can be launched from JAX here: a CUDA GPU is JAX's
    default backend and jax-triton (with Triton) imports."""
    from jattn.pallas_kernels.interpret import on_gpu

    return on_gpu() and jax_triton() is not None


def capability() -> int:
    """Compute capability of JAX's first device as ``10 * major + minor`` (90 for
    sm_90); 80 where it is no CUDA GPU (the interpreter, whose launches ignore it)."""
    import jax  # noqa: PLC0415

    cc = getattr(jax.devices()[0], "compute_capability", None)
    if not cc:
        return 80
    major, _, minor = str(cc).partition(".")
    return 10 * int(major) + int(minor or 0)


def fp8_reason(*dtypes) -> str | None:
    """Why operands of ``dtypes`` cannot be loaded here: Triton's FP8 e4m3 type needs
    compute capability 8.9 or newer (Ada, Hopper); None where they can, or where no GPU
    compiles them (the interpreter)."""
    import jax.numpy as jnp  # noqa: PLC0415

    from jattn.pallas_kernels.interpret import on_gpu  # noqa: PLC0415

    if not any(jnp.dtype(d) == jnp.float8_e4m3fn for d in dtypes) or not on_gpu():
        return None
    cc = capability()
    if cc >= 89:
        return None
    return f"FP8 e4m3 needs compute capability 8.9 or newer in Triton (this GPU: {cc // 10}.{cc % 10})"


@functools.lru_cache(maxsize=None)
def jit(fn: Callable):
    """``triton.jit(fn)`` for kernel source ``fn`` (a plain function written against
    ``triton.language``), compiled once per function. Under ``TRITON_INTERPRET=1``
    (set before Triton is first imported) this is Triton's CPU interpreter."""
    import triton  # noqa: PLC0415

    _ensure_cache_dir(triton)
    return triton.jit(fn)


def device_fn(fn: Callable):
    """``fn``, a function that kernel sources call (shared arithmetic of two kernels), as a
    Triton JIT function where Triton is installed, else ``fn`` as it is. Applied at import:
    a process that interprets sets ``TRITON_INTERPRET=1`` before Triton is first imported,
    as for the kernels themselves."""
    try:
        import triton  # noqa: PLC0415
    except ImportError:  # pragma: no cover - Triton not installed: no kernel calls it
        return fn
    return triton.jit(fn)


def _ensure_cache_dir(triton) -> None:
    """Give Triton a cache directory when ``TRITON_CACHE_DIR`` is set but empty (seen on
    GPU machines): without one, its first native launch fails building the launcher
    ("Could not create or locate cache dir"). The fallback lies in the temp directory."""
    if not triton.knobs.cache.dir:
        import tempfile  # noqa: PLC0415

        triton.knobs.cache.dir = os.path.join(tempfile.gettempdir(), "jattn-triton-cache")


def triton_call(
    fn: Callable, *args, out_shape, grid, name: str, num_warps: int = 4, num_stages: int = 1, **constexprs: Any
):
    """Launch kernel source ``fn`` from JAX (jax-triton's ``triton_call``).

    ``args`` are the input arrays (then Python scalars, if any), followed in the
    kernel's signature by one pointer per entry of ``out_shape``; ``constexprs`` are
    the kernel's ``tl.constexpr`` parameters. Raises ``RuntimeError`` where
    :func:`available` is False."""
    jt = jax_triton()
    if jt is None:
        raise RuntimeError("jax-triton is not available (it needs a GPU build of jaxlib)")
    return jt.triton_call(
        *args,
        kernel=jit(fn),
        out_shape=out_shape,
        grid=grid,
        name=name,
        num_warps=num_warps,
        num_stages=num_stages,
        **constexprs,
    )


def interpreter_env() -> dict[str, str]:
    """Environment for a process that runs Triton kernels under the interpreter.

    Triton decides at import time whether its own library functions (``tl.max``,
    ``tl.sum``, ...) are interpreted, so ``TRITON_INTERPRET=1`` must be set before
    Triton is first imported: interpreted runs happen in a fresh process."""
    return dict(os.environ, TRITON_INTERPRET="1")


def launch_interpreted(fn: Callable, grid, *args, **constexprs: Any) -> None:
    """Run kernel source ``fn`` under Triton's interpreter on torch CPU tensors
    (outputs are written in place), as CPU tests do. Needs a process started with
    :func:`interpreter_env`."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "launch_interpreted needs TRITON_INTERPRET=1 set before triton is "
            "imported: run it in a process started with interpreter_env()"
        )
    jit(fn)[grid](*args, **constexprs)
