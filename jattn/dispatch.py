"""Which implementation runs an op: the device kind, auto's measured kernel order, and the
pick among the ``mosaic`` / ``triton`` kernels and ``xla`` (the rules in the docstring of
:mod:`jattn.ops`, which dispatches through here)."""

from __future__ import annotations

import functools
import importlib

import jax

from jattn.checks import _check_backend


@functools.lru_cache(maxsize=None)
def device_kind() -> str:
    """'hopper' (sm90+), 'ampere' (sm80+), 'gpu' (older), or 'cpu'."""
    if jax.default_backend() != "gpu":
        return "cpu"
    cc = getattr(jax.devices()[0], "compute_capability", "0.0")
    major = int(str(cc).split(".")[0])
    return "hopper" if major >= 9 else "ampere" if major >= 8 else "gpu"


def _kernel_module(name: str):
    try:
        return importlib.import_module(f"jattn.pallas_kernels.{name}")
    except ImportError:
        return None


# Auto's kernel order per device kind and op: the first that runs here and serves the
# call wins, else XLA. Hopper's order is measured (``python -m jattn bench decode /
# prefill / mla`` on the H200, docs/PERF.md): the Mosaic kernels lead the Triton ones
# for MHA decode (by 0-40%, except within 6% at 64 x 4096), prefill/extend (2x) and MLA
# decode (1.1-2.2x; with an FP8 latent cache 1.1-4.6x). Other
# GPUs from Ampere on have the Triton kernels only. Ops missing here stay on XLA under auto:
# the state merge (XLA measured as fast or faster) and the KV writes (XLA's one in-place
# scatter; the Triton writes serve backend="triton" and the torch bridge: the MHA one timed
# faster alone, kept off auto until a serving run shows the step gains, docs/PERF.md).
AUTO_ORDER = {
    "hopper": {
        "mha_decode": ("mosaic", "triton"),
        "mha_extend": ("mosaic", "triton"),
        "mha_prefill": ("mosaic", "triton"),
        "mla_decode": ("mosaic", "triton"),
    },
    "ampere": {op: ("triton",) for op in ("mha_decode", "mha_extend", "mha_prefill", "mla_decode")},
}


def _pick(op: str, backend, kernel_module: str | None, reason_fn, *args, **kwargs):
    """Returns the implementation of ``op`` for ``backend`` (None = auto, in the order of
    :data:`AUTO_ORDER`), or None for XLA's."""
    _check_backend(backend)
    if backend == "xla":
        return None
    order = (backend,) if backend is not None else AUTO_ORDER.get(device_kind(), {}).get(op, ())
    for name in order:
        if name == "mosaic":
            impl = _pick_mosaic(op, backend, kernel_module, reason_fn, *args, **kwargs)
        else:
            module = KERNELS["triton"].get(op)
            impl = None if module is None else _pick_triton(op, backend, module, *args, **kwargs)
        if impl is not None:
            return impl
    if backend is not None:
        raise NotImplementedError(f"{op}: no {backend} kernel is built for this op yet")
    return None


def _pick_mosaic(op: str, backend, kernel_module: str | None, reason_fn, *args, **kwargs):
    """The Mosaic GPU kernel of ``op`` where it runs (Hopper; the CPU's interpreter when
    asked for by name) and serves the call."""
    if kernel_module is None:
        return None
    mod = _kernel_module(kernel_module)
    if backend == "mosaic":
        if mod is None:
            raise NotImplementedError(f"{op}: the mosaic backend is not available in this build")
        if device_kind() not in ("hopper", "cpu"):
            raise NotImplementedError(f"{op}: the mosaic backend needs a Hopper (sm90+) GPU")
    if mod is None or (backend is None and device_kind() != "hopper"):
        return None
    reason = reason_fn(mod, *args, **kwargs)
    if reason is None:
        return getattr(mod, op)
    if backend == "mosaic":
        raise NotImplementedError(f"{op}: the mosaic backend cannot serve this call: {reason}")
    return None


