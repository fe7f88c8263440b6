"""Start the real server as a subprocess for a benchmark, and stop it cleanly afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

# The tree this benchmark belongs to: its server runs that tree's package, not the one `-m` would
# find first in the working directory (a copy of an older tree benchmarks the older server).
TREE = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def start_server(model: str, draft: str | None, load_format: str, extra: list[str]):
    """Yields (base url, served model name) once the server says it is ready; its log lines are
    printed to stderr with a `server:` prefix, so they never split the benchmark's stdout table."""
    port = free_port()
    cmd = [sys.executable, "-m", "gemma4serve.cli", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--load-format", load_format, *extra]
    if draft:
        cmd += ["--draft", draft]
    print("server command:", " ".join(cmd[1:]), flush=True)
    path = os.pathsep.join(p for p in (str(TREE), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONSAFEPATH="1")  # no working directory first
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    ready, started = threading.Event(), []

    def pump() -> None:
        for line in proc.stdout:
            sys.stderr.write(f"server: {line}")
            if "gemma4serve ready" in line:
                started.append(True)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    start = time.monotonic()
    ready.wait()
    if not started:
        raise RuntimeError(f"the server exited with {proc.wait()} before it was ready")
    print(f"server ready after {time.monotonic() - start:.1f}s", flush=True)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, httpx.get(url + "/v1/models").json()["data"][0]["id"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
