"""Input checks of the torch backends (:mod:`jattn.bridge.call`): tensor shapes against a
layer, the installed plan's mode and token count, layer ids and ``out_cache_loc``. Each
raises a :class:`~jattn.bridge.convert.BridgeError` that names the argument.

None costs a device sync: every call checks its method against the installed plan's mode
and its token rows against the plan's new tokens (or the bucket's rows, padding included),
attribute reads and integer compares. Input shapes and layer ids are checked on the slow
path (MHA's hot-path plans are keyed on the shapes and the layer, so a plan only ever runs
a checked signature), a layer's scales when they change (its spec is cached and read again
when ``pool.scale_key`` changes: attribute reads, no tensor value). A caller's
``out_cache_loc`` is checked for shape and dtype on every call and for its values (slots
inside the pool) where that needs no sync: see :attr:`_InputChecks.check_slot_values`."""

from __future__ import annotations

import numpy as np
import torch

from jattn.metadata import ForwardMode

from .convert import BridgeError


def _check_shape(x, name: str, n: int, forms: tuple, what: str) -> None:
    """Raises unless ``x`` is a tensor of ``n`` rows whose trailing dims are one of
    ``forms`` (e.g. ``((64,), (4, 16))``); ``what`` names the layout, e.g.
    ``"[tokens, tp_q_head_num * head_dim]"``. Attribute reads only."""
    if not isinstance(x, torch.Tensor):
        raise BridgeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[0] != n or tuple(x.shape[1:]) not in forms:
        alts = " or ".join("[" + ", ".join(map(str, (n,) + tuple(f))) + "]" for f in forms)
        raise BridgeError(f"{name} must be {what} = {alts}, got {tuple(x.shape)}")


#: the floating dtypes the bridge takes its inputs (q, k, v, ropes) in
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_input_dtype(x, name: str) -> None:
    """Raises TypeError unless the input tensor ``x`` (or None) has one of
    :data:`INPUT_DTYPES`; an integer or bool K/V would otherwise be written into the pool
    as numbers."""
    if x is None:
        return
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}.dtype={x.dtype} must be a floating dtype: bfloat16, float16 or float32")


