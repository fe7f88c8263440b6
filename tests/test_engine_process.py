"""The engine in its own process, behind the real server.

`python -m gemma4serve.cli` serves the tiny demo Gemma 4 with its MTP assistant on CPU: outputs
equal the in-process engine's, many streams and a slow client, request times stamped by the server,
a killed or hung engine process, SIGTERM, a start-up error; and the request message's codec."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq
from fake_engine import (
    REPO_ROOT,
    ServerProcess,
    free_pages,
    metric,
    sse_data,
    wait_for_free_pages,
    wait_until,
)

from gemma4serve.engine_process.messages import AddRequest, Codec
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.structured.spec import StructuredOutputsParams

pytestmark = [pytest.mark.timeout(300)]

MODEL = "tiny"
NUM_DRAFT_TOKENS = 3
MAX_MODEL_LEN = 1024
ENGINE_PID = re.compile(r"engine process started \(pid (\d+)\)")


def test_sampling_params_cross_the_boundary_whole():
    """Every SamplingParams field survives the request message: set each one off its default here
    (a field added to SamplingParams must be added here too, which checks it stays encodable)."""
    params = SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.9,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=11,
        stop=["x", "yz"],
        stop_token_ids=[5, 6],
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=1,
        n=2,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        min_tokens=2,
        logit_bias={5: -1.5, 9: 2.0},
        allowed_token_ids=[5, 6, 9],
        bad_words=["bad"],
        structured_outputs=StructuredOutputsParams(
            json='{"type": "object"}',
            json_object=True,
            regex="[ab]+",
            choice=("yes", "no"),
            grammar='root ::= "x"',
            tool_calls='[{"name": "f", "parameters": null}]',
            parallel_tool_calls=True,
            thinking="open",
            any_whitespace=False,
        ),
        cache_salt="tenant",
    )
    default = SamplingParams()
    unset = [
        f.name
        for f in dataclasses.fields(SamplingParams)
        if getattr(params, f.name) == getattr(default, f.name)
    ]
    assert not unset, f"set these fields off their defaults in this test: {unset}"
    codec = Codec()
    message = codec.requests.decode(codec.encode(AddRequest("r", [2, 7], params, 12.5)))
    assert message == AddRequest("r", [2, 7], params, 12.5)
    hash(message.params.structured_outputs)  # it keys the compiled-grammar cache
    spec_fields = dataclasses.fields(StructuredOutputsParams)
    unset = [f.name for f in spec_fields if getattr(params.structured_outputs, f.name) == f.default]
    assert not unset, f"set these fields off their defaults in this test: {unset}"


# ---- the real server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from gemma4serve.demo.checkpoints import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo-cache"))


def start_server(
    demo_model, *extra: str, drafter: list[str] | None = None, env: dict | None = None
) -> ServerProcess:
    """The demo server; `drafter` replaces the flags that name the assistant and its drafts."""
    target, assistant = demo_model
    if drafter is None:
        drafter = ["--draft", str(assistant), "--num-draft-tokens", str(NUM_DRAFT_TOKENS)]
    args = ["-m", "gemma4serve.cli", "--model", str(target), *drafter]
    args += ["--device", "cpu", "--host", "127.0.0.1", "--port", "0"]
    args += ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--disable-uvicorn-access-log", *extra]
    return ServerProcess(args, ready_timeout=240, env=env)


def engine_pid(server: ServerProcess) -> int:
    pids = [int(m.group(1)) for line in server.lines if (m := ENGINE_PID.search(line))]
    assert len(pids) == 1, server.lines
    return pids[0]


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def server(demo_model):
    with start_server(demo_model) as proc:
        yield proc


def test_engine_runs_in_a_child_process(server):
    """The engine runs in a child process, and the server process never loads torch: only the
    engine needs it (hundreds of MB, seconds of every start)."""
    pid = engine_pid(server)
    assert pid != server.proc.pid and process_exists(pid)
    assert "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in Path(f"/proc/{server.proc.pid}/maps").read_text()


def test_64_concurrent_greedy_streams_equal_the_in_process_engine(server, demo_model):
    """64 streams at once through the engine process: each one's tokens, text and finish equal the
    offline engine's (in-process, the same drafter) and the engine's without the drafter; no page
    leaks. Two thirds carry stop strings taken from their own text, which the server finds (the
    engine process never detokenizes) and sends back to the engine to end the choice."""
    from gemma4serve.engine.llm import LLM

    target, assistant = demo_model

    def offline_llm(draft, k: int) -> LLM:
        return LLM(str(target), str(draft) if draft else None, device="cpu",
                   num_draft_tokens=k, max_model_len=MAX_MODEL_LEN)  # fmt: skip

    prompts = [[2, *(10 + (i * 7 + j * 13) % 480 for j in range(3 + i % 9))] for i in range(64)]
    plain = offline_llm(assistant, NUM_DRAFT_TOKENS).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0)
    )
    stops = []
    for i, out in enumerate(plain):
        middle = out.text[len(out.text) // 2 :]
        if i % 3 == 0 or len(middle) < 2:
            stops.append({})
        elif i % 3 == 1:
            stops.append({"stop": ["never written", middle[:2]]})
        else:
            stops.append({"stop": [middle[0]], "include_stop_str_in_output": True})
    baseline = free_pages(server)

    async def one(http: httpx.AsyncClient, i: int) -> tuple[list[int], str, str, object]:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 12, "temperature": 0.0}
        body |= {"stream": True, "return_token_ids": True, **stops[i]}
        ids, text, finish, stop_reason = [], "", None, None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines()]
        for data in sse_data(lines)[:-1]:
            choice = json.loads(data)["choices"][0]
            ids += choice.get("token_ids", [])
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            stop_reason = choice.get("stop_reason", stop_reason)
        return ids, text, finish, stop_reason

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(len(prompts))))

    served = asyncio.run(run())
    assert sum(isinstance(stop_reason, str) for *_, stop_reason in served) >= 30
    params = [SamplingParams(max_tokens=12, temperature=0.0, **stop) for stop in stops]
    for draft, k in ((assistant, NUM_DRAFT_TOKENS), (None, 0)):
        offline = offline_llm(draft, k).generate(prompts, params)
        for (ids, text, finish, stop_reason), want in zip(served, offline):
            assert ids == want.token_ids and text == want.text
            assert (finish, stop_reason) == (
                want.outputs[0].finish_reason,
                want.outputs[0].stop_reason,
            )
    wait_for_free_pages(server, baseline)


def test_queue_time_and_ttft_count_the_wait_before_the_engine_takes_a_request(server):
    """A request sent while the engine is busy (here: stopped for a second) counts that wait in
    its queue time, TTFT and latency: the server stamps its arrival, not the engine on taking it
    between steps (which can be a whole step later)."""
    names = ("request_queue_time_seconds", "time_to_first_token_seconds")

    def sample(name: str) -> float:  # a histogram has no samples before its first request
        text = httpx.get(server.url + "/metrics", timeout=10).text
        try:
            return metric(text, f"gemma4serve:{name}")
        except KeyError:
            return 0.0

    def sums() -> list[float]:
        return [sample(f"{name}_sum") for name in names]

    def count() -> float:
        return sample("e2e_request_latency_seconds_count")

    before, count_before, baseline = sums(), count(), free_pages(server)
    pid = engine_pid(server)
    body = {"model": MODEL, "prompt": [2, 40, 41], "max_tokens": 4}
    with ThreadPoolExecutor(1) as pool:
        os.kill(pid, signal.SIGSTOP)
        try:
            url = server.url + "/v1/completions"
            response = pool.submit(httpx.post, url, json=body, timeout=60)
            time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert response.result().status_code == 200
    deadline = time.monotonic() + 10
    while count() == count_before:
        assert time.monotonic() < deadline, "the finished request was not counted"
        time.sleep(0.05)
    waited = [after - b for after, b in zip(sums(), before)]
    assert min(waited) > 0.5, dict(zip(names, waited))
    wait_for_free_pages(server, baseline)


def test_a_slow_client_does_not_stall_other_streams(server):
    """A client that stops reading its long stream (with logprobs: megabytes, more than the socket
    buffers hold) while 8 other streams run to their end; its pages return once it leaves."""
    baseline = free_pages(server)
    body = {"model": MODEL, "prompt": [2, 40, 41], "max_tokens": 900, "ignore_eos": True}
    body |= {"logprobs": 20, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as slow:
        next(slow.iter_lines())  # then it reads nothing more

        async def other(http: httpx.AsyncClient, i: int) -> str | None:
            request = {"model": MODEL, "prompt": [2, 50 + i], "max_tokens": 40}
            request |= {"ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=request) as response:
                payloads = sse_data([line async for line in response.aiter_lines()])
            assert payloads[-1] == "[DONE]"
            return json.loads(payloads[-2])["choices"][0]["finish_reason"]

        async def others():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                return await asyncio.gather(*(other(http, i) for i in range(8)))

        assert asyncio.run(others()) == ["length"] * 8
    wait_for_free_pages(server, baseline)


def test_requests_sharing_an_x_request_id_each_run_to_their_end(server):
    """Clients reuse X-Request-Id (on retries): 8 streams sent at once under one id, and two
    batched completions under another, each get their own tokens to the end; none hangs."""
    baseline = free_pages(server)

    async def one(http: httpx.AsyncClient, request_id: str, prompt) -> list[str]:
        request = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "ignore_eos": True}
        request |= {"stream": True}
        headers = {"X-Request-Id": request_id}
        async with http.stream("POST", "/v1/completions", json=request, headers=headers) as r:
            assert r.status_code == 200
            payloads = sse_data([line async for line in r.aiter_lines()])
        assert payloads[-1] == "[DONE]", payloads[-3:]
        finishes = [json.loads(p)["choices"][0]["finish_reason"] for p in payloads[:-1]]
        return [finish for finish in finishes if finish]

    async def all_of_them():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            singles = [one(http, "retry", [2, 40, 41]) for _ in range(8)]
            batches = [one(http, "batch", [[2, 40], [2, 41]]) for _ in range(2)]
            return await asyncio.gather(*singles, *batches)

    assert asyncio.run(all_of_them()) == [["length"]] * 8 + [["length", "length"]] * 2
    wait_for_free_pages(server, baseline)


def assert_refused_until_gone(proc: ServerProcess) -> None:
    """A server whose engine failed: /health and new requests get a 5xx until it is gone, and it
    exits 1."""
    body = {"model": MODEL, "prompt": [2, 60], "max_tokens": 5}
    for method, path, request in [("GET", "/health", None), ("POST", "/v1/completions", body)]:
        try:
            response = httpx.request(method, proc.url + path, json=request, timeout=30)
        except httpx.TransportError:
            continue  # already gone
        assert response.status_code >= 500, response.text
    assert proc.wait(60) == 1


def test_killed_engine_process_fails_streams_and_the_server_exits_non_zero(demo_model):
    with start_server(demo_model) as proc:
        pid = engine_pid(proc)
        body = {"model": MODEL, "prompt": [2, 60], "max_tokens": 900, "ignore_eos": True}
        with httpx.stream(
            "POST", proc.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            os.kill(pid, signal.SIGKILL)
            payloads = sse_data([first, *lines])  # the stream ends (no hang)
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["type"] == "internal_server_error" and "engine" in error["message"]
        assert_refused_until_gone(proc)
        assert any("the engine process died" in line for line in proc.lines)


def test_vllms_speculative_config_names_the_assistant_and_its_drafts(demo_model):
    """A vLLM command line's `--speculative-config` serves the assistant with its draft count:
    every verify step carries 2 drafts, and greedy output is the one without drafts."""
    config = {"method": "mtp", "model": str(demo_model[1]), "num_speculative_tokens": 2}
    drafter = ["--speculative-config", json.dumps(config), "--no-adaptive-draft-length"]
    body = {"model": MODEL, "prompt": [2, 60, 61], "max_tokens": 24, "ignore_eos": True}
    texts = []
    for flags in (drafter, ["--num-draft-tokens", "0"]):
        with start_server(demo_model, drafter=flags) as proc:
            response = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
            texts.append(response.json()["choices"][0]["text"])
            metrics = httpx.get(proc.url + "/metrics", timeout=30).text
            verify_steps = metric(metrics, "gemma4serve:spec_decode_num_drafts_total")
            drafts = metric(metrics, "gemma4serve:spec_decode_num_draft_tokens_total")
            assert drafts == 2 * verify_steps and (verify_steps > 0) == (flags is drafter)
    assert texts[0] == texts[1]


def test_an_integer_past_64_bits_is_a_400_and_leaves_the_watchdog_in_step(demo_model):
    """With --max-logprobs -1 nothing bounds `logprobs` before the engine's 64-bit wire: the
    request is a 400, and the server does not count a message the engine never got (a watchdog
    that did would take the idle engine for hung)."""
    timeout = ["--engine-iteration-timeout", str(HANG_TIMEOUT_S)]
    with start_server(demo_model, "--max-logprobs", "-1", *timeout) as proc:
        body = {"model": MODEL, "prompt": [2, 60], "max_tokens": 3, "logprobs": 2**70}
        response = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert "64 bits" in response.json()["error"]["message"]
        time.sleep(HANG_TIMEOUT_S + 1)
        body["logprobs"] = 2
        assert httpx.post(proc.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert proc.proc.poll() is None and not any("hung" in line for line in proc.lines)


def test_a_pass_reads_requests_for_a_bounded_time():
    """A burst of slow request set-ups (grammar compilations) is read over several passes, each
    answered, so the running streams keep stepping and the server keeps hearing from the engine."""
    from gemma4serve.engine_process.core import READ_BUDGET_S, EngineCore

    class SlowEngine:
        requests: dict = {}

        def add_request(self, *args) -> None:
            time.sleep(READ_BUDGET_S / 2.5)

    context = zmq.Context()
    try:
        inbox, sender = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        inbox.bind("inproc://requests")
        sender.connect("inproc://requests")
        codec = Codec()
        for i in range(6):
            sender.send(codec.encode(AddRequest(f"r{i}", [2, 7], SamplingParams(), 0.0)))
        assert inbox.poll(5000)
        core = EngineCore(SlowEngine(), inbox, None, codec, os.getppid())
        taken = []
        while core.messages_taken < 6:
            assert core._take_requests([], [])
            taken.append(core.messages_taken)
        assert taken[0] <= 3 and len(taken) >= 2, taken
    finally:
        context.destroy(linger=0)


def test_the_log_has_vllms_stats_lines_while_there_is_work(demo_model):
    """Every $GEMMA4SERVE_LOG_STATS_INTERVAL seconds while requests run: throughput, load, KV use
    and the drafts' acceptance, as vLLM logs them; none when idle, none with --disable-log-stats."""
    fast = {"GEMMA4SERVE_LOG_STATS_INTERVAL": "0.3"}
    body = {"model": MODEL, "prompt": [2, 60], "max_tokens": 200, "ignore_eos": True}
    for extra in ([], ["--disable-log-stats"]):
        with start_server(demo_model, *extra, env=fast) as proc:
            time.sleep(1)  # idle: no lines
            assert not any("Avg prompt throughput" in line for line in proc.lines)
            assert httpx.post(proc.url + "/v1/completions", json=body, timeout=60).is_success
            time.sleep(1)
            stats = [line for line in proc.lines if "Avg prompt throughput" in line]
            spec = [line for line in proc.lines if "SpecDecoding metrics" in line]
            if extra:
                assert not stats and not spec
                continue
            assert stats and spec, proc.lines[-20:]
            assert re.search(r"Avg generation throughput: [1-9][\d.]* tokens/s", "".join(stats))
            assert "Mean acceptance length" in spec[0] and "Per-position acceptance rate" in spec[0]
            lines = len(proc.lines)
            time.sleep(1)  # idle again: the lines stop
            assert not any("Avg prompt throughput" in line for line in proc.lines[lines:])