def _pick_triton(op: str, backend, module: str, *args, **kwargs):
    """The Triton kernel of ``op`` where it runs (a CUDA GPU with jax-triton) and serves the call."""
    from jattn.pallas_kernels import triton_glue

    mod = _kernel_module(module)
    if mod is None or not triton_glue.available():
        if backend == "triton":
            raise NotImplementedError(f"{op}: the triton backend needs a CUDA GPU with jax-triton installed")
        return None
    reason = mod.unsupported_reason(*args, **kwargs) if args else None  # no call: op_backend
    if reason is None:
        return getattr(mod, op)
    if backend == "triton":
        raise NotImplementedError(f"{op}: the triton backend cannot serve this call: {reason}")
    return None


# kernel backend -> {op: kernel module}; an op missing here has no kernel in that backend yet
KERNELS = {
    "mosaic": {
        "mha_decode": "mosaic_decode",
        "mha_extend": "mosaic_prefill",
        "mha_prefill": "mosaic_prefill",
        "mla_decode": "mosaic_mla",
    },
    "triton": {
        "mha_decode": "triton_decode",
        "mha_prefill": "triton_prefill",
        "mha_extend": "triton_prefill",
        "mla_decode": "triton_mla",
        "attn_merge_state": "merge_state",  # dispatched by _merge_impl
        "set_kv_buffer": "triton_kv_write",
        "set_mla_kv_buffer": "triton_mla_kv_write",
    },
}
OPS = (
    "mha_decode",
    "mha_extend",
    "mha_prefill",
    "mla_decode",
    "attn_merge_state",
    "set_kv_buffer",
    "set_mla_kv_buffer",
)


MHA_OPS = ("mha_decode", "mha_extend", "mha_prefill")  # what an MHA serving loop calls
MLA_OPS = ("mla_decode", "mha_prefill")  # what an MLA serving loop calls


def op_backend(op: str, backend: str | None = None) -> tuple[str, str | None]:
    """The backend that runs ``op`` (one of :data:`OPS`) on this device: ``(name, reason)``.

    ``backend`` is the one asked for (None = auto). The answer holds for a call within the
    kernel's limits (shapes, dtypes, options); auto sends a call outside them to ``xla``.
    ``reason`` says why a backend asked for by name cannot serve ``op`` here (the op would
    raise ``NotImplementedError`` with it), else None.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} must be one of {OPS}")
    if op == "attn_merge_state":
        try:
            return ("triton" if _merge_impl(backend) is not None else "xla"), None
        except NotImplementedError as e:
            return "xla", str(e)
    try:
        impl = _pick(op, backend, KERNELS["mosaic"].get(op), _mosaic_runs_here)
    except NotImplementedError as e:
        return "xla", str(e)
    if impl is None:
        return "xla", None
    module = impl.__module__.rsplit(".", 1)[-1]
    return next(b for b in KERNELS if module in KERNELS[b].values()), None


def _mosaic_runs_here(mod, *args, **kwargs) -> str | None:
    """:func:`op_backend`'s reason function (no call to check): on the CPU, why no Mosaic
    kernel runs here (outside the interpreter), else None."""
    from jattn.pallas_kernels.interpret import no_gpu_reason

    return no_gpu_reason() if device_kind() == "cpu" else None


def _merge_impl(backend):
    """The Triton merge (``pallas_kernels.merge_state``) for ``backend="triton"``, else None
    (auto picks XLA's fusion: measured faster)."""
    _check_backend(backend)
    if backend in (None, "xla"):
        return None
    if backend == "mosaic":
        raise NotImplementedError("attn_merge_state: no mosaic kernel (the fused merge is a Triton kernel)")
    mod = _kernel_module("merge_state")
    if mod is not None and mod.kernel_runs_here():
        return mod.merge_state
    raise NotImplementedError("attn_merge_state: the triton kernel needs a CUDA GPU with jax-triton installed")
