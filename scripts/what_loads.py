"""The README's "What loads" table, written from the code's own tables (so it cannot drift).

    python scripts/what_loads.py           print the table
    python scripts/what_loads.py --write   put it between the markers in README.md

Rows come from `nanoserve.models.family.what_loads()`: the built-in families of hf_config.py, then
every family module under nanoserve/models/families/ (tests/test_what_loads.py checks README.md
holds the current table).
"""

from __future__ import annotations

import argparse
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- what-loads:start -->", "<!-- what-loads:end -->"


def table() -> str:
    from nanoserve.models.family import what_loads

    lines = ["| family | HF `architectures` | what it adds |", "|---|---|---|"]
    for name, archs, summary in what_loads():
        names = ", ".join(f"`{a}`" for a in archs)
        lines.append(f"| {name} | {names} | {summary} |")
    return "\n".join(lines)


def block() -> str:
    return f"{START}\n{table()}\n{END}"


def write() -> None:
    text = README.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"README.md has no {START} marker")
    README.write_text(head + block() + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the table into README.md")
    if parser.parse_args().write:
        write()
    else:
        print(table())


if __name__ == "__main__":
    main()
