"""Failures that explain: the exercise tests' comparisons, each failing with the case it ran, what
was expected and what came back — at the worst element, with NaNs counted rather than printed.

    expect_close(got, want, "naive_attention, decode at position 4", atol=1e-5)
    expect_equal(mask, want, "causal_mask(q_positions=[[0, 2], [3, 4]], S=5)")

A message is a few lines however big the tensors: the case, then "expected ..., got ..." (whole
vectors when they are short, the worst element otherwise), then how many elements are off.
tests/exercises/test_explanations.py runs every known-wrong variant of every exercise and checks
that its first failure reads this way.
"""

from __future__ import annotations

import torch

SHORT = 12  # a tensor with at most this many elements is printed whole


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def show(t: torch.Tensor) -> str:
    """A short text of a tensor: its values when small, else its shape and NaN / inf counts."""
    t = t.detach().cpu()
    if t.numel() <= SHORT:
        if t.dtype == torch.bool:
            return "".join("1" if bool(x) else "0" for x in t.flatten())
        return "[" + ", ".join(_fmt(float(x)) for x in t.flatten()) + "]"
    return f"a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor{_special(t)}"


def _special(t: torch.Tensor) -> str:
    if not t.is_floating_point():
        return ""
    nan, inf = int(t.isnan().sum()), int(t.isinf().sum())
    parts = [f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "±inf")) if n]
    return f" with {' and '.join(parts)} of {t.numel()}" if parts else ""


def _index(flat: int, shape: torch.Size) -> list[int]:
    return [int(i) for i in torch.unravel_index(torch.tensor(flat), shape)]


def _shape_problem(got, want, case: str) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{case}: expected a tensor of shape {tuple(want.shape)}, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"{case}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}"
    return None


def _at(index: list[int], dims: str | None) -> str:
    return f"[{dims}] = {index}" if dims else f"{index}"


def expect_close(got, want: torch.Tensor, case: str, *, atol: float, rtol: float = 0.0,
                 dims: str | None = None) -> None:
    """|got − want| ≤ atol + rtol·|want| everywhere, compared in float64; else an AssertionError
    naming `case`, the worst element (index, expected, got) and how many are off. `dims` names the
    dimensions in the message ("b, t, h, d")."""
    problem = _shape_problem(got, want, case)
    if problem:
        raise AssertionError(problem)
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    bad = (g - w).abs() > atol + rtol * w.abs()
    bad |= g.isnan() != w.isnan()
    if not bool(bad.any()):
        return
    lines = [f"{case}:"]
    if g.isnan().any() and not w.isnan().any():
        first = _index(int(g.isnan().flatten().nonzero()[0]), g.shape)
        lines.append(f"  got NaN in {int(g.isnan().sum())} of {g.numel()} values (first at "
                     f"{_at(first, dims)});"
                     " expected none — a row whose scores are all -inf? a division by zero?")
    if g.numel() <= SHORT:
        lines.append(f"  expected {show(w)}")
        lines.append(f"  got      {show(g)}")
    else:
        diff = (g - w).abs().nan_to_num(nan=float("inf")).masked_fill(~bad, -1.0)
        worst = int(diff.flatten().argmax())
        at = _index(worst, g.shape)
        lines.append(f"  worst at {_at(at, dims)}: expected {_fmt(float(w.flatten()[worst]))}, "
                     f"got {_fmt(float(g.flatten()[worst]))}")
    lines.append(f"  {int(bad.sum())} of {g.numel()} values off by more than "
                 f"{_fmt(atol)}{f' + {_fmt(rtol)}·|expected|' if rtol else ''}")
    raise AssertionError("\n".join(lines))


def expect_equal(got, want: torch.Tensor, case: str, rows: tuple[str, str] = ("row", "rows"),
                 dims: str | None = None) -> None:
    """Exactly equal (booleans, integers); else the first differing row (the last dimension,
    printed whole when short; `rows`: its name, singular and plural), expected and got."""
    problem = _shape_problem(got, want, case)
    if problem:
        raise AssertionError(problem)
    if got.dtype != want.dtype:
        raise AssertionError(f"{case}: expected dtype {want.dtype}, got {got.dtype}")
    if torch.equal(got, want):
        return
    g, w = got.detach().cpu(), want.detach().cpu()
    if g.dim() == 0 or g.shape[-1] > SHORT:
        flat = int((g != w).flatten().nonzero()[0])
        at = _index(flat, g.shape)
        raise AssertionError(f"{case}: first difference at {_at(at, dims)}: expected "
                             f"{w.flatten()[flat].item()}, got {g.flatten()[flat].item()}")
    differing = (g != w).reshape(-1, g.shape[-1]).any(-1).nonzero().flatten().tolist()
    first = differing[0]
    at = _index(first, g.shape[:-1]) if g.dim() > 1 else []
    raise AssertionError(
        f"{case}: {len(differing)} of {g.numel() // g.shape[-1]} {rows[1]} differ; the first, "
        f"{rows[0]} {_at(at, dims)}:\n  expected {show(w.reshape(-1, g.shape[-1])[first])}\n"
        f"  got      {show(g.reshape(-1, g.shape[-1])[first])}")


def expect(condition: bool, case: str, expected, got) -> None:
    """A scalar fact: `case`: expected ..., got ...."""
    if not condition:
        raise AssertionError(f"{case}: expected {expected}, got {got}")


def own_lines(message: str) -> list[str]:
    """The message's lines without the introspection pytest appends to a failing `assert cond, msg`
    (from its line "assert ..."; pytest shows more of it when CI is set)."""
    lines = message.strip().splitlines()
    for index, line in enumerate(lines):
        if index and line.startswith("assert "):
            return lines[:index]
    return lines


def explanation_problems(message: str) -> list[str]:
    """What keeps a failure message from explaining itself (empty: nothing). Its own lines count;
    pytest's introspection after them may show values, never a tensor printed whole."""
    lines = own_lines(message)
    problems = []
    if not lines:
        problems.append("no message at all")
    lowered = "\n".join(lines).lower()
    for word in ("expected", "got"):
        if word not in lowered:
            problems.append(f"no '{word}'")
    if len(lines) > 12:
        problems.append(f"{len(lines)} lines (at most 12)")
    if "tensor(" in message or "nan, nan" in lowered:
        problems.append("a tensor printed whole")
    return problems


def explained_failure(check, *args) -> str:
    """check(*args) must fail (args: a known-wrong variant) with a message that explains itself:
    the case, what was expected, what came back, in a few lines. Returns the message."""
    try:
        check(*args)
    except AssertionError as failure:
        message = str(failure)
    else:
        raise AssertionError(f"{check.__name__} passed a known-wrong variant")
    problems = explanation_problems(message)
    assert not problems, (f"{check.__name__}'s failure does not explain itself ({problems}):\n"
                          f"{message}")
    return message
