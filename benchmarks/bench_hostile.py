"""What one hostile request does to everyone else: a bystander stream's gaps and /health's answers.

    python benchmarks/bench_hostile.py [--tree DIR] [--out benchmarks/hostile.json]

Starts `python -m nanoserve serve --model demo` (from DIR's nanoserve when given: an older checkout,
for a before / after), then for each attack: a bystander streams 100 greedy tokens; once its first
token is in, the attack is sent from another thread while a third asks /health over and over. It
records the attack's status and time, the bystander's largest gap between tokens against its largest
gap alone (the same stream, no attack, just before), and /health's slowest answer. An attack that
kills the server ends the run (it is the last one). Saves JSON and prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEY = "bench-key"
CHAIN = "start: r0\n" + "".join(f'r{i}: r{i + 1} | "a"\n' for i in range(3000)) + 'r3000: "b"\n'
WORDS = "start: " + " | ".join(f'"w{i}"' for i in range(100_000)) + "\n"


def attacks() -> dict[str, tuple[str, dict]]:
    one = {"model": "demo", "prompt": "a", "max_tokens": 4}
    regex = {**one, "guided_regex": "(a{1000}){999}", "n": 4}
    return {
        "regex (a{1000}){999}, n=4": ("/v1/completions", regex),
        "choice of a million bytes": ("/v1/completions", {**one, "guided_choice": ["a" * 10**6]}),
        "grammar of 100,000 alternatives": ("/v1/completions", {**one, "guided_grammar": WORDS}),
        "5,000 prompts": ("/v1/completions", {**one, "prompt": ["a"] * 5000, "max_tokens": 1}),
        "tokenize 3.9 MB, token strings": ("/tokenize", {"prompt": "ab " * 1_300_000,
                                                         "return_token_strs": True}),
        "3,000 chained Lark rules": ("/v1/completions", {**one, "guided_grammar": CHAIN}),
    }


class Server:
    def __init__(self, tree: str | None, port: int):
        env = dict(os.environ)
        if tree:
            env["PYTHONPATH"] = tree
        self.port = port
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--model", "demo", "--port",
                                      str(port), "--api-key", KEY, "--log-level", "critical"],
                                     env=env, cwd=tree,  # (`-m` puts the working directory first)
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 120
        while time.monotonic() < end and not self.alive_and_healthy():
            time.sleep(0.2)

    def alive_and_healthy(self) -> bool:
        try:
            return self.request("GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def request(self, method: str, path: str, body=None, timeout: float = 300) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body),
                         {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            answer = conn.getresponse()
            return answer.status, answer.read()
        finally:
            conn.close()

    def bystander(self, on_first_token=None) -> list[float]:
        """Arrival times of a streamed 100-token greedy completion's chunks."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        body = {"model": "demo", "prompt": "ROMEO:", "max_tokens": 100, "temperature": 0,
                "ignore_eos": True,
                "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        answer, times = conn.getresponse(), []
        try:
            for line in answer:
                if line.startswith(b"data: {"):
                    times.append(time.monotonic())
                    if len(times) == 1 and on_first_token is not None:
                        on_first_token()
        except (http.client.HTTPException, OSError):
            pass  # the server died under the attack
        conn.close()
        return times


def largest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:])), default=float("nan"))


def run_attack(server: Server, path: str, body: dict) -> dict:
    result: dict = {}
    stop = threading.Event()
    health: list[float] = []

    def probe():
        while not stop.is_set():
            start = time.monotonic()
            try:
                server.request("GET", "/health", timeout=60)
                health.append(time.monotonic() - start)
            except OSError:
                health.append(float("inf"))
            stop.wait(0.01)

    def attack():
        start = time.monotonic()
        try:
            status, data = server.request("POST", path, body)
            result["status"], result["message"] = status, data[:160].decode(errors="replace")
        except (OSError, http.client.HTTPException) as e:
            result["status"], result["message"] = None, f"{type(e).__name__}: {e}"
        result["attack_s"] = time.monotonic() - start

    alone = largest_gap(server.bystander())
    sender = threading.Thread(target=attack)
    prober = threading.Thread(target=probe)
    times = server.bystander(on_first_token=lambda: (sender.start(), prober.start()))
    sender.join()
    stop.set()
    prober.join()
    result.update(bystander_tokens=len(times), gap_alone_s=alone, gap_during_s=largest_gap(times),
                  health_worst_s=max(health, default=float("nan")), health_answers=len(health),
                  alive_after=server.proc.poll() is None)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree",
                    help="run this checkout's nanoserve (PYTHONPATH), e.g. a worktree of an old "
                         "commit")
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--out", default=str(HERE / "hostile.json"))
    args = ap.parse_args()
    server = Server(args.tree, args.port)
    rows = {}
    print(
        f"{'attack':<34}{'status':>7}{'attack s':>10}{'gap alone':>11}{'gap during':>12}{'/health max':>13}  alive"
    )
    try:
        for name, (path, body) in attacks().items():
            if server.proc.poll() is not None:
                break
            r = rows[name] = run_attack(server, path, body)
            print(f"{name:<34}{str(r['status']):>7}{r['attack_s']:>10.2f}{r['gap_alone_s']:>11.3f}"
                  f"{r['gap_during_s']:>12.3f}{r['health_worst_s']:>13.3f}  {r['alive_after']}")
    finally:
        died = server.proc.poll()  # an exit code: the server died during the run (-11: a segfault)
        if died is None:
            server.proc.kill()
        server.proc.wait()
    out = {"benchmark": "hostile requests against a bystander stream and /health",
           "date": str(date.today()),
           "tree": args.tree or str(HERE.parent), "died_with": died, "attacks": rows}
    if died is not None:
        print(f"the server died during the run, exit code {died}")
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
