"""benchmarks/bench_peers.py (nanoserve vs HF, vLLM, llama.cpp), bench_step_time.py, bench_lora.py,
bench_spec_methods.py and bench_tp.py: their --quick modes keep the scripts from rotting.

Quick mode runs nanoserve and HF only, on tiny models, one round; the peers (which live in their own
virtualenvs, never installed for the tests) are recorded as skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_peers.py"


def test_bench_peers_quick_mode_writes_the_results_json(tmp_path):
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                          capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["quick"] is True and res["command"].startswith(
        "python benchmarks/bench_peers.py --quick"
    )
    assert {"torch", "transformers", "python"} <= res["versions"].keys()
    assert {"cpu", "cores", "threads", "loadavg_before", "loadavg_after"} <= res["machine"].keys()
    assert list(res["workloads"]) == ["single", "demo64", "gpt2-256"]
    for name, w in res["workloads"].items():
        assert (
            w["requests"] >= 1 and w["rounds"] == 1 and w["wall_s"] > 0 and w["output_tokens"] > 0
        )
        engines = w["engines"]
        assert set(engines) == {"nanoserve", "hf_generate", "vllm", "llamacpp"}, name
        for peer in ("vllm", "llamacpp"):
            assert engines[peer]["status"] == "skipped" and engines[peer]["reason"], (name, peer)
        for eng in ("nanoserve", "hf_generate"):
            e = engines[eng]
            assert e["status"] == "ok" and len(e["tok_s"]) == 1 and e["median_tok_s"] > 0, (
                name,
                eng,
            )
            assert 0 <= e["same_tokens_as_hf"] <= 1 and e["nanoserve_over_this"] > 0
        assert engines["hf_generate"]["same_tokens_as_hf"] == 1  # the reference
        steps = engines["nanoserve"]["engine_steps"]
        assert len(steps) == 1 and steps[0]["steps"] >= 1 and steps[0]["step_s"] > 0
    assert "nanoserve" in proc.stdout and "skipped" in proc.stdout  # the printed table


def test_bench_step_time_quick_mode_adds_its_series(tmp_path):
    out = tmp_path / "steps.json"
    script = SCRIPT.parent / "bench_step_time.py"
    for label in ("first", "second"):  # a second run adds its series beside the first
        proc = subprocess.run([sys.executable, str(script), "--quick", "--label", label, "--out", str(out),
                               "--cache-dir", str(tmp_path / "cache")], capture_output=True,
                              text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["series"]) == {"first", "second"}
    for s in res["series"].values():
        assert s["engine"] == "nanoserve" and s["rev"] == "working tree"
        assert [(p["sweep"], p["batch"], p["context"]) for p in s["points"]] == [
            ("batch", 1, 8), ("batch", 3, 8), ("context", 2, 8), ("context", 2, 16)]
        for p in s["points"]:
            # exactly K decode steps after the prefill
            assert p["steps"] == res["k"] and p["step_ms"] > 0


def test_bench_lora_quick_mode_times_every_config(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "bench_lora.py"), "--quick", "--out", str(out),
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(p["config"], p["batch"]) for p in res["points"]] == [
        (c, b) for c in ("base", "merged r=4", "unmerged r=4") for b in (1, 2)]
    assert all(p["step_ms"] > 0 for p in res["points"])
    assert "unmerged r=4" in proc.stdout  # the printed table
    assert [(p["method"], p["distinct"]) for p in res["distinct"]["points"]] == [
        (m, d) for m in ("segmented", "gathered", "auto") for d in (0, 1, 4)]


def test_bench_spec_methods_quick_mode_runs_every_proposer(tmp_path):
    out = tmp_path / "spec.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "bench_spec_methods.py"), "--quick", "--out",
                           str(out), "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    methods = ("draft model", "n-gram", "Medusa", "EAGLE", "Medusa tree")
    assert [r["engine"] for r in res["rows"]] == ["target alone"] + [
        f"{m}, {c}" for m in methods for c in ("γ = 3", "controller")]
    # greedy: every proposer keeps the target's tokens
    assert all(r["same_tokens_as_target"] for r in res["rows"])
    assert res["rows"][1]["spec_steps"] > 0 and "Medusa, γ = 3" in proc.stdout


def test_bench_tp_quick_mode_counts_what_it_exchanges(tmp_path):
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "bench_tp.py"), "--quick", "--out", str(out),
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["tokens"]) for r in rows] == [(1, 1), (1, 8), (2, 1), (2, 8)]
    for r in rows:  # the bytes the wrapped collectives moved are the formula's, per token
        assert r["comm_bytes_per_token_measured"] == r["comm_bytes_per_token_computed"]
        assert r["forward_ms"] > 0 and (r["comm_calls"] > 0) == (r["tp"] == 2)


def test_bench_tp_engine_quick_mode_runs_every_split(tmp_path):
    out = tmp_path / "tp_engine.json"
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "bench_tp_engine.py"), "--quick",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["split"], r["ranks"]) for r in rows] == [("none", 1), ("tensor", 2), ("pipeline", 2)]
    assert all(r["same_tokens_as_one_process"] for r in rows)
