"""``benchmarks/e2e/cold_start.py --rounds``: the table's medians per system and process, and the plan's order."""

from __future__ import annotations

from benchmarks.e2e import cold_start


def _row(system, process, round_, first_token, status="ok"):
    return {"system": system, "process": process, "round": round_, "status": status, "first_token": first_token,
            "import": 1.0 + round_}


def test_rounds_give_one_row_of_medians_per_system_and_process():
    rows = [_row("a", "first", r, t) for r, t in enumerate((3.0, 9.0, 4.0))] + [_row("a", "second", 0, 2.0)]
    out = cold_start.medians(rows)
    assert out[0] == {"system": "a", "process": "first", "status": "ok", "rounds": 3, "first_token": 4.0,
                      "import": 2.0}
    assert out[1] == rows[3]  # one round: the row as it is


def test_a_failed_round_keeps_the_rows_as_they_are():
    rows = [_row("a", "first", 0, 3.0), {**_row("a", "first", 1, 0.0, status="failed"), "error": "boom"}]
    assert cold_start.medians(rows) == rows
    assert "failed: boom" in cold_start.table(rows)


def test_every_other_round_reverses_the_systems():
    assert cold_start.round_plan(["x", "y"], 3) == [(0, "x"), (0, "y"), (1, "y"), (1, "x"), (2, "x"), (2, "y")]
    assert cold_start.parse_args(["--systems", "generate_batch,transformers", "--rounds", "3"]).rounds == 3
