"""The benchmark charts (``jattn.bench.plot``): the numbers read from a results table
with ``bench decode``'s own columns, and a PNG drawn from them."""

from __future__ import annotations

import json
import math

import pytest

from jattn.bench import common, decode, plot


def _results(tmp_path):
    h = list(decode.HEADER)
    row = dict.fromkeys(h, "-")
    rows = []
    for shape, dev, wall, jpa, fa3 in (
        ("1x4096", "1.22", "0.86", "0.40 (0.55)", "0.97"),
        ("64x4096", "4.25", "4.10", "fails: out of memory", "-"),
    ):
        r = dict(row, page="64", q_len="1", kv="bf16")
        r.update({"batch x len": shape, "device TB/s": dev, "TB/s": wall, h[10]: jpa, "FA3 device TB/s": fa3})
        rows.append([r[c] for c in h])
    path = tmp_path / "decode.json"
    common.write_results(str(path), "decode", h, rows, dict(device="test", jax="0", copy_tbs=4.2, copy_how="x"))
    return json.loads(path.read_text())


def test_series_reads_each_column_and_leaves_out_what_did_not_run(tmp_path):
    labels, data = plot.series(_results(tmp_path))
    assert labels == ["p64 1x4096 q1 bf16", "p64 64x4096 q1 bf16"]
    assert data["jattn, GPU time"] == [1.22, 4.25]
    assert data["jattn, wall time"] == [0.86, 4.10]
    assert data["JAX paged_attention, GPU time"][0] == 0.55 and math.isnan(data["JAX paged_attention, GPU time"][1])
    assert data["FA3, GPU time"][0] == 0.97 and math.isnan(data["FA3, GPU time"][1])
    assert "jattn triton, GPU time" not in data  # no number in any row
    with pytest.raises(ValueError, match="no chart is defined for bench 'nope'"):
        plot.series(dict(bench="nope", header=[], rows=[]))


def test_draw_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "decode.png"
    msg = plot.draw(_results(tmp_path), str(out))
    assert "2 rows, 4 series" in msg  # jattn GPU and wall, JAX paged_attention, FA3 GPU
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert plot.main([str(tmp_path / "decode.json"), str(tmp_path / "again.png")]) == 0
