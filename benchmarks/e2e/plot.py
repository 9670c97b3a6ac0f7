"""Grouped bars of an end-to-end result file: output tokens/s per workload and system, and batch-1 decode latency.

    python -m benchmarks.e2e.plot results.json [more.json ...] --out results.png

Several files are merged as ``benchmarks/e2e/throughput.py --merge`` does. Failed or skipped runs get no bar.
"""

from __future__ import annotations

import argparse

from benchmarks.e2e.report import PROFILED, labels_in_order, read_rows, workloads_in_order


def plot(rows: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels_in_order(rows)
    value = {(r["label"], r["workload"]): r for r in rows if r["status"] in ("ok", "short")}
    names = [w for w in workloads_in_order(rows)
             if w not in ("latency", *PROFILED) and any(k[1] == w for k in value)]
    has_latency = any(key[1] == "latency" for key in value)
    fig, axes = plt.subplots(1, 2 if has_latency else 1, figsize=(11 if has_latency else 8, 4.5),
                             gridspec_kw={"width_ratios": [len(names) or 1, 1]} if has_latency else None,
                             squeeze=False)
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    _bars(axes[0][0], labels, names, lambda r: r.get("tok_per_s"), value, "{:,.0f}", colors)
    axes[0][0].set_ylabel("output tokens/s (higher is better)")
    if has_latency:
        _bars(axes[0][1], labels, ["latency"], lambda r: r.get("ms_per_token"), value, "{:.2f}", colors)
        axes[0][1].set_ylabel("ms per output token (lower is better)")
        axes[0][1].set_xticks([0], ["batch 1 decode"])
    cards = "; ".join(sorted({r["card"] for r in rows}))
    fig.suptitle(f"End-to-end generate_batch, Llama-3.2-1B shape (random init), {cards}", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[label]) for label in labels]
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=150)


def _bars(ax, labels: list[str], names: list[str], metric, value: dict, fmt: str, colors: dict) -> None:
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        xs, heights = [], []
        for j, name in enumerate(names):
            row = value.get((label, name))
            if row is not None and metric(row) is not None and metric(row) > 0:
                xs.append(j + (i - (len(labels) - 1) / 2) * width)
                heights.append(metric(row))
        bars = ax.bar(xs, heights, width, color=colors[label])
        ax.bar_label(bars, [fmt.format(h) for h in heights], fontsize=7, rotation=90, padding=2)
    ax.set_xticks(range(len(names)), names)
    ax.margins(y=0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="result files of benchmarks/e2e/throughput.py --json")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args()
    plot(read_rows(args.json), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
