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

import collections
import contextlib
import os
import threading
import warnings
from typing import Iterator

import jax

__all__ = ["gpu_interpret", "on_gpu", "interpreter_available", "interpreting", "widen_cpu_pool"]

# Threads XLA:CPU's client pool needs for interpreted kernels: a kernel's warpgroups (up to
# three) may each hold one blocked in a barrier wait while the one they wait for still needs
# a thread to start; the rest is headroom for the TMA threads and nested callbacks.
INTERPRETER_CPU_THREADS = 16


def widen_cpu_pool() -> None:
    """Size XLA:CPU's client thread pool for the Mosaic GPU interpreter.

    The interpreter runs each warpgroup's program as an XLA:CPU execution whose barrier
    waits block inside host callbacks, and XLA:CPU runs such executions on a client pool
    with one thread per core by default. On a machine with few cores the blocked
    warpgroups can hold every pool thread, so the warpgroup they wait for never starts
    and the kernel hangs. This sets ``PJRT_NPROC`` (the pool's size, read once when JAX
    creates its CPU client) to at least :data:`INTERPRETER_CPU_THREADS` unless it is set
    already. Call it before JAX's first computation; tests/conftest.py does.
    """
    os.environ.setdefault("PJRT_NPROC", str(max(INTERPRETER_CPU_THREADS, os.cpu_count() or 1)))


def _warn_if_pool_small() -> None:
    try:
        threads = int(os.environ.get("PJRT_NPROC", ""))
    except ValueError:
        threads = os.cpu_count() or 1
    if threads < INTERPRETER_CPU_THREADS // 2 and not _warned:
        _warned.append(True)
        warnings.warn(
            f"XLA:CPU's client pool has {threads} threads; interpreted Mosaic GPU kernels can "
            "deadlock with fewer than a kernel's warpgroups plus one. Call "
            "jattn.pallas_kernels.interpret.widen_cpu_pool() (or set PJRT_NPROC=16) before JAX starts.",
            RuntimeWarning,
            stacklevel=3,
        )


_warned: list = []


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


_COMPILED_MAX = 64  # warpgroup programs kept compiled (a kernel call has one)
_compiled: collections.OrderedDict = collections.OrderedDict()
_compiled_lock = threading.Lock()


def _eval_jaxpr(jaxpr, consts, *args):
    jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_jaxpr_compiled_once(jaxpr, consts, *args):
    """The interpreter's per-thread runner, compiling each warpgroup program once.

    The interpreter runs a kernel's grid points one after another, and for each point
    starts one host thread per warpgroup that lowers and compiles the kernel body's
    jaxpr with XLA before running it (AOT compilation, which bypasses jit's cache). The
    jaxpr is the same object for every point and thread of a call, so the compile
    dominated the interpreted run: (grid points x warpgroups) XLA compiles of the same
    program. Here the executable is kept, keyed by the jaxpr (held, so its identity
    stays unique) and the argument types; running it is unchanged."""
    leaves = jax.tree.leaves((consts, args))
    key = (id(jaxpr), tuple((jax.numpy.shape(x), jax.numpy.result_type(x)) for x in leaves))
    with _compiled_lock:
        hit = _compiled.get(key)
        if hit is not None:
            _compiled.move_to_end(key)
    if hit is None:
        exe = jax.jit(_eval_jaxpr, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
        with _compiled_lock:
            hit = _compiled.setdefault(key, (jaxpr, exe))
            while len(_compiled) > _COMPILED_MAX:
                _compiled.popitem(last=False)
    hit[1](consts, *args)


def _install_compile_cache() -> None:
    """Route the interpreter's thread runner through :func:`_run_jaxpr_compiled_once`
    where this JAX has the runner it replaces (same signature); else leave it."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map as _tm  # private
    except ImportError:
        return
    if getattr(_tm, "_run_jaxpr", None) not in (None, _run_jaxpr_compiled_once):
        _tm._run_jaxpr = _run_jaxpr_compiled_once


@contextlib.contextmanager
def gpu_interpret(**params) -> Iterator[None]:
    """Run every ``plgpu.kernel`` traced inside this context under the interpreter.

    Keyword arguments go to ``InterpretGPUParams`` (e.g. ``num_tma_threads_per_device``).
    Arrays must be traced inside the context: a function already jitted and cached
    outside it keeps its compiled (GPU) form. Each warpgroup program is compiled once
    per kernel call rather than once per grid point and warpgroup
    (:func:`_run_jaxpr_compiled_once`).
    """
    params_cls, force = _private_api()
    _warn_if_pool_small()
    _install_compile_cache()
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


def no_gpu_reason() -> str | None:
    """Why a Mosaic GPU kernel cannot run here (no GPU, and not inside
    :func:`gpu_interpret`), else None."""
    import jax

    if jax.default_backend() != "gpu" and not interpreting():
        return (
            "no GPU (the mosaic backend needs an sm90 GPU, or the Mosaic GPU interpreter on the CPU: "
            "call jattn.pallas_kernels.interpret.widen_cpu_pool() before JAX's first computation, then trace the "
            "call inside `with jattn.pallas_kernels.interpret.gpu_interpret():`; slow, small shapes only)"
        )
    return None
