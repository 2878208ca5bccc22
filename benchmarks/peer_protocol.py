"""The small line protocol between benchmarks/bench_peers.py and a peer runner (peer_vllm.py,
peer_llamacpp.py).

A runner runs in the peer's own virtualenv (benchmarks/.peers/NAME) and imports nothing from
nanoserve:

    python peer_NAME.py SPEC.json
        SPEC: {"model_dir", "gguf_path", "ctx", "threads", "prompts": [[id, ...], ...], "max_tokens": [n, ...]}
    -> @@READY {"engine", "version", "load_s", "settings": {...}}     once the model is loaded
    <- {"cmd": "run", "n": 4, "cap": 8, "tokens": false}           run the first n requests (all when absent), each
                                                                   with max_tokens capped at cap (for warm-ups)
    -> @@RESULT {"seconds", "output_tokens", "tokens": [[...]] | null}
    <- {"cmd": "quit"}

Every other line a library prints on stdout is not ours (the parent logs it); errors are "@@ERROR
message". `serve` is the runner's side (stdlib only: it runs in the peers' venvs), `Peer` the
benchmark's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

PREFIX = "@@"


def send(kind: str, payload) -> None:
    sys.stdout.write(f"{PREFIX}{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()


def serve(load, run) -> None:
    """The runner side. load(spec) -> (engine, info); run(engine, prompts, max_tokens) -> (seconds,
    token lists)."""
    try:
        with open(sys.argv[1]) as f:
            spec = json.load(f)
        engine, info = load(spec)
        send("READY", info)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                return
            n = cmd.get("n") or len(spec["prompts"])
            cap = cmd.get("cap")
            max_tokens = [m if cap is None else min(m, cap) for m in spec["max_tokens"][:n]]
            seconds, tokens = run(engine, spec["prompts"][:n], max_tokens)
            send("RESULT", {"seconds": seconds, "output_tokens": sum(len(t) for t in tokens),
                            "tokens": tokens if cmd.get("tokens") else None})
    except Exception as e:  # the parent prints this line and skips the peer
        traceback.print_exc(file=sys.stderr)
        send("ERROR", f"{type(e).__name__}: {e}".splitlines()[0][:300])
        sys.exit(1)


class Peer:
    """A peer runner in its own venv, kept alive across the rounds of one workload."""

    def __init__(self, name: str, here: Path, spec: dict, cache: Path):
        self.name, py = name, here / ".peers" / name / "bin" / "python"
        if not py.exists():
            raise RuntimeError(f"no venv at {py.parent.parent} (bash benchmarks/peers_setup.sh "
                               f"{name})")
        spec_path = cache / f"spec-{name}.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        if name == "vllm":  # what vLLM's CPU docs ask for, when both libraries are there
            libs = [*Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4"),
                    *py.parent.parent.glob("lib/libiomp5.so")]
            if len(libs) == 2:
                env["LD_PRELOAD"] = ":".join(map(str, libs))
        self.log = open(cache / f"{name}.log", "a")
        self.proc = subprocess.Popen(
            [str(py), str(here / f"peer_{name}.py"), str(spec_path)], cwd=here, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        self.info = self._read("READY")
        self.info.setdefault("settings", {})["LD_PRELOAD"] = env.get("LD_PRELOAD")

    def _read(self, kind):
        for line in self.proc.stdout:
            if line.startswith("@@ERROR"):
                self.close()
                raise RuntimeError(json.loads(line.split(" ", 1)[1]))
            if line.startswith(f"@@{kind} "):
                return json.loads(line.split(" ", 1)[1])
            self.log.write(line)
        self.close()
        raise RuntimeError(f"runner exited (code {self.proc.wait()}), see {self.log.name}")

    def run(self, n=None, cap=None, tokens=False):
        self.proc.stdin.write(json.dumps({"cmd": "run", "n": n, "cap": cap,
                                          "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT")

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()