def _rows(x, name: str) -> int:
    """The rows (first dim) of input ``x``, which must be a tensor of rank >= 1."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        what = "a 0-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise BridgeError(f"{name} must be a torch.Tensor of [tokens, ...], got {what}")
    return x.shape[0]


def check_slots(loc, name: str, n: int, layout: str, slots: int, where: str, *, values: bool, at_least=False):
    """``loc[:n]``, refused unless ``loc`` (argument ``name``) is a 1-D integer tensor of ``n``
    slots (at least ``n`` with ``at_least``; ``layout`` says so in the message) and, with
    ``values`` (a device sync for a CUDA tensor), every one of them in ``[0, slots)``
    (``where`` names that range in the message)."""
    if not isinstance(loc, torch.Tensor):
        raise BridgeError(f"{name} must be a torch.Tensor of slots, got {type(loc).__name__}")
    if loc.dim() != 1 or (loc.shape[0] < n if at_least else loc.shape[0] != n):
        raise BridgeError(f"{name} must be {layout}, got shape {tuple(loc.shape)}")
    if n and (loc.dtype.is_floating_point or loc.dtype.is_complex or loc.dtype == torch.bool):
        raise BridgeError(f"{name} must hold integer slots, got dtype {loc.dtype}")  # (torch.tensor([]) is float)
    loc = loc[:n]
    if values and n:
        lo, hi = map(int, torch.aminmax(loc))  # (python ints: cheaper than tensor compares)
        if lo < 0 or hi >= slots:
            raise BridgeError(f"{name} holds slot {lo if lo < 0 else hi}, outside {where}")
    return loc


def check_layer_id(pool, i: int, name: str = "layer_id") -> int:
    """``i`` checked against the layers the KV pool states it holds (``layer_num`` from
    ``start_layer``, SGLang's pipeline stages; 0 when absent); a pool that states no
    ``layer_num`` is not checked. Negative ids are refused (they would index from the end)."""
    num = getattr(pool, "layer_num", None)
    if isinstance(num, int):
        start = getattr(pool, "start_layer", 0)
        start = start if isinstance(start, int) else 0
        if not start <= i < start + num:
            raise BridgeError(
                f"{name}={i} is out of range: the KV pool {type(pool).__name__} holds layers "
                f"{start} <= layer_id < {start + num}"
            )
    return i


class _InputChecks:
    """The checks that read a torch backend's installed plan (``_plan_decode``,
    ``_num_real_tokens``, ``_plan_rows``, ``_tokens_rule``, ``forward_mode``) and its
    ``check_slot_values`` setting; a base of ``call._BridgeBase``."""

    #: Checks of the values of a caller's ``out_cache_loc`` (the slots the torch writer
    #: writes: inside the pool, and the installed plan's slots for the real tokens, which
    #: the attention reads): ``"host"`` (default) checks a CPU tensor's values on every call
    #: and a CUDA tensor's shape and dtype only (its values would cost a device sync
    #: per layer call; an out-of-range slot there is torch's device-side index error);
    #: ``"always"`` checks CUDA tensors' values too (one sync per call: debugging);
    #: ``"never"`` checks shape and dtype only.
    check_slot_values = "host"

    # what the layer calls are checked against: the installed plan's token rows (its
    # bucket, padding included), whether it is a decode-kind plan, and how its new tokens
    # were counted (for messages); None until a plan is installed
    _plan_rows: int | None = None
    _plan_decode: bool | None = None
    _loc_np = None  # the plan's slots of its token rows (numpy, padding rows included)
    _tokens_rule: str = ""

    def _note_plan(self, md, tokens_rule: str | None) -> None:
        """Records what the checks need of plan ``md`` being installed (``tokens_rule``:
        how its new tokens were counted; None keeps the last)."""
        self._loc_np = np.asarray(md.out_cache_loc)  # padding rows' slots are the dummy page's
        self._plan_rows = int(self._loc_np.shape[0])
        self._plan_decode = ForwardMode.parse(md.forward_mode).is_decode()
        if tokens_rule is not None:
            self._tokens_rule = tokens_rule

    def _check_mode(self, method: str, ok: bool, serves: str, other: str) -> None:
        """Raises unless a plan is installed and ``ok`` (``method`` serves its mode)."""
        if self._plan_decode is None:
            raise RuntimeError("call init_forward_metadata (or a cuda-graph init) first")
        if not ok:
            mode = ForwardMode.parse(self.forward_mode).name
            kind = "a decode" if self._plan_decode else "an extend"
            raise BridgeError(
                f"{method} does not serve the installed plan's forward_mode={mode}: the installed plan is {kind} "
                f"plan: call {other} ({method} serves {serves})"
            )

    def _check_tokens(self, name: str, n: int) -> None:
        """Raises unless ``n`` (the rows of input ``name``) is the installed plan's new-token
        count or its bucket's rows (padding included): other counts would silently leave
        requests uncomputed or mix stale rows in. Two int compares (hot path)."""
        if n != self._num_real_tokens and n != self._plan_rows:
            real, rows = self._num_real_tokens, self._plan_rows
            if self._tokens_rule.startswith("an all-padding"):
                what = f"is {self._tokens_rule}: {rows} rows"
            else:
                what = f"has {real} new tokens ({self._tokens_rule})"
                if rows != real:
                    what += f"; its bucket has {rows} rows, padding included"
            raise BridgeError(f"{name} has {n} rows; the installed plan {what}")

    def _out_loc(self, loc, n: int, slots: int, default):
        """``out_cache_loc[:n]`` (``default[:n]``, the plan's slots, when None), checked:
        a 1-D integer tensor of at least ``n`` slots; its values in ``[0, slots)`` where
        :attr:`check_slot_values` says (never a device sync by default)."""
        if loc is None:
            return self._planned_loc(default)[:n]
        mode = self.check_slot_values
        if mode not in ("host", "always", "never"):
            raise ValueError(f"check_slot_values={mode!r} must be 'host', 'always' or 'never'")
        values = mode == "always" or (mode == "host" and isinstance(loc, torch.Tensor) and loc.device.type == "cpu")
        layout = f"1-D with a slot for each of the {n} new tokens"
        where = f"the KV pool's slots [0, {slots}) (pages * page_size)"
        loc = check_slots(loc, "out_cache_loc", n, layout, slots, where, values=values, at_least=True)
        if values:
            self._check_loc_matches_plan(loc)
        return loc

    def _check_loc_matches_plan(self, loc) -> None:
        """Raises unless the real tokens' slots in ``loc`` are the installed plan's: the
        attention reads each new token where the plan (``req_to_page``, ``seq_lens``) puts
        it, so a torch write elsewhere would leave it reading a stale slot and overwrite
        another token. Padding rows are not compared."""
        plan = self._loc_np
        if plan is None:
            return
        real = min(self._num_real_tokens, loc.shape[0], plan.shape[0])
        got = loc[:real].cpu().numpy()
        bad = np.flatnonzero(got != plan[:real])
        if bad.size:
            i = int(bad[0])
            raise BridgeError(
                f"out_cache_loc[{i}]={int(got[i])}, but the installed plan puts new token {i} at slot "
                f"{int(plan[i])} (from req_to_page and seq_lens): the attention would read that slot while "
                f"the pool's writer wrote elsewhere; pass the slots of the plan ({len(bad)} of {real} differ)"
            )
