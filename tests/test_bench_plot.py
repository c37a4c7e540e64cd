"""The benchmark charts (``jattn.bench.plot``): the numbers read from a results table
with ``bench decode``'s own columns, and a PNG drawn from them."""

from __future__ import annotations

import json
import math
import re

import pytest

from jattn.bench import common, decode, plot


def _results(tmp_path):
    h = list(decode.HEADER)
    row = dict.fromkeys(h, "-")
    rows = []
    for shape, dev, wall, jpa, fa3 in (
        ("1x4096", "1.22", "0.86", "0.40 (0.55)", "0.97"),
        ("64x4096", "4.25", "4.10", "fails: out of memory", "-"),
        ("16x4096", "3.90", "3.50", "1.10", "-"),  # a wall figure only: no GPU-time bar
    ):
        r = dict(row, page="64", q_len="1", kv="bf16")
        r.update({"batch x len": shape, "device TB/s": dev, "TB/s": wall, h[10]: jpa, "FA3 device TB/s": fa3})
        rows.append([r[c] for c in h])
    path = tmp_path / "decode.json"
    common.write_results(str(path), "decode", h, rows, dict(device="test", jax="0", copy_tbs=4.2, copy_how="x"))
    return json.loads(path.read_text())


def test_series_reads_each_column_and_leaves_out_what_did_not_run(tmp_path):
    labels, data = plot.series(_results(tmp_path))
    assert labels == ["p64 1x4096 q1 bf16", "p64 64x4096 q1 bf16", "p64 16x4096 q1 bf16"]
    assert data["jattn, GPU time"] == [1.22, 4.25, 3.90]
    assert data["jattn, wall time"] == [0.86, 4.10, 3.50]
    jpa = data["JAX paged_attention, GPU time"]
    assert jpa[0] == 0.55 and math.isnan(jpa[1]) and math.isnan(jpa[2])  # (its wall figure went here)
    assert data["JAX paged_attention, wall time"][::2] == [0.40, 1.10]
    assert data["FA3, GPU time"][0] == 0.97 and math.isnan(data["FA3, GPU time"][1])
    assert "jattn triton, GPU time" not in data  # no number in any row
    with pytest.raises(ValueError, match="no chart is defined for bench 'nope'"):
        plot.series(dict(bench="nope", header=[], rows=[]))


def test_the_command_refuses_what_it_cannot_draw_by_name(tmp_path, capsys):
    """``python -m jattn.bench.plot`` on bench serving's --json (a list of rows), a missing
    file or a file that is not JSON: a one-line error and exit status 1, not a traceback."""
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps([{"model": "tiny", "batch": 1}]))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for path, why in (
        (serving, "not a table that has a chart .*bench serving's --json is a list of rows"),
        (tmp_path / "missing.json", "No such file"),
        (bad, "Expecting property name"),
    ):
        assert plot.main([str(path), str(tmp_path / "out.png")]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"python -m jattn.bench.plot: {path}: ") and len(err.splitlines()) == 1
        assert re.search(why, err), err
    assert not (tmp_path / "out.png").exists()


def test_draw_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "decode.png"
    msg = plot.draw(_results(tmp_path), str(out))
    assert "3 rows, 5 series" in msg  # jattn GPU and wall, JAX paged_attention GPU and wall, FA3 GPU
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert plot.main([str(tmp_path / "decode.json"), str(tmp_path / "again.png")]) == 0


def _table(header, cells):
    """Rows of ``header`` columns, ``cells`` giving a row's non-empty cells by column name."""
    return [[row.get(h, "-") for h in header] for row in cells]


def test_every_bench_has_a_chart_of_its_own_columns(tmp_path):
    """prefill (series by column), mla (one series per backend), cascade (times per call)."""
    from jattn.bench import cascade, mla

    pre = ["row", "Hq/Hkv", "D/Dv", "tokens", "jattn ms", "TFLOP/s", "% matmul", "triton TFLOP/s", "FA3 TFLOP/s"]
    res = dict(
        bench="prefill", header=pre, rows=_table(pre, [{"row": "4x4096", "TFLOP/s": "536", "FA3 TFLOP/s": "603"}])
    )
    assert plot.series(res) == (["4x4096"], {"jattn": [536.0], "FA3": [603.0]})
    rows = _table(
        mla.HEADER,
        [
            {"row": "64x4096 h16", "backend": "mosaic", "TB/s": "-"},
            {"row": "64x4096 h16", "backend": "triton", "TB/s": "2.01"},
            {"row": "128x4096 h16", "backend": "triton", "TB/s": "2.40"},
            {"row": "128x4096 h16", "backend": "xla", "TB/s": "0.41"},
        ],
    )
    labels, data = plot.series(dict(bench="mla", header=list(mla.HEADER), rows=rows))
    assert labels == ["64x4096 h16", "128x4096 h16"] and set(data) == {"triton", "xla"}  # mosaic never ran
    assert data["triton"] == [2.01, 2.40] and math.isnan(data["xla"][0])
    rows = _table(
        cascade.HEADER,
        [{"groups x size": "1x64", "prefix + suffix": "16384+256", "plain us": "669.5", "auto us": "74.1"}],
    )
    assert plot.series(dict(bench="cascade", header=list(cascade.HEADER), rows=rows)) == (
        ["1x64 16384+256"],
        {"plain decode": [669.5], "cascade, auto": [74.1]},
    )
    from jattn.bench import kvwrite

    rows = _table(
        kvwrite.HEADER,
        [
            {"write": "mha", "cache": "bf16", "tokens": "64", "backend": "xla", "TB/s": "0.10"},
            {"write": "mha", "cache": "bf16", "tokens": "64", "backend": "triton", "TB/s": "fails: x"},
        ],
    )
    assert plot.series(dict(bench="kvwrite", header=list(kvwrite.HEADER), rows=rows)) == (
        ["mha bf16 64"],
        {"xla": [0.1]},
    )
    with pytest.raises(ValueError, match=r"lack the columns \['backend'\]"):
        plot.series(dict(bench="mla", header=["row", "TB/s"], rows=[]))