HANG_TIMEOUT_S = 3.0  # --engine-iteration-timeout of the hang tests (the demo steps take ms)


@contextlib.contextmanager
def stopped_engine(proc: ServerProcess):
    """SIGSTOP the server's engine process (a hang in a kernel or a collective looks the same to
    the server); whatever happens, it does not outlive the test."""
    pid = engine_pid(proc)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def assert_stopped_for_a_hang(proc: ServerProcess, pid: int) -> None:
    """As for a dead engine, and the hung engine process is killed."""
    assert_refused_until_gone(proc)
    assert any("it is hung" in line for line in proc.lines), proc.lines[-20:]
    assert not process_exists(pid)


def test_an_engine_that_hangs_mid_stream_is_killed_and_its_stream_ends(demo_model):
    """A stream whose engine stops answering ends with an error and [DONE] after
    --engine-iteration-timeout. An idle engine owes nothing: idling longer than the timeout first
    changes nothing."""
    timeout = ["--engine-iteration-timeout", str(HANG_TIMEOUT_S)]
    with start_server(demo_model, *timeout) as proc:
        time.sleep(HANG_TIMEOUT_S + 1)
        body = {"model": MODEL, "prompt": [2, 60], "max_tokens": 5}
        assert httpx.post(proc.url + "/v1/completions", json=body, timeout=60).status_code == 200
        body |= {"max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            with stopped_engine(proc) as pid:
                started = time.monotonic()
                payloads = sse_data([first, *lines])
                waited = time.monotonic() - started
                assert payloads[-1] == "[DONE]"
                error = json.loads(payloads[-2])["error"]
                assert error["type"] == "internal_server_error"
                assert error["message"].endswith("the engine stopped responding")
                assert HANG_TIMEOUT_S - 0.5 <= waited < HANG_TIMEOUT_S + 30
                assert_stopped_for_a_hang(proc, pid)


def test_a_request_to_an_engine_hung_while_idle_fails(demo_model):
    timeout = ["--engine-iteration-timeout", str(HANG_TIMEOUT_S)]
    with start_server(demo_model, *timeout) as proc, stopped_engine(proc) as pid:
        body = {"model": MODEL, "prompt": [2, 60], "max_tokens": 5}
        response = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["message"] == "The engine is not running."
        assert_stopped_for_a_hang(proc, pid)


def test_sigterm_stops_the_engine_process(demo_model):
    with start_server(demo_model) as proc:
        pid = engine_pid(proc)
        proc.signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not process_exists(pid)


def test_a_stop_signal_to_every_process_still_drains(demo_model):
    """systemd's default stop signals every process of the service, and Ctrl-C reaches the whole
    process group: the engine process leaves the stop to the server, whose drain finishes the
    running stream; the server exits 0 and the engine process is gone."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        with start_server(demo_model) as proc:
            pid = engine_pid(proc)
            body = {"model": MODEL, "prompt": [2, 60], "max_tokens": 120, "stream": True}
            body |= {"ignore_eos": True}
            with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                first = next(lines)
                os.kill(pid, sig)
                proc.signal(sig)
                payloads = sse_data([first, *lines])
            assert payloads[-1] == "[DONE]", payloads[-3:]
            assert json.loads(payloads[-2])["choices"][0]["finish_reason"] == "length"
            assert proc.wait(60) == 0
            assert not process_exists(pid)


# Each writes the file `slow` beside itself when the engine process's slow part begins.
SLOW_LOAD = """
import multiprocessing, pathlib, time
import gemma4serve.engine.engine as engine_module
start = engine_module.LLMEngine.__init__
def slow(self, *args, **kwargs):
    if multiprocessing.parent_process() is not None:  # the engine process: load for a minute
        pathlib.Path(__file__).with_name("slow").touch()
        time.sleep(60)
    start(self, *args, **kwargs)
engine_module.LLMEngine.__init__ = slow
"""
# The engine process before it runs any of ours (a spawned child's argv ends so), as on a busy
# machine where its imports take seconds.
SLOW_SPAWN = """
import pathlib, sys, time
if sys.argv[-1:] == ["--multiprocessing-fork"]:
    pathlib.Path(__file__).with_name("slow").touch()
    time.sleep(6)
"""


def start_slowly(demo_model, tmp_path, site=SLOW_LOAD) -> tuple[subprocess.Popen, list[int]]:
    """The server in a process group of its own, its engine process loading for a minute: the
    server and its children (the engine, multiprocessing's resource tracker), once the load has
    begun (or the engine process's start, with SLOW_SPAWN). Waiting for the marker, not a fixed
    time: on a busy CPU the engine's imports alone outlast seconds."""
    (tmp_path / "sitecustomize.py").write_text(site)
    target, assistant = demo_model
    command = [sys.executable, "-m", "gemma4serve.cli", "--model", str(target), "--device", "cpu"]
    command += ["--draft", str(assistant), "--host", "127.0.0.1", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    children = f"/proc/{server.pid}/task/{server.pid}/children"
    deadline = time.monotonic() + 120
    while not (tmp_path / "slow").exists():
        assert time.monotonic() < deadline and server.poll() is None
        time.sleep(0.2)
    spawned = open(children).read().split()
    assert len(spawned) == 2, spawned  # the resource tracker and the engine
    return server, [int(pid) for pid in spawned]


def kill_group(server: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group may be gone already
        os.killpg(server.pid, signal.SIGKILL)


def wait_gone(pids: list[int], seconds: float) -> None:
    gone = lambda: not any(process_exists(pid) for pid in pids)  # noqa: E731
    wait_until(gone, seconds, "the server's processes to exit")


def test_an_engine_still_loading_exits_with_its_server(demo_model, tmp_path):
    """A server killed while its engine loads (minutes for a 31B) takes the engine with it at
    once: a loading engine would hold the GPU's memory from the server started in its place."""
    server, children = start_slowly(demo_model, tmp_path)
    try:
        server.kill()
        server.wait(10)
        wait_gone(children, 5)
    finally:
        kill_group(server)


def test_an_engine_still_starting_exits_with_its_server(demo_model, tmp_path):
    """A server killed before its engine process has run a line of ours: the engine watches the
    server's pid it was given, not whichever process is its parent once it gets there (init),
    so it exits as soon as it starts instead of loading and serving nobody for ever."""
    server, children = start_slowly(demo_model, tmp_path, site=SLOW_SPAWN)
    try:
        server.kill()
        server.wait(10)
        wait_gone(children, 20)  # the 6 s of its start, then the imports of a busy CPU
    finally:
        kill_group(server)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_engine_loads_ends_at_once(demo_model, tmp_path, sig):
    """Ctrl-C (SIGINT to the process group) or a service stop (SIGTERM) during the load ends the
    server and its engine within seconds, with one log line: the engine cannot be asked to stop
    before it is ready, so it is not waited for."""
    server, children = start_slowly(demo_model, tmp_path)
    try:
        os.killpg(server.pid, sig)
        assert server.wait(5) == 128 + sig
        wait_gone(children, 5)
    finally:
        kill_group(server)


def test_engine_start_up_error_exits_with_its_message(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "gemma4serve.cli", "--model", str(tmp_path / "missing")]
    log = tmp_path / "log"
    with log.open("w") as out:  # a file, not a pipe: nothing can hold it open past the exit
        done = subprocess.run(
            [*command, "--device", "cpu"], stdout=out, stderr=out, timeout=240, env=env
        )
    assert done.returncode == 1
    text = log.read_text()
    assert "could not start the engine:" in text and "missing" in text


def test_a_start_up_error_sent_just_before_the_engine_exits_is_kept(monkeypatch, tmp_path):
    """The engine sends StartupFailed and exits between two of the server's polls (a loaded
    machine deschedules the server there): the error still says what failed, not only that the
    process exited."""
    import multiprocessing.process

    from gemma4serve.engine.args import EngineArgs
    from gemma4serve.engine_process.client import EngineProcessClient, EngineStartupError

    is_alive = multiprocessing.process.BaseProcess.is_alive

    def answers_once_exited(process) -> bool:
        process.join(120)
        return is_alive(process)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "is_alive", answers_once_exited)
    with pytest.raises(EngineStartupError, match="missing"):
        EngineProcessClient(EngineArgs(model=str(tmp_path / "missing"), device="cpu"))
