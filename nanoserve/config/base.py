"""What every section of the engine's config uses: checks that refuse a bad value by its setting's
name, saying what is allowed, and `EngineArg`, one row of the table that maps a flat keyword
argument (`max_num_seqs=8`, `--max-num-seqs 8`) to its section and field (config/args.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError


def check_int(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    """Raise NanoserveError unless `value` is an int ≥ `minimum` (or None, when `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer ≥ {minimum}" + (" or None" if optional else "")
        raise NanoserveError(f"{name}={value!r} must be {allowed}")


def check_choice(name: str, value, allowed: tuple, optional: bool = False) -> None:
    """Raise NanoserveError unless `value` is one of `allowed` (or None, when `optional`)."""
    if optional and value is None:
        return
    if value not in allowed:
        none = "None (the default), " if optional else ""
        raise NanoserveError(f"{name}={value!r}; allowed: {none}{', '.join(allowed)}")


@dataclass(frozen=True)
class EngineArg:
    """One flat keyword argument: the section and field it sets, and its help for the command line
    (cli=False: Python only, as a list or an object cannot be typed on a command line)."""

    section: str
    field: str
    help: str
    cli: bool = True
    choices: tuple = ()  # the values allowed, where they are a list of names


def arg(section: str, name: str, help: str, cli: bool = True, choices: tuple = ()) -> EngineArg:
    return EngineArg(section, name, help, cli, choices)


def flat_name(args: dict[str, EngineArg], section: str, field_name: str) -> str:
    """The keyword argument in `args` that sets `section`.`field_name` (the table, read
    backwards)."""
    for name, row in args.items():
        if (row.section, row.field) == (section, field_name):
            return name
    return field_name
