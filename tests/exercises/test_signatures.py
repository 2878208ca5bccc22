"""The stubs in exercises/ mirror the reference: the same names and signatures, and every body a
NotImplementedError whose message says which exercise it is, how long, and where it is taught.

The pairs come from the exercise test files themselves (their REFERENCE and EXERCISE), so a new
exercise is checked as soon as its test file exists.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# the stubs as committed (not NANOSERVE_EXERCISES: those are solved)
EXERCISES = HERE.parents[1] / "exercises"
HINT = re.compile(
    r"^Exercise (\d+)\.(\d+): .+ \(roughly \d+ lines?; see notebooks/\d\d_\w+, sections? .+\)$",
    re.S,
)


def _pairs() -> list[tuple[str, str, str]]:
    """(test file, reference module, exercise name) for every exercise test file."""
    out = []
    for path in sorted(HERE.glob("test_ex*.py")):
        text = path.read_text()
        ref, ex = (
            re.search(rf'^{key} = "([\w.]+)"$', text, re.M) for key in ("REFERENCE", "EXERCISE")
        )
        assert ref and ex, f"{path.name} must define REFERENCE = '...' and EXERCISE = '...'"
        out.append((path.stem, ref.group(1), ex.group(1)))
    return out


PAIRS = _pairs()


def _own(module, obj) -> bool:
    return getattr(obj, "__module__", None) == module.__name__


def _params(sig: inspect.Signature) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _stubbed_functions(module):
    """(qualified name, stub function, reference lookup path) of every function the stub defines."""
    for name, obj in vars(module).items():
        if inspect.isfunction(obj) and _own(module, obj):
            yield name, obj, (name,)
        elif inspect.isclass(obj) and _own(module, obj):
            for attr, member in vars(obj).items():
                if inspect.isfunction(member):
                    yield f"{name}.{attr}", member, (name, attr)


@pytest.mark.parametrize("test_file, reference, exercise", PAIRS, ids=[p[0] for p in PAIRS])
def test_stub_names_and_signatures_match_the_reference(test_file, reference, exercise,
                                                       exercise_loader):
    stub, ref = exercise_loader(exercise), importlib.import_module(reference)
    found = list(_stubbed_functions(stub))
    assert found, f"exercises/{exercise}.py defines no function to implement"
    for qualname, fn, path in found:
        target = ref
        for part in path:
            assert hasattr(target, part), (
                f"exercises/{exercise}.py defines {qualname}, which {reference} does not have"
            )
            target = getattr(target, part)
        assert _params(inspect.signature(fn)) == _params(inspect.signature(target)), (
            f"{qualname}: the stub's signature {inspect.signature(fn)} differs from the "
            f"reference's {inspect.signature(target)}")


@pytest.mark.parametrize("test_file, reference, exercise", PAIRS, ids=[p[0] for p in PAIRS])
def test_every_stub_body_raises_a_hint(test_file, reference, exercise):
    """Each function a stub defines raises NotImplementedError("Exercise N.M: ... (roughly K lines;
    see notebooks/NN_..., section ...)"), and the exercise number is the test file's."""
    number = int(re.match(r"test_ex(\d+)", test_file).group(1))
    tree = ast.parse((EXERCISES / f"{exercise}.py").read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    hints = {}
    for fn in functions:
        raises = [
            n for n in ast.walk(fn) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)
            and getattr(n.exc.func, "id", None) == "NotImplementedError"
        ]
        assert raises, f"exercises/{exercise}.py: {fn.name} does not raise NotImplementedError"
        message = ast.literal_eval(raises[0].exc.args[0])
        m = HINT.match(message)
        assert m, (
            f"{fn.name}: the hint {message!r} does not read 'Exercise N.M: ... (roughly K lines; see "
            "notebooks/NN_name, section ...)'"
        )
        hints[fn.name] = (int(m.group(1)), int(m.group(2)))
    # a stub file may hold two exercises (layers.py: 1 and 2)
    numbers = {n for n, _ in hints.values()}
    assert number in numbers, (
        f"{test_file} tests exercise {number}; exercises/{exercise}.py has {sorted(numbers)}"
    )
    for notebook in re.findall(r"notebooks/(\d\d_\w+)", (EXERCISES / f"{exercise}.py").read_text()):
        assert (EXERCISES.parent / "notebooks" / f"{notebook}.ipynb").is_file(), (
            f"no notebook {notebook}"
        )


def test_every_exercise_file_has_a_test_file():
    tested = {ex for _, _, ex in PAIRS}
    stubs = {p.stem for p in EXERCISES.glob("*.py") if not p.name.startswith("_")}
    assert stubs <= tested, f"exercises without tests: {sorted(stubs - tested)}"
