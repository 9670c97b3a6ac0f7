"""Rows of the end-to-end benchmark: what each (system, workload) run records, the JSON file, merging and the table.

A row is a flat dict: ``system`` (the ``--systems`` name), ``label`` (``hf_paged`` or ``transformers <version>``),
``workload``, ``status`` (``ok``; ``short`` when fewer tokens came back than asked; ``failed`` or ``skipped``
with ``error``), ``tokens``, ``expected_tokens``, ``seconds``, ``tok_per_s``, the run's header
(``hf_paged.bench.run_header``: card, versions, commit, date) and the settings (budget, engine kwargs), plus
per-workload extras (``ms_per_token`` for latency, busy fractions for the profile).
"""

from __future__ import annotations

import json
import os

from hf_paged.bench import run_header

#: Workloads that profile one hf_paged engine rather than time a call of every system
PROFILED = ("profile", "profile1", "roofline")


def make_row(system: str, label: str, workload: str, result: dict | None = None, error: str | None = None,
             status: str = "failed", **settings) -> dict:
    """A row from a run's result (``tokens``, ``expected_tokens``, ``seconds`` and extras), or from the reason it
    did not run (``status`` "failed" or "skipped")."""
    row = {"system": system, "label": label, "workload": workload, **settings, **run_header()}
    if error is not None:
        return {**row, "status": status, "error": error}
    seconds = result["seconds"]
    status = "ok" if result["tokens"] == result["expected_tokens"] else "short"
    return {**row, **result, "status": status, "tok_per_s": result["tokens"] / seconds if seconds > 0 else None}


def write_json(path: str, rows: list[dict], **meta) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    os.replace(tmp, path)


def read_rows(paths: list[str]) -> list[dict]:
    """The rows of several JSON files; a later file's row replaces an earlier one of the same label and workload."""
    rows: dict[tuple[str, str], dict] = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                rows[row["label"], row["workload"]] = row
    return list(rows.values())


def labels_in_order(rows: list[dict]) -> list[str]:
    """hf_paged first (then its variants), then transformers releases, newest first."""
    labels = {r["label"] for r in rows}
    return sorted(labels, key=lambda label: (label != "hf_paged", not label.startswith("hf_paged"),
                                             _negated_version(label), label))


def newest_transformers(rows: list[dict]) -> str | None:
    others = [label for label in labels_in_order(rows) if label.startswith("transformers ")]
    return others[0] if others else None


def workloads_in_order(rows: list[dict]) -> list[str]:
    """Workloads in the order they first appear (the order they ran in)."""
    return list(dict.fromkeys(r["workload"] for r in rows))


def print_table(rows: list[dict]) -> None:
    """workload x system tok/s (latency: ms per output token), and hf_paged / newest transformers."""
    labels, newest = labels_in_order(rows), newest_transformers(rows)
    cell = {(r["label"], r["workload"]): r for r in rows}
    names = [w for w in workloads_in_order(rows) if w not in PROFILED]
    cards = sorted({r["card"] for r in rows})
    print(f"\nOutput tokens/s (latency: ms per output token at batch 1, decode only); {'; '.join(cards)}", flush=True)
    ratio_head = f"hf_paged / {newest}" if newest and "hf_paged" in labels else ""
    print(f"{'workload':<10}" + "".join(f"{label:>22}" for label in labels) + f"{ratio_head:>32}")
    for name in names:
        line = f"{name:<10}"
        for label in labels:
            line += f"{_cell_text(cell.get((label, name)), name):>22}"
        if ratio_head:
            line += f"{_ratio(cell.get(('hf_paged', name)), cell.get((newest, name))):>32}"
        print(line)
    for r in rows:
        if r["workload"] in ("profile", "profile1") and r.get("tok_per_s"):
            print(f"steady decode, {r['label']}: batch {r['batch']}, {r['ms_per_step']:.2f} ms per step, "
                  f"{r['busy_device']} busy {_percent(r['busy_fraction'])} ({_percent(r['busy_fraction_with_copies'])}"
                  f" with copies), {r['kernels_per_step']:.0f} kernels per step, pure decode: {r['pure_decode']}")
    problems: dict[tuple[str, str, str], list[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            detail = r.get("error") or f"{r['tokens']} of {r['expected_tokens']} tokens"
            problems.setdefault((r["status"], r["label"], detail), []).append(r["workload"])
    for (status, label, detail), names in problems.items():
        print(f"{status}: {label} / {', '.join(names)}: {detail}")


def _percent(fraction: float | None) -> str:
    return "n/a (no device events recorded)" if fraction is None else f"{fraction:.0%}"


def _cell_text(row: dict | None, workload: str) -> str:
    if row is None:
        return "-"
    if row["status"] in ("failed", "skipped"):
        return row["status"]
    mark = "" if row["status"] == "ok" else " (short)"
    if workload == "latency":
        return f"{row['ms_per_token']:.2f} ms{mark}"
    return f"{row['tok_per_s']:,.0f}{mark}" if row["tok_per_s"] else "n/a"


def _ratio(ours: dict | None, theirs: dict | None) -> str:
    if not ours or not theirs or not ours.get("tok_per_s") or not theirs.get("tok_per_s"):
        return "-"
    return f"{ours['tok_per_s'] / theirs['tok_per_s']:.2f}"


def _negated_version(label: str) -> tuple:
    parts = label.rpartition(" ")[2].split(".")
    return tuple(-int(p) if p.isdigit() else 0 for p in parts)
