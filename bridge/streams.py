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

``mode="stream"`` orders the two libraries on XLA's own compute stream instead,
with no JAX call at all: that stream's handle is read once from inside a jitted
``buffer_callback`` (:func:`xla_compute_stream`); per call, torch records an event
on its stream and makes XLA's stream wait on it (before), then records an event
on XLA's stream and makes its own stream wait on that (after). Two CUDA calls
each way. The "after" event is correct only if the jitted call's kernels are on
XLA's stream when the Python call returns (a synchronous launch, as the GPU
client does; checked by the stream-race GPU tests).

When torch's current stream *is* XLA's stream (an engine that runs its model under
``with torch.cuda.stream(backend.stream):``), ``mode="stream"`` makes no fence at
all: one stream orders everything (the two cross-stream waits per call cost more
host time than the rest of the bridge, docs/PERF.md).

``mode="host"`` instead blocks the host (``synchronize`` / ``block_until_ready``):
simple and safe, but it serialises host and GPU. On the CPU both fences reduce to
waiting for the JAX result (torch CPU ops are synchronous).
"""

from __future__ import annotations

import functools
import warnings

import jax
import torch

__all__ = ["StreamSync", "xla_compute_stream"]


@functools.lru_cache(maxsize=None)
def xla_compute_stream(device) -> int | None:
    """The CUDA stream XLA runs computations on for ``device`` (a pointer), read
    from inside a jitted ``buffer_callback``; None where that API is missing or two
    executions report different streams. Read once per device."""
    if device.platform not in ("gpu", "cuda"):
        return None
    try:
        import jax.numpy as jnp
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError:
        return None
    seen = []

    def record(ctx, out, x):
        del out, x
        seen.append(int(ctx.stream))

    try:
        f = jax.jit(buffer_callback(record, jax.ShapeDtypeStruct((1,), jnp.int32), has_side_effect=True))
        for v in (0, 1):
            jax.block_until_ready(f(jax.device_put(jnp.full((1,), v, jnp.int32), device)))
    except Exception:  # noqa: BLE001 - no FFI stream here: no stream fences
        return None
    return seen[0] if len(seen) == 2 and seen[0] == seen[1] and seen[0] else None


@functools.lru_cache(maxsize=None)
def _launch_is_synchronous(device, stream_ptr: int, torch_device=None) -> bool:
    """True if a jitted call's work is on XLA's stream when the call returns. Once per
    device: right after a ~20 ms call returns, an event recorded on that stream must
    still be pending (the work is ahead of it), and once the event completes the
    result must be ready within a few ms (a launch made later, by another thread,
    fails one or the other).

    (``out.is_ready()`` right after the event cannot be the test: JAX marks a result
    ready from the host a little after the GPU finishes.)"""
    import time

    import jax.numpy as jnp
    from jax import lax

    x = jax.device_put(jnp.full((2048, 2048), 1e-3, jnp.float32), device)
    f = jax.jit(lambda x: lax.fori_loop(0, 80, lambda i, y: jnp.tanh(y @ x), x))
    jax.block_until_ready(f(x))
    out = f(x)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.ExternalStream(stream_ptr, device=torch_device))  # the stream's GPU, not the current one
    pending = not ev.query()
    ev.synchronize()
    t0 = time.perf_counter()
    jax.block_until_ready(out)
    late = time.perf_counter() - t0
    return pending and late < 5e-3


def _jax_device_of(device: torch.device):
    """The local JAX GPU device of torch CUDA device ``device`` (its CUDA ordinal)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for d in jax.local_devices():  # the default backend: the GPU here
        if getattr(d, "local_hardware_id", d.id) == index:
            return d
    raise ValueError(f"no local JAX GPU device for torch device {device} (CUDA ordinal {index})")


