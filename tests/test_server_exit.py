"""`nanoserve serve` whose engine dies stops by itself (nanoserve/serving/server.py, serve).

The real command in a subprocess, with its model split over 2 processes (--pipeline-parallel-size
2): it serves; its worker is killed; the request that finds the dead worker gets a 500 naming the
rank; then the server finishes what is in flight and exits with status 1, its last words naming the
error — where a server left up would answer 503 forever. Every wait reads the server's own output or
waits on its exit (deadlines, no sleeps). The in-process behaviour (500, then 503 and /health 503)
is tests/test_tensor_parallel_engine.py's.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nanoserve.parallel.launch import free_port

DEADLINE = 180  # seconds: no wait here is longer


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The server's stderr, a line at a time, from a thread (None at its end). A select() on the
    pipe cannot tell what readline() already buffered: lines read in one chunk would wait there,
    unseen, until the deadline."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _read_until(lines: queue.Queue, needle: str, seen: list[str]) -> None:
    """The server's lines until one holds `needle` (fails at the deadline or at its exit)."""
    end = time.monotonic() + DEADLINE
    while True:
        try:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {needle!r} from the server in {DEADLINE} s: "
                                 f"{''.join(seen)[-2000:]}") from None
        assert line is not None, f"the server exited before {needle!r}: {''.join(seen)[-2000:]}"
        seen.append(line)
        if needle in line:
            return


def _children(pid: int) -> list[int]:
    return [
        int(c) for t in Path(f"/proc/{pid}/task").iterdir()
        for c in (t / "children").read_text().split()
    ]


def test_the_server_exits_by_itself_when_its_engine_dies():
    pytest.importorskip("uvicorn")
    port, seen = free_port(), []
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--model", "demo",
                             "--port", str(port),
                             "--pipeline-parallel-size", "2", "--log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = _lines(proc)
        _read_until(lines, "Uvicorn running on", seen)
        body = json.dumps({"model": "demo", "prompt": "ROMEO:", "max_tokens": 4,
                           "temperature": 0}).encode()
        ask = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(ask, timeout=DEADLINE) as answer:
                assert answer.status == 200
        except urllib.error.HTTPError as e:
            # say what the server said (its answer and its log so far)
            raise AssertionError(f"first request: {e.code} "
                                 f"{e.read().decode()[:2000]}\n{''.join(seen)[-3000:]}") from e
        workers = [
            p for p in _children(proc.pid)
            if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
            and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(ask, timeout=DEADLINE)
        assert failed.value.code == 500 and "rank 1 (exit code -9)" in failed.value.read().decode()
        assert proc.wait(timeout=DEADLINE) == 1
        rest = iter(lambda: lines.get(timeout=DEADLINE), None)  # (the thread ends with the pipe)
        last_words = "".join(seen) + "".join(rest)
        assert (
            "the engine failed (WorkerGroupError" in last_words
            and "the server stopped" in last_words
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