def test_decode_verify_ratios_compare_rows_of_one_run():
    """``bench decode`` sets each multi-token bf16 row against the q_len 1 row of the same
    page size and shape; rows without that partner, FP8 rows and failed rows are left out."""
    h = list(decode.HEADER)
    blank = [""] * (len(h) - 9)

    def row(ps, shape, q_len, kv, dev_us):
        return [ps, shape, q_len, kv, 2, "1", "1", "1%", dev_us] + blank

    rows = [
        row(16, "64x4096", 1, "bf16", "250.0"),
        row(16, "64x4096", 4, "bf16", "275.0"),
        row(64, "64x4096", 4, "bf16", "280.0"),  # no q_len 1 row at page 64
        row(16, "64x4096", 1, "fp8", "240.0"),
        row(16, "64x4096", 8, "bf16", "-"),  # failed
    ]
    lines = decode.verify_ratios(h, rows)
    assert lines == ["page 16 64x4096 q_len 4: 275.0 us against q_len 1's 250.0 (+10.0%)"]


def test_decode_uneven_shapes_count_the_bytes_of_their_own_lengths():
    """``--shapes 64x4096u``: lengths spread from length/8 to length, the bytes counted from
    them (not from the shape's length), and a label apart from the even row's."""
    import jax.numpy as jnp
    import numpy as np

    assert decode.parse_shapes("1x4096, 8x512u") == [(1, 4096, False), (8, 512, True)]
    args = (8, 512, 16, 1, jnp.bfloat16)  # batch, length, page size, q_len, KV dtype
    _, _, _, _, lens, kv_bytes = decode._setup(*args, np.random.default_rng(0), 1, uneven=True)
    lens = np.asarray(lens)
    assert lens.min() >= 64 and lens.max() <= 512 and len(set(lens.tolist())) > 1
    assert kv_bytes == 2 * int(lens.sum()) * decode.HKV * decode.D * 2
    _, _, _, _, even, even_bytes = decode._setup(*args, np.random.default_rng(0), 1)
    assert np.all(np.asarray(even) == 512) and even_bytes == 2 * 8 * 512 * decode.HKV * decode.D * 2


def test_rows_that_share_a_label_give_one_bar_per_label(tmp_path):
    """Two rows with one label (a sweep line under its row): one value per label, the first."""
    res = _results(tmp_path)
    res["rows"].insert(1, list(res["rows"][0]))
    res["rows"][1][res["header"].index("device TB/s")] = "9.99"
    labels, data = plot.series(res)
    assert labels == ["p64 1x4096 q1 bf16", "p64 64x4096 q1 bf16", "p64 16x4096 q1 bf16"]
    assert data["jattn, GPU time"] == [1.22, 4.25, 3.90]


def test_page_rotations_keep_small_calls_out_of_the_l2():
    """A call smaller than 8x the L2 gets disjoint tables, enough that a cycle reads 4x the
    L2; a larger call random tables over a pool of at least 4x the L2. (The line was at 2x:
    a call of 128 MiB, decode at 1 x 32768, still found about 4% of its pages in the L2.)"""
    import numpy as np

    rng = np.random.default_rng(0)
    page_bytes = 2 * 16 * 8 * 128 * 2  # K and V of a page of 16 tokens, 8 KV heads, d128, bf16
    tables, pages = common.page_rotations(rng, 1, 256, page_bytes)  # 1 x 4096: 16.8 MB a call
    n = tables.shape[0]
    assert n * 256 * page_bytes >= 4 * common.L2_BYTES and pages == n * 256
    assert len(np.unique(tables)) == tables.size and tables.max() < pages  # disjoint, in the pool
    tables, pages = common.page_rotations(rng, 1, 2048, page_bytes)  # 1 x 32768: 134 MB, 2.1x the L2
    assert tables.shape == (4, 1, 2048) and len(np.unique(tables)) == tables.size and pages == 4 * 2048
    tables, pages = common.page_rotations(rng, 64, 256, page_bytes)  # 64 x 4096: 1 GB a call
    assert tables.shape == (4, 64, 256) and pages >= 64 * 256
    assert all(len(np.unique(t)) == t.size for t in tables)