class StreamSync:
    """Per-call fences between torch's current stream and JAX (see module docstring).

    Args:
      mode: ``"auto"`` (default: ``"stream"`` on a GPU where it was checked to be
        safe, else ``"event"``), ``"event"`` (device-side waits through JAX's
        DLPack stream protocol, host never blocks), ``"stream"`` (device-side waits
        on XLA's compute stream, no JAX call),
        ``"host"`` (host synchronisation) or ``"none"`` (caller orders the streams;
        unsafe unless torch and JAX work never overlap).
    """

    def __init__(self, mode: str = "auto", device: torch.device | None = None):
        if mode not in ("auto", "event", "stream", "host", "none"):
            raise ValueError(f"sync mode={mode!r} must be 'auto', 'event', 'stream', 'host' or 'none'")
        self.platform = jax.default_backend()
        self.mode = mode
        self._jdev = jax.devices()[0]
        if self.platform == "gpu":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
            self._jdev = _jax_device_of(self.device)  # the fences go on this GPU's XLA stream
            self._fence_t = torch.zeros(16, dtype=torch.int32, device=self.device)
            try:
                self._ext_stream = self._jdev.get_stream_for_external_ready_events()
            except Exception:  # noqa: BLE001 - a client without the stream extension
                self._ext_stream = None
            self._import = self._make_importer()
            self._xla_stream = None
            if mode == "auto":
                # "stream" where XLA's stream can be read and a jitted call is on it
                # when the call returns (checked once here); "event" otherwise.
                try:
                    self._setup_stream()
                    synchronous = _launch_is_synchronous(self._jdev, self._xla_stream.cuda_stream, self.device)
                    self.mode = "stream" if synchronous else "event"
                except Exception:  # noqa: BLE001 - any failure of the probe: the safe mode
                    self.mode = "event"
                if self.mode == "event":
                    warnings.warn(
                        "jattn.bridge: XLA's compute stream is not usable for fences "
                        "here; using sync='event' (slower host path)"
                    )
            elif mode == "stream":
                self._setup_stream()
        else:
            self.mode = "event" if mode == "auto" else mode
            self.device = torch.device("cpu")
            self._fence_t = torch.zeros(16, dtype=torch.int32)
        self._fence_j = jax.dlpack.from_dlpack(self._fence_t, copy=False)

    def _setup_stream(self):
        ptr = xla_compute_stream(self._jdev)
        if ptr is None:
            raise RuntimeError(
                "sync='stream': XLA's compute stream could not be read "
                "(needs jax.experimental.buffer_callback); use sync='event'"
            )
        self._xla_stream = torch.cuda.ExternalStream(ptr, device=self.device)
        self._ev_in, self._ev_out = torch.cuda.Event(), torch.cuda.Event()
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._dev_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._cur_ptr, self._cur_stream = None, None
        self._xla_ptr = ptr

    def _torch_stream(self):
        """torch's current stream as a cached stream object. ``torch.cuda.current_stream()``
        builds a new Python object per call (as costly as the four CUDA calls of both
        fences); the raw handle is cheap to read and compare."""
        if self._raw_stream is None:
            return torch.cuda.current_stream(self.device)
        ptr = self._raw_stream(self._dev_index)
        if ptr != self._cur_ptr:
            if ptr == self._xla_ptr:
                self._cur_stream = self._xla_stream
            else:
                self._cur_stream = (
                    torch.cuda.ExternalStream(ptr, device=self.device)
                    if ptr
                    else torch.cuda.default_stream(self.device)
                )
            self._cur_ptr = ptr
        return self._cur_stream

    @property
    def stream(self):
        """XLA's compute stream as a torch stream (``mode="stream"`` on a GPU, else
        None). Torch work enqueued on it (``with torch.cuda.stream(sync.stream):``)
        is ordered with jattn's calls by the stream itself: no fence is made."""
        return self._xla_stream if self.platform == "gpu" and self.mode == "stream" else None

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

    @property
    def jax_fence(self) -> bool:
        """Whether the jitted call takes the torch->JAX fence as an argument and
        returns a token for the JAX->torch fence (``"event"`` on the GPU). The
        other modes order the streams outside the call (or not at all), and each
        extra argument and output is host time per call."""
        return self.platform == "gpu" and self.mode == "event"

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
        if self.mode == "stream":
            if self._xla_stream is None:  # mode switched after construction
                self._setup_stream()
            ts = self._torch_stream()
            if ts is not self._xla_stream:  # one stream for both: already in order
                self._ev_in.record(ts)
                self._xla_stream.wait_event(self._ev_in)
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
        if self.mode == "stream":
            ts = self._torch_stream()
            if ts is not self._xla_stream:
                self._ev_out.record(self._xla_stream)
                ts.wait_event(self._ev_out)
            return
        ptr = torch.cuda.current_stream(self.device).cuda_stream
        out.__dlpack__(stream=ptr if ptr else 1)  # 1: the legacy default stream
