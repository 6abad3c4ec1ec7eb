"""Are the published figures still true? Runs the benches of RESULTS.md's "Headline figures" table (or
reads their saved output), and compares each figure with the one published: a figure worse by more than
the tolerance (30%) fails. Run by hand and before each release, on a quiet machine; not in `make test`
(a test must pass on a busy machine, a figure needs a quiet one).

    .venv/bin/python bench/check_results.py                     # runs every bench of the table
    make bench | tee bench.out; .venv/bin/python bench/check_results.py --from bench.out
    .venv/bin/python bench/check_results.py --only analysis.    # the rows of one bench (runs only it)

Figures that load moves are published and compared as their ratio to a baseline measured in the same
run (see bench/figures.py); the others as values. Exit code 1 when one is worse or missing.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from figures import Figure, parse  # bench/ is the script's own folder, first on sys.path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
TABLE_HEADING = "## Headline figures"
TOLERANCE = 0.30


@dataclass(frozen=True)
class Published:
    name: str
    value: float
    compared: str  # "ratio" or "value"
    better: str  # "lower" or "higher"
    command: str


def published(results: str) -> list[Published]:
    """The rows of the "Headline figures" table: | `name` | number | ratio/value ... | lower/higher | `command` |."""
    if TABLE_HEADING not in results:
        raise ValueError(f"{RESULTS.name} has no {TABLE_HEADING!r} section")
    section = results.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not cells[0].startswith("`"):
            continue
        name, number, compared, better, command = cells[:5]
        compared, better = re.findall(r"[a-z]+", compared)[0], re.findall(r"[a-z]+", better)[0]
        if compared not in ("ratio", "value") or better not in ("lower", "higher"):
            raise ValueError(f"headline row {name}: compare 'ratio' or 'value', better 'lower' or 'higher'")
        value = float(re.sub(r"[^\d.eE+-]", "", number))
        rows.append(Published(name.strip("`"), value, compared, better, command.strip("`")))
    if not rows:
        raise ValueError(f"the {TABLE_HEADING!r} table of {RESULTS.name} has no rows")
    return rows


def verdict(row: Published, figure: Figure | None, tolerance: float) -> tuple[float | None, str]:
    """(measured, 'ok' / 'WORSE' / 'MISSING') for one published row."""
    if figure is None:
        return None, "MISSING"
    measured = figure.ratio if row.compared == "ratio" else figure.value
    if measured is None:
        return None, "MISSING"
    worse = measured > row.value * (1 + tolerance) if row.better == "lower" else measured < row.value / (1 + tolerance)
    return measured, "WORSE" if worse else "ok"


def run_benches(rows: list[Published]) -> str:
    output = []
    for command in dict.fromkeys(row.command for row in rows):
        print(f"$ {command}", file=sys.stderr, flush=True)
        argv = shlex.split(command)
        if argv[0].endswith("python"):
            argv[0] = sys.executable
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            output.append(f"# {command} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        output.append(done.stdout)
    return "\n".join(output)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="saved", type=Path, nargs="*", help="saved bench output instead of running")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--only", default="", help="the rows whose figure name starts with this")
    args = parser.parse_args()
    try:
        rows = [row for row in published(RESULTS.read_text()) if row.name.startswith(args.only)]
    except ValueError as error:
        print(f"check_results: {error}", file=sys.stderr)
        return 2
    if not rows:
        print(f"check_results: no published figure starts with {args.only!r}", file=sys.stderr)
        return 2
    text = "\n".join(path.read_text() for path in args.saved) if args.saved else run_benches(rows)
    figures = parse(text)
    failed = False
    print(f"{'figure':<44} {'compared':<8} {'published':>10} {'measured':>10}  verdict")
    for row in rows:
        measured, word = verdict(row, figures.get(row.name), args.tolerance)
        failed |= word != "ok"
        shown = "-" if measured is None else f"{measured:.3g}"
        print(f"{row.name:<44} {row.compared:<8} {row.value:>10.3g} {shown:>10}  {word}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
