"""The one place that touches Pallas' private Mosaic GPU interpreter API.

Mosaic GPU kernels (``plgpu.kernel``) can run on the CPU under the Mosaic GPU
interpreter, which simulates shared memory, TMA copies, barriers and warpgroups.
It is a private JAX API that moves between releases, so every test and helper in
jattn goes through :func:`gpu_interpret` instead of importing it directly.

Example::

    from jattn.pallas_kernels.interpret import gpu_interpret, on_gpu
    if not on_gpu():
        with gpu_interpret():
            out = mosaic_decode.mha_decode(q, k_cache, v_cache, page_table, lens)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

__all__ = ["gpu_interpret", "on_gpu", "interpreter_available", "interpreting"]


def on_gpu() -> bool:
    """True when JAX's default backend is a CUDA GPU."""
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def _private_api():
    from jax._src.pallas.mosaic_gpu.interpret import params as _params  # private

    return _params.InterpretGPUParams, _params.force_gpu_interpret_mode


def interpreter_available() -> bool:
    """True when this JAX build ships the Mosaic GPU interpreter."""
    try:
        _private_api()
    except (ImportError, AttributeError):
        return False
    return True


@contextlib.contextmanager
def gpu_interpret(**params) -> Iterator[None]:
    """Run every ``plgpu.kernel`` traced inside this context under the interpreter.

    Keyword arguments go to ``InterpretGPUParams`` (e.g. ``num_tma_threads_per_device``).
    Arrays must be traced inside the context: a function already jitted and cached
    outside it keeps its compiled (GPU) form.
    """
    params_cls, force = _private_api()
    try:
        with force(params_cls(**params)):
            yield
    except Exception:
        # After an exception inside an interpreted kernel the interpreter's global
        # state must be reset before it can run again in the same process.
        try:
            from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _ipc

            reset = getattr(_ipc, "reset_gpu_interpret_mode_state", None)
            if reset is not None:
                reset()
        except ImportError:
            pass
        raise


def interpreting() -> bool:
    """True inside :func:`gpu_interpret` (kernels traced now will be interpreted)."""
    try:
        from jax._src import config as _config  # private, like the interpreter itself

        params_cls, _ = _private_api()
        return isinstance(_config.pallas_tpu_interpret_mode_context_manager.value, params_cls)
    except (ImportError, AttributeError):
        return False
