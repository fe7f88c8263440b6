"""A stand-in for `gemma4serve.engine_process.client.EngineProcessClient`: same interface, canned
text, a trivial tokenizer, and page accounting, so that the HTTP layer can be tested fast and
without weights. Also the harness the server test modules share: a server subprocess, SSE and
/metrics readers, waits for a condition and for KV pages to come back.

The fake records what the server did to it (aborts, closed generators, the threads that rendered
templates) for the tests to assert on. Run as a script it serves itself through
`gemma4serve.cli.serve` (SIGTERM tests):

    python tests/fake_engine.py --port 0 [--token-delay 0.05] [--drain-timeout 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gemma4serve.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from gemma4serve.validation import RequestError

REPLY = "The quick brown fox jumps over the lazy dog."


class FakeTokenizer:
    """One id per character (ord + OFFSET) and a few Gemma-named specials below OFFSET."""

    SPECIALS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|turn>": 3, "<turn|>": 4}
    OFFSET = 8
    bos_token_id = 2
    eos_token_ids = (1,)
    vocab_size = OFFSET + 0x110000

    def __init__(self):
        self.template_threads: list[
            threading.Thread
        ] = []  # who rendered templates (must not be the loop)
        self._names = {v: k for k, v in self.SPECIALS.items()}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        text.encode("utf-8")  # like the real (Rust) tokenizer: a lone surrogate is an error
        ids, i = [], 0
        while i < len(text):
            for name, token_id in self.SPECIALS.items():
                if text.startswith(name, i):
                    ids.append(token_id)
                    i += len(name)
                    break
            else:
                ids.append(ord(text[i]) + self.OFFSET)
                i += 1
        return ids

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.SPECIALS.values())

    def token_to_id(self, token: str) -> int | None:
        return self.SPECIALS.get(token)

    def id_to_token(self, token_id: int) -> str:
        if token_id < self.OFFSET:
            return self._names.get(token_id, f"<unused{token_id}>")
        return chr(token_id - self.OFFSET)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            self.id_to_token(t) for t in ids if not (skip_special_tokens and t < self.OFFSET)
        )

    def apply_chat_template(
        self, messages, *, add_generation_prompt=True, tools=None, **kwargs
    ) -> str:
        self.template_threads.append(threading.current_thread())
        out = ["<bos>"]
        if tools:
            out.append("tools: " + ",".join(tool["function"]["name"] for tool in tools) + "\n")
        for i, m in enumerate(messages):
            if m["role"] in ("system", "developer") and i > 0:
                raise ValueError(
                    "a system message is only allowed first"
                )  # like the Gemma template's raise
            out.append(f"<|turn>{m['role']}\n{m.get('content') or ''}<turn|>\n")
        if add_generation_prompt:
            out.append("<|turn>model\n")
        if kwargs.get("enable_thinking"):
            out.append("<|think|>")
        return "".join(out)


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    full_text: str = ""  # everything decoded, stop strings included
    emitted: int = 0  # chars of full_text already sent
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class FakeEngine:
    """An `EngineClient` that replies with a fixed text, for testing the HTTP layer alone."""

    default_sampling_params: dict = {}

    def __init__(
        self,
        *,
        max_model_len: int = 256,
        token_delay: float = 0.001,
        tokens_per_step: int = 2,
        reply: str = REPLY,
        full_pages: int = 4096,
        sliding_pages: int = 512,
        page_size: int = 16,
        fail_after_steps: int | None = None,
    ):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.model_name = "fake/gemma-4-fake"
        self.token_delay = token_delay
        self.tokens_per_step = tokens_per_step
        self.fail_after_steps = (
            fail_after_steps  # raise RuntimeError after this many outputs (engine bug)
        )
        self.reply_ids = self.tokenizer.encode(reply)
        self.page_size = page_size
        self.full_pages = full_pages
        self.sliding_pages = sliding_pages
        self.started = False
        self.ready = False  # the real engine's: it runs and admits (a test may switch it off)
        self.shutdown_calls: list[float] = []
        self.requests: dict[
            str, tuple[list[int], object]
        ] = {}  # request id -> (prompt ids, SamplingParams)
        self.abort_calls: list[str] = []
        self.requests_live: set[str] = set()  # ids whose generate() has not returned
        self.aborted: list[str] = []  # requests that ended early: abort() or the consumer went away
        self.active: dict[
            str, tuple[int, int]
        ] = {}  # request id -> (full pages, sliding pages) held
        self._abort_requested: set[str] = set()
        self._stats = EngineStats(kv_pages_total=full_pages + sliding_pages)
        self._lock = threading.Lock()

    # ---- interface ------------------------------------------------------------------------------

    def start(self) -> None:
        # Like the real engine: called from the server's startup, on the loop.
        asyncio.get_running_loop()
        self.started = self.ready = True

    def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        if request_id in self.active:
            self._abort_requested.add(request_id)

    def shutdown(self, drain_timeout: float = 30.0) -> None:
        self.shutdown_calls.append(drain_timeout)
        self.ready = False
        self._abort_requested.update(self.active)

    def kv_pool_free(self) -> dict:
        with self._lock:
            used_full = sum(f for f, _ in self.active.values())
            used_sliding = sum(s for _, s in self.active.values())
        return {"full": self.full_pages - used_full, "sliding": self.sliding_pages - used_sliding}

    def stats(self) -> EngineStats:
        free = self.kv_pool_free()
        with self._lock:
            s = self._stats
            return EngineStats(
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                kv_pages_total=self.full_pages + self.sliding_pages,
                kv_pages_free=free["full"] + free["sliding"],
                num_preemptions=0,
                prompt_tokens=s.prompt_tokens,
                generation_tokens=s.generation_tokens,
                requests_finished=dict(s.requests_finished),
                spec_num_steps=s.spec_num_steps,
                spec_drafted_tokens=s.spec_drafted_tokens,
                spec_accepted_tokens=s.spec_accepted_tokens,
                spec_accepted_per_position=list(s.spec_accepted_per_position),
            )

    async def generate(self, prompt_token_ids, params, request_id):
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request_id in self.requests_live:  # the real engine refuses an id in use too
            raise RequestError(f"request id {request_id!r} is already in use")
        max_tokens = (
            params.max_tokens
            if params.max_tokens is not None
            else self.max_model_len - len(prompt_token_ids)
        )
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)}) + max_tokens ({max_tokens})"
                f" > {self.max_model_len}"
            )
        self.requests[request_id] = (list(prompt_token_ids), params)
        metrics = RequestMetrics(arrival_time=time.monotonic())
        need = (
            params.n * math.ceil((len(prompt_token_ids) + max_tokens) / self.page_size),
            params.n,
        )
        choices = [_Choice(i) for i in range(params.n)]
        admitted = ended_early = False
        self.requests_live.add(request_id)
        try:
            await self._admit(request_id, need)
            admitted = True
            metrics.first_scheduled_time = time.monotonic()
            with self._lock:
                self._stats.prompt_tokens += len(prompt_token_ids)
            for step in range(1 << 30):
                await asyncio.sleep(self.token_delay)
                if self.fail_after_steps is not None and step >= self.fail_after_steps:
                    raise RuntimeError("fake engine failure")
                if request_id in self._abort_requested:
                    for c in choices:
                        c.finish_reason = c.finish_reason or "abort"
                deltas = [self._advance(c, params, max_tokens) for c in choices]
                if metrics.first_token_time is None:
                    metrics.first_token_time = time.monotonic()
                finished = all(c.finish_reason for c in choices)
                if finished:
                    metrics.finished_time = time.monotonic()
                    self._count_finished(choices)
                yield RequestOutput(
                    request_id,
                    list(prompt_token_ids),
                    deltas,
                    finished,
                    metrics if finished else None,
                )
                if finished:
                    return
        except (
            asyncio.CancelledError,
            GeneratorExit,
        ):  # the consumer went away: what the real engine aborts on
            ended_early = True
            raise
        finally:
            if ended_early or request_id in self._abort_requested:
                self.aborted.append(request_id)
            with self._lock:
                if admitted:
                    self._stats.num_running -= 1
                self.active.pop(request_id, None)
            self._abort_requested.discard(request_id)
            self.requests_live.discard(request_id)

    # ---- internals ------------------------------------------------------------------------------

    async def _admit(self, request_id: str, need: tuple[int, int]) -> None:
        with self._lock:
            self._stats.num_waiting += 1
        try:
            while True:
                free = self.kv_pool_free()
                with self._lock:
                    if free["full"] >= need[0] and free["sliding"] >= need[1]:
                        self.active[request_id] = need
                        self._stats.num_running += 1
                        return
                await asyncio.sleep(0.005)
        finally:
            with self._lock:
                self._stats.num_waiting -= 1

    def _advance(self, c: _Choice, params, max_tokens: int) -> CompletionOutput:
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprob] = []
        while c.finish_reason is None and len(new_ids) < self.tokens_per_step:
            pos = len(c.token_ids)
            token = (
                self.reply_ids[pos % len(self.reply_ids)]
                if params.ignore_eos or pos < len(self.reply_ids)
                else 1
            )
            c.token_ids.append(token)
            new_ids.append(token)
            if params.logprobs is not None:
                top = [(token, -0.25)] + [
                    (self.tokenizer.OFFSET + ord(ch), -2.0 - j) for j, ch in enumerate("xyz")
                ]
                new_logprobs.append(TokenLogprob(token, -0.25, top[: params.logprobs]))
            if token == 1 and not params.ignore_eos:
                c.finish_reason = "stop"
            elif token in params.stop_token_ids:
                c.finish_reason, c.stop_reason = "stop", token
            else:
                c.full_text += self.tokenizer.decode([token])
                for s in params.stop:
                    at = c.full_text.find(s)
                    if at >= 0:
                        c.full_text = c.full_text[
                            : at + (len(s) if params.include_stop_str_in_output else 0)
                        ]
                        c.finish_reason, c.stop_reason = "stop", s
                        break
            if c.finish_reason is None and len(c.token_ids) >= max_tokens:
                c.finish_reason = "length"
        with self._lock:
            self._stats.generation_tokens += len(new_ids)
            if new_ids:
                self._stats.spec_num_steps += 1
                self._stats.spec_drafted_tokens += 2
                self._stats.spec_accepted_tokens += len(new_ids) - 1
                per_pos = self._stats.spec_accepted_per_position
                per_pos.extend([0] * (2 - len(per_pos)))
                for i in range(len(new_ids) - 1):
                    per_pos[i] += 1
        # Hold back text that could be the start of a stop string, as a real detokenizer must.
        hold = 0 if c.finish_reason else max((len(s) - 1 for s in params.stop), default=0)
        upto = max(c.emitted, len(c.full_text) - hold)
        new_text = c.full_text[c.emitted : upto]
        c.emitted = upto
        return CompletionOutput(
            index=c.index,
            text=c.full_text[:upto],
            token_ids=list(c.token_ids),
            new_text=new_text,
            new_token_ids=new_ids,
            new_logprobs=new_logprobs if params.logprobs is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _count_finished(self, choices: list[_Choice]) -> None:
        with self._lock:
            reason = (
                "abort"
                if any(c.finish_reason == "abort" for c in choices)
                else choices[0].finish_reason
            )
            self._stats.requests_finished[reason] = self._stats.requests_finished.get(reason, 0) + 1


# --------------------------------------------------------------------------------------------------
# Harness shared by the server tests

REPO_ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"^gemma4serve ready: (https?://\S+) \(model (.+)\)$")
READER_GRACE_S = 5.0  # after the exit, how long the output may take to be read to its end


class ServerProcess:
    """A server started as a real subprocess on a loopback port.

    Its output is collected by a reader thread (so that a full pipe never blocks it); the URL comes
    from its `gemma4serve ready:` line."""

    def __init__(self, args: list[str], *, ready_timeout: float, env: dict | None = None):
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout) or not self.url:
            self.kill()
            raise RuntimeError(
                f"server not ready after {ready_timeout}s; output:\n" + "\n".join(self.lines[-60:])
            )

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            match = READY.match(line)
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # exited before ready: wake the waiter

    def ready_lines(self) -> list[str]:
        return [line for line in self.lines if line.startswith("gemma4serve ready:")]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit status, once `lines` holds everything the process wrote (a child that still
        holds the pipe, such as a live engine process, gets READER_GRACE_S)."""
        status = self.proc.wait(timeout)
        self._reader.join(READER_GRACE_S)
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def sse_data(lines) -> list[str]:
    """The `data:` payloads of an SSE stream, given its lines.

    Asserts the framing (a blank line after each)."""
    payloads, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"an SSE event must end with a blank line, got {line!r}"
            expect_blank = False
        elif line:
            assert line.startswith("data: "), line
            payloads.append(line[len("data: ") :])
            expect_blank = True
    return payloads


