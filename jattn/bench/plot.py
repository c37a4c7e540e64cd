"""Charts of benchmark results: ``python -m jattn.bench.plot RESULTS.json OUT.png``.

``RESULTS.json`` is what a benchmark's ``--json`` wrote (its table as printed and the
run's facts); the chart shows, for every row, jattn and each peer beside the ceiling
measured in the same run: ``decode`` TB/s by GPU and wall time against the copy
bandwidth, ``prefill`` TFLOP/s against the matmul rate, ``mla`` TB/s per backend against
the copy bandwidth, ``cascade`` the time per call of the plain decode and each cascade
pass. Needs matplotlib (the ``plot`` extra); :func:`series` reads the numbers without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

__all__ = ["SERIES", "Chart", "draw", "series"]


@dataclasses.dataclass(frozen=True)
class Chart:
    """How one benchmark's table becomes bars: the row label (columns, or ``(prefix,
    column)`` pairs, joined by a space), the series (``(name, column, which number of the
    cell: 0 the first, -1 the last, "()" the one in parentheses)``) or, with ``pivot``, one
    series per value of that column (``values`` the column plotted), the y axis, and the
    run fact drawn as the ceiling line."""

    label: tuple
    ylabel: str
    series: tuple = ()
    pivot: str | None = None
    values: str | None = None
    ceiling: str | None = None
    ceiling_label: str = ""


def _tbs_per_backend(label: tuple, ylabel: str) -> Chart:
    """One TB/s series per value of the table's ``backend`` column, under the copy ceiling."""
    return Chart(
        label, ylabel, pivot="backend", values="TB/s", ceiling="copy_tbs", ceiling_label="device copy (ceiling)"
    )


SERIES = {
    "decode": Chart(
        label=(("p", "page"), "batch x len", ("q", "q_len"), "kv"),
        ylabel="TB/s (K and V bytes read once)",
        series=(
            ("jattn, GPU time", "device TB/s", 0),
            ("jattn, wall time", "TB/s", 0),
            ("jattn triton, GPU time", "triton TB/s (device)", 0),
            ("FA3, GPU time", "FA3 device TB/s", 0),
            ("FA3, wall time", "FA3 TB/s", 0),
            ("JAX paged_attention, GPU time", "JAX paged_attention TB/s (device)", "()"),
            ("JAX paged_attention, wall time", "JAX paged_attention TB/s (device)", 0),
        ),
        ceiling="copy_tbs",
        ceiling_label="device copy (ceiling)",
    ),
    "prefill": Chart(
        label=("row",),
        ylabel="TFLOP/s (causal counts half)",
        series=(
            ("jattn", "TFLOP/s", 0),
            ("jattn triton", "triton TFLOP/s", 0),
            ("FA3", "FA3 TFLOP/s", 0),
            ("cuDNN (JAX)", "cuDNN TFLOP/s", 0),
            ("torch flash", "torch flash TFLOP/s", 0),
            ("torch cuDNN", "torch cuDNN TFLOP/s", 0),
        ),
        ceiling="matmul_tflops",
        ceiling_label="bf16 matmul (ceiling)",
    ),
    "mla": _tbs_per_backend(("row",), "TB/s (latent read once per request, q and out)"),
    "kvwrite": _tbs_per_backend(("write", "cache", "tokens"), "TB/s (inputs and slots read, cache rows written)"),
    "cascade": Chart(
        label=("groups x size", "prefix + suffix"),
        ylabel="us per call, GPU time (lower is better)",
        series=(
            ("plain decode", "plain us", 0),
            ("cascade, decode pass", "decode-pass us", 0),
            ("cascade, extend pass", "extend-pass us", 0),
            ("cascade, auto", "auto us", 0),
        ),
    ),
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _number(cell: str, which) -> float:
    """Number ``which`` of ``cell`` (an index), or with ``which="()"`` the one in
    parentheses (a GPU time beside a wall time: NaN where the cell has none)."""
    cell = str(cell)
    if cell.startswith(("fails", "FAILED", "setup")):
        return math.nan
    if which == "()":
        inner = re.search(r"\(([^)]*)\)", cell)
        found = _NUMBER.findall(inner.group(1)) if inner else []
        return float(found[0]) if found else math.nan
    found = _NUMBER.findall(cell)
    return float(found[which]) if found else math.nan


def series(results: dict) -> tuple[list[str], dict[str, list[float]]]:
    """``(row labels, {series label: values})`` of a results dict (NaN where a cell has no
    number: the peer did not run or failed there). Series with no number are left out."""
    if not isinstance(results, dict) or not {"bench", "header", "rows"} <= results.keys():
        raise ValueError(
            f"not a table that has a chart (the --json of bench {', '.join(SERIES)}); bench serving's "
            "--json is a list of rows, which has none"
        )
    bench, header, rows = results["bench"], results["header"], results["rows"]
    if bench not in SERIES:
        raise ValueError(f"no chart is defined for bench {bench!r} (known: {', '.join(SERIES)})")
    chart = SERIES[bench]
    col = {h: i for i, h in enumerate(header)}
    parts = [(c, "") if isinstance(c, str) else (c[1], c[0]) for c in chart.label]
    missing = [c for c, _ in parts + [(chart.pivot, ""), (chart.values, "")] if c is not None and c not in col]
    if missing:
        raise ValueError(f"bench {bench!r} results lack the columns {missing}")
    names = [" ".join(f"{pre}{r[col[c]]}" for c, pre in parts) for r in rows]
    labels = list(dict.fromkeys(names))
    out: dict[str, list[float]] = {}
    if chart.pivot:
        for r, name in zip(rows, names):
            vals = out.setdefault(str(r[col[chart.pivot]]), [math.nan] * len(labels))
            vals[labels.index(name)] = _number(r[col[chart.values]], 0)
    else:  # rows that share a label (another column tells them apart) share its bar: the first kept
        for label, column, which in chart.series:
            if column in col:
                vals = out[label] = [math.nan] * len(labels)
                for r, name in zip(rows, names):
                    j = labels.index(name)
                    if math.isnan(vals[j]):
                        vals[j] = _number(r[col[column]], which) if col[column] < len(r) else math.nan
    return labels, {k: v for k, v in out.items() if any(not math.isnan(x) for x in v)}


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
    chart = SERIES[results["bench"]]
    if chart.ceiling and results.get(chart.ceiling):
        ax.axhline(results[chart.ceiling], color="k", linestyle="--", linewidth=1, label=chart.ceiling_label)
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(chart.ylabel)
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
    try:
        with open(argv[0]) as f:
            results = json.load(f)
        print(draw(results, argv[1]))
    except (OSError, ValueError) as e:  # a missing or unreadable file, not JSON, not a table with a chart
        print(f"python -m jattn.bench.plot: {argv[0]}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
