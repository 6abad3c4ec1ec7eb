"""bench/check_results.py: the published headline table is readable and names benches that exist; a
figure worse than published by more than the tolerance fails, in the direction the row says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import check_results
from figures import Figure

BENCH = Path(__file__).parents[2] / "bench"


def test_every_published_row_names_a_bench_that_exists():
    rows = check_results.published(check_results.RESULTS.read_text())
    assert len({row.name for row in rows}) == len(rows) >= 5
    for row in rows:
        script = row.command.split()[1]
        assert (BENCH.parent / script).is_file(), f"{row.name}: {script}"
        assert "emit(Figure(" in (BENCH.parent / script).read_text(), f"{script} prints no FIGURE line"


def test_a_figure_worse_by_more_than_the_tolerance_fails_in_its_direction():
    lower = check_results.Published("t.seconds", 10.0, "ratio", "lower", "python bench/x.py")
    higher = check_results.Published("t.rate", 100.0, "value", "higher", "python bench/x.py")
    assert check_results.verdict(lower, Figure("t.seconds", 50.0, "s", 4.0), 0.3) == (12.5, "ok")
    assert check_results.verdict(lower, Figure("t.seconds", 56.0, "s", 4.0), 0.3) == (14.0, "WORSE")
    assert check_results.verdict(higher, Figure("t.rate", 80.0, "/s"), 0.3) == (80.0, "ok")
    assert check_results.verdict(higher, Figure("t.rate", 70.0, "/s"), 0.3) == (70.0, "WORSE")
    assert check_results.verdict(lower, None, 0.3) == (None, "MISSING")
    assert check_results.verdict(lower, Figure("t.seconds", 50.0, "s"), 0.3) == (None, "MISSING"), "no baseline"


def test_saved_output_is_checked_end_to_end(tmp_path):
    """A saved bench output with one figure far worse than published: exit 1, the row says WORSE."""
    saved = tmp_path / "bench.out"
    saved.write_text(
        "some table\n"
        'FIGURE {"name": "interposer.traced_p50.sync.gpu_timing_off", "value": 500.0, "unit": "ns", '
        '"baseline": 100.0, "baseline_name": "direct"}\n'
    )
    done = subprocess.run([sys.executable, str(BENCH / "check_results.py"), "--from", str(saved)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 1, done.stderr
    line = next(line for line in done.stdout.splitlines() if "sync.gpu_timing_off" in line)
    assert line.split()[-1] == "WORSE" and line.split()[-2] == "5"
    assert "MISSING" in done.stdout, "figures no bench printed are named, never passed"
