"""Time every notebook top to bottom and write the "runs in" column of notebooks/README.md.

    .venv/bin/python scripts/notebook_times.py            # run all, print, write the README
    .venv/bin/python scripts/notebook_times.py 03 90      # only these (their rows are rewritten)

Each notebook runs as `make notebooks` runs it (`jupyter nbconvert --execute`, kernel start-up
included) but into a temporary copy, so the committed outputs stay as they are. The line under
the table names the machine, the date and this command: the times are a measurement, not a
promise (CI allows each notebook 60 s; a busy machine takes longer).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
README = NOTEBOOKS / "README.md"
# a row of the course table: | 03 | [batching](03_batching.ipynb) | ... | runs in | exercises |
ROW = re.compile(r"^\| (\d\d) \| \[.+?\]\((\d\d_\w+\.ipynb)\) \|")
MEASURED = re.compile(r"^\"runs in\" is .*$", re.M)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_seconds(notebook: Path) -> float:
    """Wall-clock seconds of one top-to-bottom run, outputs written to a temporary file."""
    jupyter = Path(sys.executable).parent / "jupyter"
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run([str(jupyter), "nbconvert", "--to", "notebook", "--execute",
                        "--output-dir", out, str(notebook)], cwd=NOTEBOOKS, check=True,
                       capture_output=True)
        return time.perf_counter() - start


def set_time(row: str, seconds: float) -> str:
    """`row` with its second-to-last cell (runs in) replaced."""
    cells = row.split(" | ")
    cells[-2] = f"{seconds:.0f} s"
    return " | ".join(cells)


def machine_line(command: str) -> str:
    return (f'"runs in" is the wall-clock time of a top-to-bottom run, kernel start-up included, '
            f"measured by `{command}` on {os.cpu_count()} cores of an {cpu_name()} "
            f"({datetime.date.today().isoformat()}, torch threads as each notebook sets them).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="notebook numbers (default: all)")
    args = parser.parse_args()
    lines = README.read_text().split("\n")
    times = {}
    for index, line in enumerate(lines):
        match = ROW.match(line)
        if not match or (args.only and match.group(1) not in args.only):
            continue
        times[match.group(2)] = run_seconds(NOTEBOOKS / match.group(2))
        lines[index] = set_time(line, times[match.group(2)])
        print(f"{match.group(2):36s} {times[match.group(2)]:6.1f} s", flush=True)
    command = "python scripts/notebook_times.py"
    text, count = MEASURED.subn(machine_line(command), "\n".join(lines))
    if count != 1:
        raise SystemExit(f"{README}: expected one line starting '\"runs in\" is', found {count}")
    README.write_text(text)


if __name__ == "__main__":
    main()
