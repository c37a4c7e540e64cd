"""`bench mla`'s summary of the FP8 rows against their bf16 twins and its row selection (no
GPU needed)."""

import pytest

from jattn.bench import mla, prefill
from jattn.bench.common import select_rows
from jattn.bench.mla import fp8_against_bf16


def test_fp8_against_bf16_takes_the_fastest_mosaic_column_of_each_twin():
    dash = ["-"] * 6
    out = [
        ["64x4096 h16 q1", "mosaic", "84.8", *dash],
        ["64x4096 h16 q1", "mosaic keys as rows", "104.1", *dash],
        ["64x4096 h16 q1", "triton", "60.0", *dash],  # not a Mosaic column: ignored
        ["64x4096 h16 q1 fp8", "mosaic", "86.3", *dash],
        ["64x4096 h16 q1 fp8", "mosaic q e4m3", "76.4", *dash],
        ["1x32768 h16 q1 fp8", "mosaic", "29.5", *dash],  # no bf16 twin timed: no line
        ["128x4096 h16 q1 fp8", "mosaic", "-", *dash],  # failed: no line
    ]
    lines = fp8_against_bf16(out)
    assert lines == ["64x4096 h16 q1 fp8: 76.4 us (mosaic q e4m3) against bf16 84.8 us (mosaic): 1.11x tokens/s"]


def test_rows_run_in_the_order_given():
    """``--rows`` (``bench mla``, ``bench prefill``) names the rows to time in that order (a
    short lease reaches the first); repeats count once, an unknown label is refused with the
    choices."""
    rows, _ = select_rows(mla.ROWS, "64x4096 h16 q1 uneven, 1x32768 h16 q1,64x4096 h16 q1 uneven")
    assert [r.label for r in rows] == ["64x4096 h16 q1 uneven", "1x32768 h16 q1"]
    assert select_rows(mla.ROWS, "") == (list(mla.ROWS), set())
    with pytest.raises(ValueError, match=r"unknown 2x2 h1 q1; choose from 64x4096 h16 q1, "):
        select_rows(mla.ROWS, "2x2 h1 q1")
    # bench prefill's extra step, named or implied
    rows, extras = select_rows(prefill.ROWS, "merge," + prefill.ROWS[1].label, extra=("merge",))
    assert rows == [prefill.ROWS[1]] and extras == {"merge"}
    assert select_rows(prefill.ROWS, "", extra=("merge",)) == (list(prefill.ROWS), {"merge"})
    assert select_rows(prefill.ROWS, prefill.ROWS[0].label, extra=("merge",))[1] == set()