def streamed_events(url: str, body: dict, timeout: float = 60) -> list[dict]:
    """The JSON events of one streamed POST (its framing checked), [DONE] left out."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as stream:
        return [json.loads(d) for d in sse_data(stream.iter_lines()) if d != "[DONE]"]


def metric(text: str, sample_name: str, **labels) -> float:
    """One sample's value from /metrics text (which must parse); labels not given are ignored."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{sample_name} {labels} not in /metrics")


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def free_pages(server: ServerProcess) -> float:
    """The server's free KV pages, from /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return metric(text, "gemma4serve:kv_cache_free_pages")


def wait_for_free_pages(server: ServerProcess, expected: float, timeout: float = 60) -> None:
    """Until every page a test took is back (aborts and finishes return them asynchronously)."""
    deadline = time.monotonic() + timeout
    while (now := free_pages(server)) != expected:
        assert time.monotonic() < deadline, f"KV pages not returned: {now} != {expected}"
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-delay", type=float, default=0.02)
    p.add_argument("--drain-timeout", type=float, default=5.0)
    p.add_argument("--api-key")
    ns = p.parse_args()

    from gemma4serve.cli import listening_socket, serve, setup_logging
    from gemma4serve.server.settings import ServerSettings

    setup_logging("info")
    engine = FakeEngine(token_delay=ns.token_delay, max_model_len=4096)
    settings = ServerSettings(
        ["fake"], api_keys=[ns.api_key] if ns.api_key else [], drain_timeout=ns.drain_timeout
    )
    serve(engine, settings, sock=listening_socket("127.0.0.1", ns.port), host="127.0.0.1")


if __name__ == "__main__":
    main()
