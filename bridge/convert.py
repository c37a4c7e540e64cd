"""Checked, zero-copy conversions between torch tensors and JAX arrays (DLPack).

Both directions share memory; neither ever copies silently. A tensor that cannot
be shared (strided view, misaligned offset, unsupported dtype, a device JAX does
not drive) raises :class:`BridgeError` naming the reason, unless the caller
passed ``copy=True``: then an explicit copy is made, and only then.

Facts these checks encode (measured, docs/PERF.md):

* JAX refuses non-compact (strided) DLPack tensors; a view with a storage offset
  is fine if its pointer is aligned. JAX's CPU client needs 64-byte alignment,
  the GPU client 16 bytes (a misaligned GPU view fails only at execution).
* ``jax.dlpack.from_dlpack(t)`` makes JAX's stream wait for torch's pending work;
  ``torch.from_dlpack(a)`` makes torch's current stream wait for ``a``. Views kept
  and reused across calls get no such ordering: see :mod:`jattn.bridge.streams`.
* Each conversion costs more host time than a jitted call, so the hot path
  (``TorchMHABackend`` / ``TorchMLABackend``) converts persistent buffers once.

Example:
  >>> import torch
  >>> t = torch.arange(8, dtype=torch.float32)
  >>> a = to_jax(t)
  >>> int(a.unsafe_buffer_pointer()) == t.data_ptr()
  True
  >>> to_torch(a).data_ptr() == t.data_ptr()
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

__all__ = ["BridgeError", "SUPPORTED_DTYPES", "to_jax", "to_torch", "alignment", "check_shareable"]


class BridgeError(ValueError):
    """Bad input to the torch bridge: a tensor that cannot be shared zero-copy between
    torch and JAX, or an input, pool, layer or plan the bridge's backends refuse (the
    message names the argument and the rule it broke)."""


#: torch dtype -> JAX dtype of everything the bridge shares.
SUPPORTED_DTYPES = {
    torch.bfloat16: jnp.bfloat16,
    torch.float16: jnp.float16,
    torch.float32: jnp.float32,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.int32: jnp.int32,
}
_JAX_TO_TORCH = {jnp.dtype(v): k for k, v in SUPPORTED_DTYPES.items()}


def alignment(platform: str | None = None) -> int:
    """Byte alignment a shared buffer's pointer needs on ``platform`` (JAX's default)."""
    platform = platform or jax.default_backend()
    return 64 if platform == "cpu" else 16


def _platform_of(t: torch.Tensor) -> str:
    if t.device.type == "cpu":
        return "cpu"
    if t.device.type == "cuda":
        return "gpu"
    return t.device.type


_COPY_HINT = "pass copy=True for an explicit copy"


def _check_dense(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise BridgeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise BridgeError(f"{name} has layout {t.layout}: the bridge takes dense (torch.strided) tensors only")


def check_shareable(t: torch.Tensor, name: str = "tensor", hint: str = _COPY_HINT) -> None:
    """Raises :class:`BridgeError` if ``t`` cannot be shared zero-copy with JAX; ``hint``
    ends the messages about layout and alignment (what the caller can do instead)."""
    _check_dense(t, name)
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise BridgeError(f"{name}.dtype={t.dtype} cannot be shared: supported dtypes are {names}")
    plat = _platform_of(t)
    backend = jax.default_backend()
    if plat not in ("cpu", "gpu"):
        raise BridgeError(f"{name} is on device {t.device}; the bridge shares CPU and CUDA tensors only")
    if plat != backend and not (plat == "cpu" and backend == "cpu"):
        raise BridgeError(
            f"{name} is on {t.device} but JAX's default backend is {backend!r}: a zero-copy view "
            "needs both on the same device"
        )
    if t.is_neg() or t.is_conj():
        raise BridgeError(
            f"{name} is a lazily negated or conjugated view (torch's neg/conj bit): its memory holds the "
            f"other sign; call .resolve_neg() / .resolve_conj() first ({hint})"
        )
    if not t.is_contiguous():
        raise BridgeError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} is not contiguous: JAX "
            f"shares only compact row-major buffers ({hint})"
        )
    align = alignment(plat)
    if t.numel() and t.data_ptr() % align:
        raise BridgeError(
            f"{name}'s data pointer {t.data_ptr():#x} is not {align}-byte aligned (storage offset "
            f"{t.storage_offset()} elements): JAX cannot view it ({hint})"
        )


def to_jax_input(t: torch.Tensor, name: str) -> jax.Array:
    """A per-call input ``t`` (argument ``name``) as a JAX array: viewed where it can be
    (contiguous and aligned), else copied first (a strided or offset view of a larger
    tensor), so such inputs are read correctly rather than refused. Not for KV pools."""
    _check_dense(t, name)
    t = t.detach().resolve_neg().resolve_conj().contiguous()
    if t.numel() and t.data_ptr() % alignment(_platform_of(t)):
        t = t.clone()
    return to_jax(t, name=name)


def to_jax(t: torch.Tensor, *, copy: bool = False, name: str = "tensor") -> jax.Array:
    """A JAX array viewing the memory of torch tensor ``t`` (no copy).

    Args:
      t: contiguous CPU or CUDA tensor of dtype bf16, fp16, f32, float8_e4m3fn or
        int32 whose data pointer is aligned (16 bytes on GPU, 64 on CPU).
      copy: ``True`` makes an explicit copy first (``t.contiguous().clone()``), so
        strided or misaligned tensors can be converted; the result then shares
        nothing with ``t``. Never use it on a KV pool.
      name: what the errors call ``t`` (the argument it came from).

    Returns:
      jax.Array on the device of ``t``. Writes by torch to ``t`` are visible to
      JAX (with the stream ordering of the import, see the module docstring).

    Raises:
      BridgeError: the tensor cannot be shared (the message says why).
    """
    if copy:
        if not isinstance(t, torch.Tensor):
            raise BridgeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        t = t.detach().resolve_neg().resolve_conj().contiguous().clone()
    check_shareable(t, name)
    try:
        return jax.dlpack.from_dlpack(t.detach(), copy=False)
    except (ValueError, RuntimeError) as e:  # JAX's own refusal (e.g. an alignment it needs)
        raise BridgeError(f"JAX refused a zero-copy view of {name}: {e}") from e


def to_torch(a: jax.Array, *, copy: bool = False) -> torch.Tensor:
    """A torch tensor viewing the memory of JAX array ``a`` (no copy).

    Torch's current stream is ordered after the computation that produced ``a``.
    While the returned tensor is alive, ``a``'s buffer cannot be donated to a
    jitted call (JAX refuses or copies): keep JAX the writer of any buffer that
    torch also holds by importing torch's tensor instead (:func:`to_jax`).

    Args:
      a: a single-device jax.Array of a supported dtype.
      copy: ``True`` returns an independent torch copy.
    """
    if not isinstance(a, jax.Array):
        raise BridgeError(f"array must be a jax.Array, got {type(a).__name__}")
    if jnp.dtype(a.dtype) not in _JAX_TO_TORCH:
        raise BridgeError(f"array dtype={a.dtype} cannot be shared with torch")
    if len(a.devices()) != 1:
        raise BridgeError(f"array is sharded over {len(a.devices())} devices; only single-device arrays convert")
    t = torch.from_dlpack(a)
    return t.clone() if copy else t


def torch_dtype(jax_dtype) -> torch.dtype:
    """The torch dtype of a JAX dtype the bridge supports."""
    try:
        return _JAX_TO_TORCH[jnp.dtype(jax_dtype)]
    except KeyError:
        raise BridgeError(f"dtype {jax_dtype} is not supported by the bridge") from None
