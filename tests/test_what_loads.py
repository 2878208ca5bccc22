"""README's "What loads" table is the code's (scripts/what_loads.py writes it from
nanoserve.models.family.what_loads): a family added without re-running the script fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from nanoserve.models.family import Family, families, what_loads
from nanoserve.models.hf_config import SUPPORTED_ARCHITECTURES, hf_model_type

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("what_loads", ROOT / "scripts" / "what_loads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_holds_the_current_table():
    assert _script().block() in (ROOT / "README.md").read_text(), (
        "run: python scripts/what_loads.py --write")


def test_every_architecture_that_loads_has_a_row_with_a_name_and_a_summary():
    listed = {arch for _, archs, _ in what_loads() for arch in archs}
    registered = {arch for fam in families().values() for arch in fam.architectures}
    assert listed == set(SUPPORTED_ARCHITECTURES) | registered
    for arch in listed:  # each row's architecture is one the config reader accepts
        assert hf_model_type({"architectures": [arch]})
    for name, _, summary in what_loads():  # a "|" would split the markdown table's cell
        assert name and summary and "|" not in name + summary, (name, summary)


def test_a_family_added_without_rewriting_the_readme_is_caught(monkeypatch):
    """Negative control: one more registered family changes the table, so the README check fails."""
    script = _script()
    before = script.block()
    extra = Family(model_type="zz_test", architectures=("ZzForCausalLM",), hf_config_class="",
                   fields={}, config=dict, model_class=dict, name="Zz", summary="a test row")
    monkeypatch.setitem(families(), "zz_test", extra)
    assert script.block() != before
    assert script.block() not in (ROOT / "README.md").read_text()
