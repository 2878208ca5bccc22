"""The engine's outputs on a fixed workload are the ones recorded before the layout redesign
(tests/engine_workload.py): greedy and seeded sampling, per-prompt parameters, n > 1, stop strings,
prefix-cache hits, chunked prefill with preemption, speculation with a draft model and with n-gram
lookup, on the demo model and on stories260K — token for token."""

from __future__ import annotations

import json

import pytest
from engine_workload import GOLDEN, run
from testdata import shared_path


@pytest.fixture(scope="module")
def outputs():
    return run(str(shared_path("models", "stories260K", "stories260K.bin")))


@pytest.mark.slow
def test_every_output_equals_the_recorded_one(outputs):
    golden = json.loads(GOLDEN.read_text())
    assert sorted(outputs) == sorted(golden)
    for case, expected in golden.items():
        assert outputs[case] == expected, case


def test_the_workload_reaches_what_it_claims(outputs):
    """The cases are not vacuous: prefix hits, preemptions and n samples happened."""
    assert outputs["preemption_count"] > 0
    assert sum(outputs["prefix_hits_cached_tokens"][3:]) > sum(
        outputs["prefix_hits_cached_tokens"][:3]
    )
    assert all(len(samples) == 3 for samples in outputs["n3"])
    assert outputs["spec_draft_greedy"] == outputs["greedy"]  # speculation keeps greedy outputs
