"""Running Triton kernel sources under Triton's interpreter from the test suite.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so each test module's
interpreted cases run in one fresh subprocess: :func:`run_in_interpreter` imports the
test module there and calls its runner for every case name, each writing an ``.npz``
that the tests then read. :func:`merge_splits_f64` merges split-KV partials (base-2
LSE) in float64, as the kernels' combine does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest


def run_in_interpreter(tmp_path_factory, module: str, runs: dict[str, list[str]], timeout: int = 900) -> dict:
    """``{case name: npz}`` after ``module.<runner>(name, path)`` ran for every ``runner:
    names`` entry of ``runs`` in one ``TRITON_INTERPRET=1`` subprocess."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("torch")
    from jattn.pallas_kernels import triton_glue

    tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if tv <= (3, 6) and np.lib.NumpyVersion(np.__version__) >= "2.4.0":  # the GPU machine's numpy
        pytest.skip(f"Triton {triton.__version__}'s interpreter needs numpy < 2.4 (numpy {np.__version__} here)")

    d = tmp_path_factory.mktemp(module)
    lines = [f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import {module} as t"]
    lines += ["import interpreted; interpreted.poison_torch_allocations()"]
    lines += [
        f"for n in {list(names)!r}: t.{runner}(n, {str(d)!r} + '/' + n + '.npz')" for runner, names in runs.items()
    ]
    r = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)],
        env=triton_glue.interpreter_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return {n: np.load(d / f"{n}.npz") for names in runs.values() for n in names}


def poison_torch_allocations() -> None:
    """In the interpreter's subprocess: ``torch.empty`` and ``Tensor.new_empty`` return
    floating-point tensors filled with NaN, so that a kernel that leaves an output row
    unwritten, which on the GPU holds whatever the memory held, fails the comparison here
    too instead of reading a fresh allocation's zeros."""
    import torch

    empty, new_empty = torch.empty, torch.Tensor.new_empty

    def poisoned(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: poisoned(empty(*a, **k))
    torch.Tensor.new_empty = lambda self, *a, **k: poisoned(new_empty(self, *a, **k))


def assert_same_partials(o, lse, o2, lse2) -> None:
    """Split partials ``o [S, ..., D]``, ``lse [S, ...]`` of two launches are the same: the
    LSEs bit for bit, the outputs where the split had keys (with several splits an empty
    one, LSE -inf, leaves its output unwritten); with one split the output is final and
    a row without keys is 0 in both."""
    np.testing.assert_array_equal(lse, lse2)
    written = ~np.isneginf(lse)[..., None]
    if o.shape[0] == 1:
        assert (o[~written[..., 0]] == 0).all() and (o2[~written[..., 0]] == 0).all()
    np.testing.assert_array_equal(np.where(written, o, 0), np.where(written, o2, 0))


def random_draw() -> tuple[int, int]:
    """``(seed, count)`` of the random cases a Triton test module adds to its own:
    ``JATTN_TRITON_FUZZ_SEED`` (default 0, so CI is repeatable) and
    ``JATTN_TRITON_FUZZ_CASES`` (default 8)."""
    return int(os.environ.get("JATTN_TRITON_FUZZ_SEED", "0")), int(os.environ.get("JATTN_TRITON_FUZZ_CASES", "8"))


def merge_splits_f64(o, lse):
    """float64 merge of split partials ``o [S, ..., D]``, ``lse [S, ...]`` (base 2; a NaN
    partial or LSE poisons its row; an empty split's output, LSE -inf, is not read: the
    kernels leave it unwritten); returns ``(o, natural-log lse)``."""
    with np.errstate(invalid="ignore"):  # an unwritten output may hold any bits
        o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    o = np.where(np.isneginf(lse)[..., None], 0.0, o)
    mx = lse.max(0)
    mxs = np.where(np.isneginf(mx), 0.0, mx)
    w = np.exp2(lse - mxs)
    ws = w.sum(0)
    out = (w[..., None] * o).sum(0) / np.where(ws == 0, 1.0, ws)[..., None]
    return out, np.where(ws == 0, -np.inf, (mxs + np.log2(np.where(ws == 0, 1.0, ws))) * np.log(2.0))


def interpreted_triton_call(
    fn, *args, out_shape, grid, name, num_warps=4, num_stages=1, input_output_aliases=None, **constexprs
):
    """``triton_glue.triton_call`` in a ``TRITON_INTERPRET=1`` process: the arrays go to torch
    CPU tensors, the kernel runs under the interpreter into NaN-filled outputs, which come
    back as JAX arrays. Patched in, it runs a JAX entry point's host code (parameters, tile
    list, grid, output shapes, the LSE it returns) on the CPU, eagerly (``jax.disable_jit``).
    ``input_output_aliases`` (input index: output index), as jax-triton takes it: that output
    is a copy of the input, written in place and passed once, as the input."""
    import jax.numpy as jnp
    import ml_dtypes
    import torch

    from jattn.pallas_kernels import triton_glue

    def t(a):
        a = np.array(a)
        if a.dtype == ml_dtypes.float8_e4m3fn:
            return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
        return torch.from_numpy(a)

    shapes = tuple(out_shape) if isinstance(out_shape, (tuple, list)) else (out_shape,)
    outs = [torch.full(s.shape, float("nan"), dtype=getattr(torch, np.dtype(s.dtype).name)) for s in shapes]
    ins = [t(a) for a in args]
    aliases = dict(input_output_aliases or {})
    for i, j in aliases.items():
        ins[i] = outs[j] = ins[i].clone()
    fresh = [o for j, o in enumerate(outs) if j not in aliases.values()]
    triton_glue.launch_interpreted(fn, grid, *ins, *fresh, num_warps=num_warps, num_stages=num_stages, **constexprs)

    def back(o):
        if o.dtype == torch.float8_e4m3fn:
            return jnp.asarray(o.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn))
        return jnp.asarray(o.numpy())

    res = tuple(back(o) for o in outs)
    return res if isinstance(out_shape, (tuple, list)) else res[0]
