"""The Mosaic GPU interpreter on one core: ``widen_cpu_pool`` keeps it from deadlocking.

With XLA:CPU's client pool at its default size (one thread per core), an interpreted MLA
decode with two requests of four splits each hangs on a single core (its warpgroups block
in barrier waits on every pool thread). The case runs in a child process pinned to one CPU
that calls ``widen_cpu_pool`` before JAX starts; it must finish, and match the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jattn.pallas_kernels.interpret import interpreter_available, on_gpu

_CHILD = """
import os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.path.insert(0, TESTS)
from jattn.pallas_kernels.interpret import gpu_interpret, widen_cpu_pool
widen_cpu_pool()
import jax, jax.numpy as jnp
jax.config.update("jax_default_matmul_precision", "highest")
import test_mosaic_mla as t
c = t.Case(lens=(520, 300), heads=16, q_len=2, page_size=64, num_splits=4, poison=1, fp8=True)
with gpu_interpret():
    t._check(c, jnp.float16, deterministic=False)
print("finished", os.environ["PJRT_NPROC"])
"""


@pytest.mark.skipif(on_gpu() or not interpreter_available(), reason="interpreted on the CPU")
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_interpreted_kernel_finishes_on_one_core():
    env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
    code = _CHILD.replace("TESTS", repr(os.path.dirname(__file__)))
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreted kernel hung on one core (XLA:CPU's client pool too small)")
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split()[-2:] == ["finished", "16"]
