"""Stream ordering between torch and JAX for views that are imported once.

A DLPack conversion orders the two libraries' streams, but the bridge's hot path
converts nothing per call (persistent views, see :mod:`jattn.bridge.convert`), so
it orders them itself with two fences per call:

* **torch -> JAX** (:meth:`StreamSync.before_jax`): a 64-byte persistent torch
  tensor is re-imported through the DLPack stream protocol and passed to the
  jitted call. The import makes JAX's external-ready stream wait for torch's
  current stream and gives the imported buffer a definition event there; XLA waits
  for every argument's definition event before it launches the computation, so
  the call sees every torch write enqueued before it (staging copies, torch-side
  KV writes). No data moves.
* **JAX -> torch** (:meth:`StreamSync.after_jax`): ``out.__dlpack__(stream=torch's
  stream)`` makes torch's current stream wait for the call's completion event (the
  capsule is dropped at once). Torch work enqueued afterwards (the engine reading
  ``out``, the next staging copy, a torch read of the KV pool) sees the call's
  writes, and cannot overwrite what the call still reads.

``mode="host"`` instead blocks the host (``synchronize`` / ``block_until_ready``):
simple and safe, but it serialises host and GPU. On the CPU both fences reduce to
waiting for the JAX result (torch CPU ops are synchronous).
"""

from __future__ import annotations

import jax
import torch

__all__ = ["StreamSync"]


class StreamSync:
    """Per-call fences between torch's current stream and JAX (see module docstring).

    Args:
      mode: ``"event"`` (GPU default: device-side waits, host never blocks),
        ``"host"`` (host synchronisation) or ``"none"`` (caller orders the streams;
        unsafe unless torch and JAX work never overlap).
    """

    def __init__(self, mode: str = "event", device: torch.device | None = None):
        if mode not in ("event", "host", "none"):
            raise ValueError(f"sync mode={mode!r} must be 'event', 'host' or 'none'")
        self.platform = jax.default_backend()
        self.mode = mode
        self._jdev = jax.devices()[0]
        if self.platform == "gpu":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
            self._fence_t = torch.zeros(16, dtype=torch.int32, device=self.device)
            try:
                self._ext_stream = self._jdev.get_stream_for_external_ready_events()
            except Exception:  # noqa: BLE001 - a client without the stream extension
                self._ext_stream = None
            self._import = self._make_importer()
        else:
            self.device = torch.device("cpu")
            self._fence_t = torch.zeros(16, dtype=torch.int32)
        self._fence_j = jax.dlpack.from_dlpack(self._fence_t, copy=False)

    def _make_importer(self):
        """The cheapest import that still runs the DLPack stream protocol."""
        try:
            from jax._src.lib import _jax, jaxlib_extension_version

            dev, stream = self._jdev, self._ext_stream
            if stream is None:
                raise ImportError
            fence = self._fence_t
            dl_type = int(fence.__dlpack_device__()[0])
            # torch's __dlpack__(stream=s) makes s wait for torch's current stream by
            # building an ExternalStream and an Event in Python on every call; do the
            # same two CUDA calls (record on the current stream, wait on s) with a
            # cached Event and ExternalStream, then export with stream=-1 (no sync).
            ev = torch.cuda.Event()
            ext = torch.cuda.ExternalStream(stream, device=self.device)
            tail = (dl_type,) if jaxlib_extension_version >= 467 else ()

            def imp():
                ev.record()  # torch's current stream
                ext.wait_event(ev)
                return _jax.dlpack_managed_tensor_to_buffer(fence.__dlpack__(stream=-1), dev, stream, False, *tail)
            imp()  # probe once; fall back to the public API on any failure
            return imp
        except Exception:  # noqa: BLE001
            fence = self._fence_t
            return lambda: jax.dlpack.from_dlpack(fence, copy=False)

    def before_jax(self) -> jax.Array:
        """Call right before dispatching the jitted call; pass the result to it.

        Per call, not per step: every layer's inputs are made by torch work enqueued
        after the previous layer's call (projections, the staging copy), so a fence
        taken once per step would let JAX read stale staging."""
        if self.platform != "gpu" or self.mode == "none":
            return self._fence_j
        if self.mode == "host":
            torch.cuda.current_stream(self.device).synchronize()
            return self._fence_j
        return self._import()

    def after_jax(self, out: jax.Array) -> None:
        """Call right after dispatching the call that produced ``out``."""
        if self.platform != "gpu":
            out.block_until_ready()
            return
        if self.mode == "none":
            return
        if self.mode == "host":
            out.block_until_ready()
            return
        ptr = torch.cuda.current_stream(self.device).cuda_stream
        out.__dlpack__(stream=ptr if ptr else 1)  # 1: the legacy default stream
