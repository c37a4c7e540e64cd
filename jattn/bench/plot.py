"""Charts of benchmark results: ``python -m jattn.bench.plot RESULTS.json OUT.png``.

``RESULTS.json`` is what a benchmark's ``--json`` wrote (its table as printed and the
run's facts); the chart shows, for every row, the achieved rate of jattn and of each
peer beside the ceiling measured in the same run (for ``bench decode``: TB/s by GPU
time and by wall time, and the device copy bandwidth). Needs matplotlib (the ``plot``
extra); :func:`series` reads the numbers without it.
"""

from __future__ import annotations

import json
import math
import re
import sys

__all__ = ["SERIES", "draw", "series"]

# bench -> (label, column, which number of the cell: 0 the first, -1 the last)
SERIES = {
    "decode": (
        ("jattn, GPU time", "device TB/s", 0),
        ("jattn, wall time", "TB/s", 0),
        ("jattn triton, GPU time", "triton TB/s (device)", 0),
        ("FA3, GPU time", "FA3 device TB/s", 0),
        ("FA3, wall time", "FA3 TB/s", 0),
        ("JAX paged_attention, GPU time", "JAX paged_attention TB/s (device)", -1),
    ),
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _number(cell: str, which: int) -> float:
    found = _NUMBER.findall(str(cell)) if not str(cell).startswith(("fails", "FAILED", "setup")) else []
    return float(found[which]) if found else math.nan


def series(results: dict) -> tuple[list[str], dict[str, list[float]]]:
    """``(row labels, {series label: values})`` of a results dict (NaN where a cell has no
    number: the peer did not run or failed there). Series with no number are left out."""
    bench, header, rows = results["bench"], results["header"], results["rows"]
    if bench not in SERIES:
        raise ValueError(f"no chart is defined for bench {bench!r} (known: {', '.join(SERIES)})")
    if bench == "decode":
        col = {h: i for i, h in enumerate(header)}
        labels = [f"p{r[col['page']]} {r[col['batch x len']]} q{r[col['q_len']]} {r[col['kv']]}" for r in rows]
    out = {}
    for label, column, which in SERIES[bench]:
        if column not in header:
            continue
        i = header.index(column)
        vals = [_number(r[i], which) if i < len(r) else math.nan for r in rows]
        if any(not math.isnan(v) for v in vals):
            out[label] = vals
    return labels, out


def draw(results: dict, path: str) -> str:
    """Draws ``results`` to the PNG ``path``; returns what it did (or why it could not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install 'jattn[plot]'); draw it later from --json"
    labels, data = series(results)
    n, k = len(labels), max(1, len(data))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * n + 3), 5))
    width = 0.8 / k
    for j, (name, vals) in enumerate(data.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(n)]
        ax.bar(xs, [0 if math.isnan(v) else v for v in vals], width, label=name)
    if results.get("copy_tbs"):
        ax.axhline(results["copy_tbs"], color="k", linestyle="--", linewidth=1, label="device copy (ceiling)")
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("TB/s (K and V bytes read once)")
    ax.set_title(f"bench {results['bench']}: {results.get('device', '')}, jax {results.get('jax', '')}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart written to {path} ({n} rows, {len(data)} series)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m jattn.bench.plot RESULTS.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(draw(json.load(f), argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
