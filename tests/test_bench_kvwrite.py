"""``python -m jattn bench kvwrite`` on the CPU: its timing loop carries the cache (every
write lands, in place of the one before), and the command says it needs a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.bench import kvwrite


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_kvwrite_loop_writes_every_rotation(kind):
    rng = np.random.default_rng(0)
    caches, ins, slots = kvwrite._setup(kind, jnp.float32, 5, 300, rng)
    write = kvwrite._write(kind, "xla", False)
    t = kvwrite.time_write(write, caches, ins, slots, n_lo=1, n_hi=kvwrite.NUM_ROT + 1, reps=1)
    assert t.seconds > 0
    # the loop the timing runs, for NUM_ROT writes: each rotation's rows at its slots
    out = jax.jit(lambda c: jax.lax.fori_loop(
        0, kvwrite.NUM_ROT, lambda i, c: tuple(write(c, tuple(x[i] for x in ins), slots[i])), c
    ))(caches)  # fmt: skip
    for r in range(kvwrite.NUM_ROT):
        rows = [np.asarray(c).reshape(-1, *c.shape[2:])[np.asarray(slots[r])] for c in out]
        if kind == "mha":
            want = [np.asarray(x[r]) for x in ins]
        else:
            want = [np.concatenate([np.asarray(ins[0][r], np.float32), np.asarray(ins[1][r], np.float32)], -1)]
        later = set(np.asarray(slots[r + 1 :]).ravel().tolist())
        keep = [i for i, s in enumerate(np.asarray(slots[r])) if s not in later]  # not overwritten since
        for got, exp in zip(rows, want):
            np.testing.assert_array_equal(got[keep], np.asarray(exp, np.float32)[keep])
    assert kvwrite._bytes("mha", 2, 1) == 2 * (2 * 8 * 128 * 3 + 4)


def test_kvwrite_cli_needs_a_gpu(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the bench runs")
    kvwrite.main([])
    assert "needs a GPU" in capsys.readouterr().out
