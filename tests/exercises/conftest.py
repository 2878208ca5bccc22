"""Exercise tests: one file per exercise, each run against two implementations.

    pytest tests/exercises                    # the reference, nanoserve itself: every test must pass
    pytest tests/exercises --impl exercises   # your code in exercises/ (what `make exercises` runs)
    pytest tests/exercises -m ex04            # one exercise (markers ex01 .. ex24)
    NANOSERVE_IMPL=exercises pytest ...       # --impl by environment
    NANOSERVE_EXERCISES=/tmp/solved pytest tests/exercises --impl exercises   # stubs from another folder

Each test file names the two modules it compares, `REFERENCE = "nanoserve.engine.block_allocator"`
and `EXERCISE = "block_allocator"` (exercises/block_allocator.py), and its tests take the `impl`
fixture: the module under test. Tests that take no `impl` check the tests themselves (known-wrong
variants must fail them, stubs must mirror the reference's signatures); they run with the reference
only.

CI proves the tests in both directions: against the reference they must pass, and against the
untouched stubs (`--impl exercises --expect-stubs`) every `impl` test is a strict xfail on
NotImplementedError — a test that passes on a stub, or fails with some other error, fails CI.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

# NANOSERVE_EXERCISES points elsewhere, e.g. at a copy with solutions filled in (to check a stub is
# solvable)
EXERCISES = Path(
    os.environ.get("NANOSERVE_EXERCISES") or Path(__file__).resolve().parents[2] / "exercises"
)


def load_exercise(name: str):
    """exercises/<name>.py as a module, loaded from its file (the repo root is not on sys.path)."""
    key = f"exercises.{name}"
    if key not in sys.modules:
        path = EXERCISES / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


def reference_module(test_module):
    return importlib.import_module(test_module.REFERENCE)


@pytest.fixture(scope="session")
def exercise_loader():
    """load_exercise, for tests that read the stubs themselves (conftest is not importable by
    name)."""
    return load_exercise


@pytest.fixture
def impl(request):
    """The module under test: nanoserve's (the reference) or exercises/<EXERCISE>.py."""
    if request.config.getoption("--impl") == "reference":
        return reference_module(request.module)
    return load_exercise(request.module.EXERCISE)


def pytest_collection_modifyitems(config, items):
    learner = config.getoption("--impl") != "reference"
    for item in items:
        if not str(item.path).startswith(str(Path(__file__).parent)):
            continue
        if "impl" not in item.fixturenames:
            if learner:
                item.add_marker(pytest.mark.skip(reason="checks the tests themselves; runs with "
                                                        "--impl reference"))
        elif config.getoption("--expect-stubs"):
            item.add_marker(pytest.mark.xfail(raises=NotImplementedError, strict=True,
                                              reason="an untouched stub must raise "
                                                     "NotImplementedError"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A stub's NotImplementedError is a to-do, not a crash: show its hint in one line."""
    outcome = yield
    report = outcome.get_result()
    if (
        call.excinfo is not None
        and call.excinfo.errisinstance(NotImplementedError)
        and report.failed
        and item.config.getoption("--impl") != "reference"
    ):
        report.longrepr = f"TODO {call.excinfo.value}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With --impl exercises: one line per exercise, how many of its tests pass."""
    if config.getoption("--impl") == "reference" or config.getoption("--expect-stubs"):
        return
    by_ex: dict[str, list[str]] = {}
    for outcome in ("passed", "failed", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if rep.when != "call" and outcome != "error":
                continue
            name = rep.nodeid.split("::")[-1]
            ex = name.split("_")[1] if name.startswith("test_ex") else "?"
            by_ex.setdefault(ex, []).append(outcome)
    if not by_ex:
        return
    terminalreporter.section("your exercises")
    for ex in sorted(by_ex):
        results = by_ex[ex]
        done = results.count("passed")
        mark = "done" if done == len(results) else ("to do" if done == 0 else "in progress")
        terminalreporter.write_line(f"{ex}: {done:2d} / {len(results):2d} tests pass   {mark}")
