"""Start the real server here and stream a few chat requests through it (a GPU smoke check).

python bench/serve_smoke.py --model configs/gemma-4-E2B-it \\
    --draft configs/gemma-4-E2B-it-assistant --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gemma4serve.cli",
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        args.load_format,
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "2048",
    ]
    if args.draft:
        cmd += ["--draft", args.draft]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    for line in proc.stdout:
        print(line, end="")
        if "gemma4serve ready" in line:
            break
    print(f"ready after {time.time() - t0:.1f}s")
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            # Token ids: checkpoints made of configs/ alone (dummy weights) have no tokenizer or
            # chat template.
            body = {
                "model": model,
                "prompt": list(range(100, 200)),
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for i in range(args.requests):
                t = time.time()
                chunks, usage = 0, None
                with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        error = response.read().decode()[:300]
                        print(f"request {i}: HTTP {response.status_code} {error}")
                        continue
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line[6:])
                            chunks += 1
                            usage = event.get("usage") or usage
                print(f"request {i}: {chunks} chunks, usage {usage}, {time.time() - t:.3f}s")

            # A concurrent burst; every third client hangs up 0.3 s in (an abort while the engine
            # already has that request's next step queued on the GPU). Dummy checkpoints have no
            # tokenizer, so their text deltas are empty and a stream carries only its final chunks:
            # hang up on time, not on chunks.
            def stream(i: int) -> str:
                timeout = httpx.Timeout(120, read=0.3) if i % 3 == 0 else 120
                with httpx.Client(base_url=base, timeout=timeout) as burst_client:
                    t0, n = time.time(), 0
                    try:
                        with burst_client.stream(
                            "POST", "/v1/completions", json={**body, "max_tokens": 48 + 8 * i}
                        ) as response:
                            for line in response.iter_lines():
                                n += line.startswith("data: ")
                                if i % 3 == 0 and time.time() - t0 > 0.3:
                                    return f"client {i}: hung up after {n} chunks"
                            return f"client {i}: {n} chunks, HTTP {response.status_code}"
                    except httpx.ReadTimeout:
                        return f"client {i}: hung up after {n} chunks"

            with ThreadPoolExecutor(12) as pool:
                for line in pool.map(stream, range(12)):
                    print(line)
            time.sleep(1.0)  # let the engine see the disconnects
            metrics = client.get("/metrics").text
            for line in metrics.splitlines():
                if line.startswith(
                    (
                        "gemma4serve:spec_decode_num_draft_tokens_total",
                        "gemma4serve:kv_cache_",
                        "gemma4serve:request_success_total",
                        "gemma4serve:num_requests_running",
                    )
                ):
                    print(line)
    finally:
        proc.terminate()
        print("exit code", proc.wait(timeout=60))


if __name__ == "__main__":
    main()
