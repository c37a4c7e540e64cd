"""The profile reader's arithmetic (jattn/bench/profile.py) on synthetic kernel events."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.bench.profile import CallProfile, Kernel, _split_calls, profile_calls, summarize


def _k(name, start_us, dur_us):
    return Kernel(name, start_us * 1e3, dur_us * 1e3)


def test_split_calls_at_the_widest_gaps():
    # three calls: kernels 2 us apart inside a call, 100+ us between calls
    ev = [_k("a", 0, 5), _k("b", 7, 3), _k("a", 120, 5), _k("b", 127, 3), _k("a", 300, 5), _k("b", 307, 4)]
    calls = _split_calls(ev, 3)
    assert [len(c.kernels) for c in calls] == [2, 2, 2]
    assert calls[0].span_us == 10.0 and calls[2].span_us == 11.0
    assert calls[0].busy_us == 8.0


def test_busy_merges_overlapping_kernels():
    c = CallProfile((_k("a", 0, 10), _k("b", 5, 10), _k("c", 30, 5)))
    assert c.span_us == 35.0
    assert c.busy_us == 20.0  # [0, 15) and [30, 35)


def test_summarize_medians_per_name_and_missing_kernels():
    calls = [
        CallProfile((_k("dec", 0, 10), _k("comb", 11, 2))),
        CallProfile((_k("dec", 0, 12), _k("comb", 13, 4))),
        CallProfile((_k("dec", 0, 11),)),
    ]  # no combine in this call
    s = summarize(calls)
    names = {n: (c, us) for n, c, us in s.kernels}
    assert names["dec"] == (1, 11.0)
    assert names["comb"] == (1, 2.0)  # median of 2, 4 and the missing 0
    assert s.kernels[0][0] == "dec"
    assert "dec" in s.table()


def test_profile_calls_runs_without_a_device_trace():
    """On the CPU the trace has no device plane: no calls, an empty summary."""
    f = jax.jit(lambda x: x * 2)
    calls = profile_calls(f, [(jnp.ones(4),)] * 2, warmup=1)
    if jax.default_backend() == "cpu":
        assert calls == [] and summarize(calls).span_us == 0.0


def test_time_loop_runs_each_call_with_a_traced_index():
    """``time_loop`` calls ``step(i, ...)`` with a traced loop index inside one jit (the
    per-call figure on the CPU means nothing; the calls and their indices must be right)."""
    from jattn.bench import common

    seen = []

    def step(i, x):
        seen.append(type(i))
        return x[i % 4] * 2

    t = common.time_loop(step, (jnp.arange(32, dtype=jnp.float32).reshape(4, 8),), n_lo=2, n_hi=4, reps=1, graph=False)
    assert t.n_lo == 2 and t.n_hi == 4 and t.seconds > 0
    assert seen and all(issubclass(s, jax.core.Tracer) for s in seen)


def test_time_rotated_command_buffer_modes_compile():
    """XLA's defaults, command buffers on, and off entirely: each compiles and times the
    calls (``graph="off"`` passes an empty command-buffer list, which XLA accepts)."""
    from jattn.bench import common

    for graph in (False, True, "off"):
        t = common.time_rotated(lambda i, x: x[i % 4] * 2, (jnp.ones((4, 8)),), n_lo=1, n_hi=2, reps=1, graph=graph)
        assert t.n_hi == 2 and t.seconds > 0


def test_joined_outputs_keep_every_value_one_array_per_dtype():
    """The harness joins all calls' outputs into one array per dtype: nothing dropped
    (so no call is dead code), values in call order."""
    from jattn.bench import common

    rng = np.random.default_rng(0)
    outs = tuple(
        (jnp.asarray(rng.standard_normal((2, 3)), jnp.bfloat16), jnp.asarray(rng.standard_normal((3,)), jnp.float32))
        for _ in range(4)
    )
    joined = common._joined(outs)
    assert [j.dtype for j in joined] == [jnp.bfloat16, jnp.float32]
    np.testing.assert_array_equal(
        np.asarray(joined[0], np.float32), np.concatenate([np.asarray(o[0], np.float32).ravel() for o in outs])
    )
    np.testing.assert_array_equal(np.asarray(joined[1]), np.concatenate([np.asarray(o[1]).ravel() for o in outs]))


def test_time_rotated_join_modes_run_every_call():
    """Both output modes run all n calls: the step is traced once per call index."""
    from jattn.bench import common

    for join in (True, False):
        seen = []

        def step(i, x):
            seen.append(i)
            return x[i % 4] * 2, (x[i % 4] + 1).astype(jnp.int32)

        t = common.time_rotated(step, (jnp.ones((4, 8)),), n_lo=1, n_hi=3, reps=1, join=join)
        assert t.seconds > 0 and sorted(set(seen)) == [0, 1, 2]


def test_trace_events_host_side_on_one_clock():
    """trace_events returns the host activity of the traced calls, time-sorted; on a
    machine without a GPU the device list is empty (no stream lines)."""
    from jattn.bench.profile import trace_events

    f = jax.jit(lambda x: jnp.sin(x) * 2)
    host, dev = trace_events(f, (jnp.ones(8),), reps=2, warmup=1, pause_s=0.001)
    assert host, "no host events traced"
    starts = [e[0] for e in host]
    assert starts == sorted(starts)
    assert all(len(e) == 3 and e[1] >= 0 for e in host)
    if jax.default_backend() != "gpu":
        assert dev == []


def test_time_rotated_device_stamps_wait_for_every_output(monkeypatch):
    """``device=True``: the first stamp feeds args[0] of every call, and the last stamp
    reads every output leaf (checked with a stand-in stamp on the CPU; the real one
    is a Triton kernel launched through jax-triton, tested on the GPU below)."""
    from jattn.bench import common

    fed = []

    def fake_stamp(*deps):
        fed.append(len(deps))
        return jnp.stack([jnp.sum(d).astype(jnp.int32) * 0 + 1000 * len(fed) for d in deps])[:1]

    monkeypatch.setattr(common, "gpu_stamp", lambda: fake_stamp)

    def step(i, x):
        return x[i % 4] * 2, (x[i % 4] + 1).astype(jnp.int32)

    t = common.time_rotated(step, (jnp.ones((4, 8)),), n_lo=1, n_hi=4, reps=1, join=False, device=True)
    assert t.device_seconds is not None and t.seconds > 0
    # n_hi=4 calls x 2 leaves = 8 outputs, all read by the last stamp; one start stamp
    # on args[0] (traced once per program: n_lo, then n_hi).
    assert fed == [1, 2, 1, 8]
    monkeypatch.setattr(common, "gpu_stamp", lambda: None)
    assert common.time_rotated(step, (jnp.ones((4, 8)),), n_lo=1, n_hi=2, reps=1, device=True).device_seconds is None


def _dots_after_the_first_stamp(step, args, n, **kw):
    """For each dot of ``rotated_program(step, n)`` (a stand-in stamp marked by a
    population_count): whether it depends on the first stamp."""
    from jattn.bench import common

    def stamp(*deps):
        return jnp.stack([jax.lax.population_count(jnp.ravel(d)[0].astype(jnp.int32)) for d in deps[:1]])

    jaxpr = jax.make_jaxpr(common.rotated_program(step, n, join=False, stamp=stamp, **kw))(*args).jaxpr
    while len(jaxpr.eqns) == 1 and "jaxpr" in jaxpr.eqns[0].params:
        jaxpr = jaxpr.eqns[0].params["jaxpr"].jaxpr
    tainted, seen, dots = set(), False, []
    for e in jaxpr.eqns:
        ins = {id(v) for v in e.invars if type(v).__name__ != "Literal"}
        if e.primitive.name == "population_count" and not seen:
            seen = True
            tainted |= {id(v) for v in e.outvars}
            continue
        if ins & tainted:
            tainted |= {id(v) for v in e.outvars}
        if e.primitive.name == "dot_general":
            dots.append(bool(ins & tainted))
    return dots


def test_stamp_args_make_every_call_wait_for_the_first_stamp():
    """``matmul_rate``'s calls each read two of five matrices, only call 0 ``args[0]``: the
    other calls did not depend on the first stamp, so XLA could run them before it and out
    of the measured span. ``stamp_args=5`` routes all five through the stamp."""
    xs = [jnp.full((8, 8), float(i), jnp.bfloat16) for i in range(5)]

    def step(i, *xs):
        return xs[i % 4] @ xs[(i + 1) % 5]

    assert _dots_after_the_first_stamp(step, xs, 4) == [True, False, False, False]
    assert _dots_after_the_first_stamp(step, xs, 4, stamp_args=5) == [True] * 4


def test_matmul_rate_programs_read_all_five_matrices_through_the_stamp():
    """``matmul_rate`` times the difference of two programs: the stamp's elementwise pass
    over each matrix a program reads is in both only if both read all five (its n_lo = 1
    program read two, so the difference held three extra passes, about 5% of the rate).
    Each program's products are distinct pairs (none for XLA to share)."""
    from jattn.bench import prefill

    xs = [jnp.full((8, 8), float(i), jnp.bfloat16) for i in range(5)]
    for n in prefill.MATMUL_CALLS:
        reads = [(i % 5, (i + 1 + i // 5) % 5) for i in range(n)]
        assert len(set(reads)) == n and all(a != b for a, b in reads)
        assert {a for pair in reads for a in pair} == set(range(5))
        assert _dots_after_the_first_stamp(prefill._matmul_step, xs, n, stamp_args=5) == [True] * n
        np.testing.assert_array_equal(prefill._matmul_step(n - 1, *xs), xs[reads[-1][0]] @ xs[reads[-1][1]])


def test_jax_copy_bandwidth_calls_are_all_distinct():
    """The JAX copy-bandwidth program's calls ``a[i % 4] + 1.0`` repeated every 4th call and
    XLA merged them (4 adds of 10 were left); each call now adds its own constant."""
    from jattn.bench import common

    xs = [jnp.full((1024,), float(i), jnp.float32) for i in range(4)]
    hlo = common.rotated_program(common._copy_step, 10).lower(*xs).compile().as_text()
    assert hlo.count(" add(") == 10, hlo


def test_time_rotated_keeps_the_wall_time_when_the_stamp_fails(monkeypatch):
    """A stamp kernel that does not build costs the device figure only, with a
    warning: the wall figure still comes back."""
    from jattn.bench import common

    def broken_stamp(*deps):
        raise NotImplementedError("no Triton lowering here")

    monkeypatch.setattr(common, "gpu_stamp", lambda: broken_stamp)
    with pytest.warns(UserWarning, match="no device time"):
        t = common.time_rotated(lambda i, x: x[i % 4] * 2, (jnp.ones((4, 8)),), n_lo=1, n_hi=2, reps=1, device=True)
    assert t.seconds > 0 and t.device_seconds is None


def test_gpu_stamp_is_none_without_jax_triton(monkeypatch):
    """Where jax-triton cannot launch kernels (no GPU, or not installed) there is no
    stamp, and ``time_rotated(device=True)`` returns the wall figure alone."""
    from jattn.bench import common
    from jattn.pallas_kernels import triton_glue

    monkeypatch.setattr(triton_glue, "available", lambda: False)
    assert common.gpu_stamp() is None
    t = common.time_rotated(lambda i, x: x[i % 4] * 2, (jnp.ones((4, 8)),), n_lo=1, n_hi=2, reps=1, device=True)
    assert t.seconds > 0 and t.device_seconds is None


@pytest.mark.gpu
def test_gpu_stamp_times_the_device():
    """On the GPU the stamps bracket the calls: the per-call device time of a 256 MB
    elementwise op lies between the HBM peak's bound and the wall time."""
    from jattn.bench import common

    xs = jnp.stack([jnp.full((1 << 25,), float(i), jnp.float32) for i in range(4)])
    t = common.time_rotated(lambda i, x: x[i % 4] * 2.0, (xs,), n_lo=2, n_hi=8, reps=5, device=True)
    nbytes = 2 * (1 << 25) * 4  # read + write
    assert nbytes / 5.0e12 < t.device_seconds < 1.5 * t.seconds, (t.device_seconds, t.seconds)


def test_decode_bench_set_parses_kernel_options():
    """``bench decode --set`` passes the kernel's options explicitly (A/B runs)."""
    from jattn.bench.decode import parse_options
    from jattn.pallas_kernels.decode_tuning import KernelOptions

    assert parse_options("") == KernelOptions()
    assert parse_options("overlap_qk=0") == KernelOptions(overlap_qk=False)
    assert parse_options("kernel_combine=0,overlap_qk=1") == KernelOptions(kernel_combine=False)
    assert parse_options("heads_row_tile=16") == KernelOptions(heads_row_tile=16)
    assert parse_options("balanced_splits=0").balanced_splits is False  # a call-chosen flag
    for bad in ("_OVERLAP_QK=0", "overlap_qk=2", "overlap_qk", "heads_row_tile=x", "heads_row_tile=-1"):
        with pytest.raises(SystemExit, match="overlap_qk"):
            parse_options(bad)


def test_decode_bench_heads_parse_the_geometry():
    """``bench decode --heads Q/KV --head-dim D``: the query heads a multiple of the KV heads,
    a head size the kernels take."""
    from jattn.bench.decode import parse_heads

    assert parse_heads("32/8", 128) == (32, 8, 128)
    assert parse_heads("28/4", 64) == (28, 4, 64)
    for bad in ("32", "32/0", "30/8", "a/8", "-8/8"):
        with pytest.raises(SystemExit, match="--heads"):
            parse_heads(bad, 128)
    with pytest.raises(SystemExit, match="--head-dim"):
        parse_heads("32/8", 96)


def test_prefill_bench_options_parse_ints_and_flags():
    """``bench prefill --options``: integer fields stay integers, flags become bools."""
    from jattn.bench.prefill import parse_options
    from jattn.pallas_kernels.mosaic_prefill_config import PrefillOptions

    got = parse_options("default;persistent=0;overlap_pv=1,block_kv=64;ctas=7")
    assert got == [
        ("", None),
        ("persistent=0", PrefillOptions(persistent=False)),
        ("overlap_pv=1,block_kv=64", PrefillOptions(overlap_pv=True, block_kv=64)),
        ("ctas=7", PrefillOptions(ctas=7)),
    ]
    assert type(got[3][1].ctas) is int and got[1][1].persistent is False
    for bad in ("nope=1", "ctas=x", "ctas"):
        with pytest.raises(ValueError, match="NAME=INT"):
            parse_options(bad)


def test_stamp_kernel_join_reads_element_zero_of_every_input():
    """The stamp kernel's source without the timer (``STAMP=False``, the join of more
    than 8 buffers) under Triton's interpreter: the sum of element 0 of each input
    (each input's producer is then ordered before the stamp)."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    import subprocess
    import sys

    from jattn.pallas_kernels import triton_glue

    code = (
        "import torch\n"
        "from jattn.bench import common\n"
        "from jattn.pallas_kernels import triton_glue\n"
        "ins = [torch.tensor([3.0, 100.0]), torch.tensor([5, 7], dtype=torch.int32),\n"
        "       torch.tensor([-2.0], dtype=torch.float16)] + [torch.tensor([i + 1.0]) for i in range(5)]\n"
        "out = torch.zeros(1, dtype=torch.int32)\n"
        "triton_glue.launch_interpreted(common._stamp_kernel, (1,), *ins, out, STAMP=False)\n"
        "print(int(out[0]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=triton_glue.interpreter_env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == str(3 + 5 - 2 + 1 + 2 + 3 + 4 + 5)


def _visible_pairs(row):
    """(query, key) pairs a row's masks let through, counted by brute force."""
    total = 0
    for n in row.lens:
        pos = row.prefix + np.arange(n)[:, None]  # query positions
        keys = np.arange(row.prefix + n)[None, :]
        total += int((keys <= pos).sum()) if row.causal else n * (row.prefix + n)
    return total


@pytest.mark.parametrize("label", ["4x4096", "4x4096 nc", "ragged 16", "mla 128h", "extend 16x512/4096"])
def test_bench_prefill_rows_flops_and_inputs(label):
    """``bench prefill`` builds each row's inputs and FLOPs on any device: scaled down
    64x here, the FLOPs are 2 * visible pairs * Hq * (D + Dv) and the arrays have the
    shapes the kernels take."""
    from jattn.bench import prefill

    spec = next(r for r in prefill.ROWS if r.label == label)
    inp = prefill.build_row(spec, scale=64)
    row = inp.row
    assert row.lens == tuple(max(1, n // 64) for n in spec.lens)
    assert inp.flops == 2 * _visible_pairs(row) * row.hq * (row.d + row.dv)
    q = inp.args[0]
    assert q.shape == (sum(row.lens), row.hq, row.d) and q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(inp.args[-1]), np.concatenate([[0], np.cumsum(row.lens)]))
    if not row.extend:
        k, v = inp.args[1:3]
        assert k.shape == (sum(row.lens), row.hkv, row.d) and v.shape == (sum(row.lens), row.hkv, row.dv)


def test_bench_prefill_full_size_flops():
    from jattn.bench import prefill

    rows = {r.label: r for r in prefill.ROWS}
    assert prefill.row_flops(rows["4x4096"]) == 2 * 4 * (4096 * 4097 / 2) * 32 * 256
    assert prefill.row_flops(rows["4x4096 nc"]) == 2 * 4 * 4096**2 * 32 * 256
    assert prefill.row_flops(rows["mla 128h"]) == 2 * 2 * (4096 * 4097 / 2) * 128 * 320
    # each new query i of 512 sees 4096 + i + 1 keys
    assert prefill.row_flops(rows["extend 16x512/4096"]) == 2 * 16 * (512 * 4096 + 512 * 513 / 2) * 32 * 256
    r16 = rows["ragged 16"].lens
    assert len(r16) == 16 and r16[0] == 128 and r16[-1] == 8192 and list(r16) == sorted(set(r16))


def test_bench_prefill_extend_inputs_are_a_valid_paged_cache():
    """The extend row: a random permuted page table (no page used twice, every page of
    the pool used), cache_seqlens = prefix + new tokens, and the reference extend over
    those inputs equals attention over each request's gathered K/V."""
    import jattn
    from jattn.bench import prefill

    spec = next(r for r in prefill.ROWS if r.extend)
    assert spec.page_size == 64 and spec.prefix == 4096 and spec.lens == (512,) * 16
    inp = prefill.build_row(spec, scale=32)
    row = inp.row
    q, k_cache, v_cache, table, seqlens, cu = inp.args
    pages_per = -(-(row.prefix + row.lens[0]) // row.page_size)
    assert inp.page_table.shape == (16, pages_per)
    assert sorted(inp.page_table.ravel().tolist()) == list(range(k_cache.shape[0]))
    assert not np.array_equal(inp.page_table.ravel(), np.arange(inp.page_table.size))  # permuted
    np.testing.assert_array_equal(inp.cache_seqlens, [row.prefix + n for n in row.lens])
    assert k_cache.shape == (16 * pages_per, row.page_size, row.hkv, row.d)
    out = jattn.mha_extend_with_kvcache(
        q, k_cache, v_cache, table, seqlens, cu, max_seqlen_q=max(row.lens), is_causal=True, backend="xla"
    )
    b = 3
    kv_len = int(seqlens[b])
    flat = lambda c: np.asarray(c, np.float32)[inp.page_table[b]].reshape(-1, row.hkv, c.shape[-1])[:kv_len]  # noqa: E731
    k, v = flat(k_cache), flat(v_cache)
    qb = np.asarray(q, np.float32)[int(cu[b]) : int(cu[b + 1])]
    g = row.hq // row.hkv
    s = np.einsum("qhd,khd->hqk", qb, np.repeat(k, g, axis=1)) / np.sqrt(row.d)
    pos = row.prefix + np.arange(len(qb))
    s = np.where(np.arange(kv_len)[None, None, :] <= pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v, g, axis=1))
    np.testing.assert_allclose(np.asarray(out[int(cu[b]) : int(cu[b + 1])], np.float32), ref, atol=3e-2, rtol=3e-2)


def test_bench_prefill_without_a_gpu_says_so(capsys):
    from jattn.bench import prefill

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU: the bench would run")
    prefill.main(["--rows", "extend 16x512/4096"])
    assert "needs a GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prefill.main(["--rows", "no such row"])


def test_bench_mla_bytes_flops_and_lengths():
    from jattn.bench import mla

    rng = np.random.default_rng(0)
    row = mla.Row(64, 4096, 16)
    lens = mla.lengths(row, rng)
    nbytes, flops = mla.row_bytes_flops(row, lens)
    assert nbytes == 64 * 4096 * 576 * 2 + 64 * 16 * (576 + 512) * 2  # KV once
    assert flops == 2.0 * 16 * 64 * 4096 * (576 + 512)
    big = mla.Row(64, 4096, 128, q_len=2)  # 256 rows: the latent still counted once per request
    assert mla.row_bytes_flops(big, lens)[0] == 64 * 4096 * 576 * 2 + 64 * 256 * 1088 * 2
    assert mla.row_bytes_flops(mla.Row(64, 4096, 16, fp8=True), lens)[0] == 64 * 4096 * 576 + 64 * 16 * 1088 * 2
    # the e4m3 query column: a 1-byte query, the 2-byte output
    assert mla.row_bytes_flops(mla.Row(64, 4096, 16, fp8=True), lens, q_itemsize=1)[0] == (
        64 * 4096 * 576 + 64 * 16 * (576 + 512 * 2)
    )
    un = mla.lengths(mla.Row(64, 4096, 16, uneven=True), rng)
    assert un.min() >= 512 and un.max() <= 4096 and len(set(un.tolist())) > 10
    assert len({r.label for r in mla.ROWS}) == len(mla.ROWS)


def test_bench_mla_without_a_gpu_says_so(capsys):
    from jattn.bench import mla

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU: the bench would run")
    mla.main(["--rows", "64x4096 h16 q1"])
    assert "needs a GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mla.main(["--rows", "no such row"])
