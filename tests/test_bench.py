"""The benchmark harness itself: reproducible workloads, Poisson arrivals, a tiny end-to-end run."""

from __future__ import annotations

import statistics

import pytest

from nanoserve.tools import bench


def test_workload_is_reproducible_and_in_range():
    a = bench.make_workload(20, (3, 9), (2, 5), vocab=50, seed=1)
    b = bench.make_workload(20, (3, 9), (2, 5), vocab=50, seed=1)
    assert a[0] == b[0] and [p.max_tokens for p in a[1]] == [p.max_tokens for p in b[1]]
    assert all(3 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in a[0])
    assert all(2 <= p.max_tokens <= 5 and p.ignore_eos and p.temperature == 0 for p in a[1])


def test_poisson_arrivals_have_the_requested_rate():
    arr = bench.poisson_arrivals(4000, rate=8.0, seed=0)
    gaps = [b - a for a, b in zip(arr, arr[1:])]
    assert arr[0] == 0 and all(g >= 0 for g in gaps)
    assert abs(statistics.mean(gaps) - 1 / 8) < 0.01  # mean gap 1/rate (±3 standard errors)
    assert abs(statistics.stdev(gaps) - 1 / 8) < 0.015  # exponential: sd = mean


def test_throughput_end_to_end_on_a_tiny_model(hf_checkpoints, tmp_path):
    res = bench.throughput(model=str(hf_checkpoints["gpt2"][0]), n=6, in_range=(2, 6),
                           out_range=(2, 5),
                           batch_size=3, hf=True, out=str(tmp_path / "t.json"))
    s = res["strategies"]
    assert set(s) == {"static", "dynamic", "continuous", "hf_generate"}
    for name in ("static", "dynamic", "continuous"):
        assert s[name]["output_tokens"] == sum(
            p.max_tokens for p in bench.make_workload(6, (2, 6), (2, 5), 257)[1]
        )
    assert (tmp_path / "t.json").exists() and "continuous / HF" in bench.format_throughput(res)


def test_attention_benchmark_script_runs_in_smoke_mode(tmp_path):
    """benchmarks/bench_attention.py is for GPUs; its --smoke mode (tiny shapes, interpreter) keeps
    it from rotting."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
    out = tmp_path / "att.json"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)],
                          capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {"prefill", "paged_decode", "split_kv"} <= res.keys() and res["smoke"] is True
    assert all(r["ours_ms"] > 0 and r["sdpa_ms"] > 0 for r in res["prefill"])


def test_speculative_benchmark_end_to_end(tmp_path):
    """The real demo pair, tiny settings: every row is consistent, and the n-gram section runs."""
    out = tmp_path / "spec.json"
    res = bench.speculative(n=1, max_tokens=12, gammas=(1, 3), temperatures=(0.0,), out=str(out))
    rows = res["results"]["0.0"]["draft_model"]
    assert [r["gamma"] for r in rows] == [1, 3] and out.is_file()
    for r in rows + res["ngram"]["rows"]:
        assert r["output_tokens"] == 12 and r["num_emitted_tokens"] <= 12
        if r["num_steps"]:
            assert 1 <= r["tokens_per_step"] <= r["gamma"] + 1 and 0 <= r["alpha"] <= 1
    assert "predicted" in bench.format_speculative(res)


def run_quick(script: str, tmp_path, timeout: int = 240) -> tuple[dict, str]:
    """benchmarks/<script> --quick in a subprocess: (its JSON, its stdout)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(path), "--quick", "--out", str(out)],
                          capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_sliding_window_benchmark_quick_mode(tmp_path):
    """bench_sliding_window.py --quick: both engines give the same tokens, the freed one holds fewer
    blocks and no sequence more than ⌈window / block_size⌉ + 1."""
    res, stdout = run_quick("bench_sliding_window.py", tmp_path)
    freed, kept = res["engines"]["freed"], res["engines"]["kept"]
    assert res["same_tokens"] and freed["blocks_held"] < kept["blocks_held"]
    assert freed["blocks_per_seq"] <= res["bound_per_seq"] < kept["blocks_per_seq"]
    assert "output tok/s" in stdout


def test_async_step_benchmark_quick_mode(tmp_path):
    """bench_async_step.py --quick: both modes give the same tokens, and each step splits into a
    forward and the host's work (no speed is asserted)."""
    res, stdout = run_quick("bench_async_step.py", tmp_path)
    assert [(r["batch"], r["mode"]) for r in res["rows"]] == [(1, "sync"), (1, "async"),
                                                              (3, "sync"), (3, "async")]
    for row in res["rows"]:
        assert row["same_tokens"] and row["steady_steps"] > 0
        assert 0 < row["forward_ms"] < row["step_ms"] and 0 < row["host_share"] < 1
    assert "host_share" in stdout


def test_structured_outputs_benchmark_quick_mode(tmp_path):
    """bench_structured.py --quick runs both ways and records the mask's time inside the constrained
    steps (no speed is asserted: tests never depend on speed)."""
    pytest.importorskip("llguidance")
    res, stdout = run_quick("bench_structured.py", tmp_path)
    row = res["models"]["demo (vocab 257)"]
    assert row["mask_ms"] > 0 and 0 < row["mask_share"] < 1 and min(row["steps_measured"]) > 0
    assert "mask share" in stdout


@pytest.mark.shared
def test_kv_quant_benchmark_quick_mode(tmp_path):
    """bench_kv_quant.py --quick: every mode scores the held-out text and runs the capacity
    workload; a quantized pool holds more blocks in the same bytes (no speed or quality is asserted
    here)."""
    res, _ = run_quick("bench_kv_quant.py", tmp_path, timeout=600)
    assert set(res["quality"]["demo"]) == {"auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4"}
    cap = res["capacity"]
    assert all(
        cap[m]["num_blocks"] > cap["auto"]["num_blocks"]
        for m in ("int8", "fp8_e4m3", "fp8_e5m2", "int4")
    )
    assert cap["int4"]["num_blocks"] > cap["int8"]["num_blocks"]
