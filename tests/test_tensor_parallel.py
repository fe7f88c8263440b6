"""Tensor parallelism over gloo on CPU: two (and four) ranks give the tokens one device gives.

The offline engine with `tensor_parallel_size=2` (rank 0 in the test process, a spawned worker)
against the one-device engine on tiny checkpoints of every variant (k_eq_v full layers with one KV
head, replicated to both ranks; PLE with KV-shared layers; MoE), with the MTP drafter; every
rank's per-step tokens compared; the real server started with `-tp 2` (concurrent streams,
disconnects, no page lost); a killed worker taking the server down.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import torch.distributed
from fake_engine import ServerProcess, free_pages, wait_for_free_pages

from gemma4serve import LLM, SamplingParams
from gemma4serve.cli import engine_args, parse_args
from gemma4serve.config import ConfigError, load_config
from gemma4serve.engine.spec import DraftLength, StepCost
from gemma4serve.model.layers import TorchOps
from gemma4serve.parallel.group import (
    FusedAllReduceNorm,
    OneShotAllReduce,
    argmax_keys,
    key_tokens,
)
from gemma4serve.parallel.shards import shard_text_config
from gemma4serve.structured.spec import StructuredOutputsParams

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = [[2, 5, 9, 17, 33], [2, 100, 7], [2, *range(40, 80)]]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
# The paths whose inputs cross to the workers besides the step plan (a grammar's bitmask) or read
# the whole logits (penalties, logprobs, prompt logprobs).
CONSTRAINED = SamplingParams(
    max_tokens=24,
    temperature=0.8,
    seed=3,
    presence_penalty=0.5,
    logprobs=2,
    prompt_logprobs=1,
    structured_outputs=StructuredOutputsParams(json_object=True),
)
# A grammar alone: its decode steps are continued, rank 0 sending each one's bitmask after the
# step before is committed.
CONTINUED_GRAMMAR = SamplingParams(
    max_tokens=24,
    temperature=0.8,
    seed=5,
    structured_outputs=StructuredOutputsParams(json_object=True),
)


def token_ids(outputs) -> list[list[int]]:
    return [choice.token_ids for out in outputs for choice in out.outputs]


def generate(target, draft, params_list, **kwargs) -> tuple[list[list[list[int]]], int]:
    """Each params' token ids for PROMPTS, and the KV pages of (each rank of) the engine."""
    llm = LLM(str(target), draft=str(draft) if draft else None, device="cpu", **kwargs)
    try:
        outputs = [token_ids(llm.generate(PROMPTS, params)) for params in params_list]
        return outputs, llm.engine.state.kv_plan.num_pages
    finally:
        llm.engine.shutdown()


def read_steps(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def on_two_ranks(tiny_checkpoints, variant, log, **kwargs) -> LLM:
    """A tiny model on two ranks with its drafter (k = 3), each rank logging its steps."""
    return LLM(
        str(tiny_checkpoints.get(variant)),
        draft=str(tiny_checkpoints.get_assistant(variant)),
        device="cpu",
        tensor_parallel_size=2,
        num_draft_tokens=3,
        tensor_parallel_step_log=str(log),
        **kwargs,
    )


@pytest.mark.parametrize("variant", ["dense", "ple", "moe"])
def test_two_ranks_emit_the_one_device_tokens(tiny_checkpoints, tmp_path, variant):
    """Greedy and seeded sampling with TP=2 and MTP equal TP=1 without MTP (speculation is
    lossless), and both ranks compute the same tokens and drafts at every step."""
    target = tiny_checkpoints.get(variant)
    assistant = tiny_checkpoints.get_assistant(variant)
    expected, pages = generate(target, None, [GREEDY, SAMPLED, CONSTRAINED, CONTINUED_GRAMMAR])
    assert not torch.distributed.is_initialized()  # one device never starts a group
    log = tmp_path / "steps"
    got, rank_pages = generate(
        target,
        assistant,
        [GREEDY, SAMPLED, CONSTRAINED, CONTINUED_GRAMMAR],
        tensor_parallel_size=2,
        num_draft_tokens=3,
        tensor_parallel_step_log=str(log),
    )
    assert got == expected
    if variant == "dense":  # its sliding layers' two KV heads split, one per rank: twice the pages
        assert rank_pages >= 2 * pages - 1
    assert len(set(map(tuple, expected[0]))) > 1  # the prompts do not all give one answer
    rank0, rank1 = read_steps(log / "rank0.jsonl"), read_steps(log / "rank1.jsonl")
    assert len(rank0) > 10
    assert rank0 == rank1
    assert any(step and step["next_drafts"] for step in rank0)  # the drafter ran on both ranks


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_four_ranks_emit_the_one_device_tokens(tiny_checkpoints, tmp_path, variant):
    """TP=4, past the KV heads: each rank holds one query head, and the sliding layers' two KV
    heads and the full layers' one are replicated (as the 31B's four global KV heads are at
    TP=8). Greedy with MTP equals one device without it; all four ranks agree at every step."""
    target = tiny_checkpoints.get(variant)
    (expected,), _ = generate(target, None, [GREEDY])
    log = tmp_path / "steps"
    (got,), _ = generate(
        target,
        tiny_checkpoints.get_assistant(variant),
        [GREEDY],
        tensor_parallel_size=4,
        num_draft_tokens=3,
        tensor_parallel_step_log=str(log),
    )
    assert got == expected
    ranks = [read_steps(log / f"rank{rank}.jsonl") for rank in range(4)]
    assert len(ranks[0]) > 5 and all(steps == ranks[0] for steps in ranks[1:])


@pytest.mark.parametrize("probe_every", [64, 3])
def test_two_ranks_follow_a_shorter_draft_length(tiny_checkpoints, tmp_path, probe_every):
    """The adaptive draft length's shorter choice (2 of 3 drafts) runs on both ranks: the step plans
    carry it, the ranks propose the same 2 drafts a sequence, and greedy output still equals one
    device without MTP. With a probe of the full length every third step, the length switches
    back and forth in steps continued on the device, and the ranks follow."""
    (expected,), _ = generate(tiny_checkpoints.get("dense"), None, [GREEDY])
    log = tmp_path / "steps"
    llm = on_two_ranks(tiny_checkpoints, "dense", log)
    try:  # two drafts pay far more than three at every batch size
        llm.engine.draft_length = DraftLength(
            3, {8: StepCost(1.0, {2: 0.5, 3: 5.0}, {2: 0.1, 3: 0.1})}, probe_every=probe_every
        )
        got = token_ids(llm.generate(PROMPTS, GREEDY))
    finally:
        llm.engine.shutdown()
    assert got == expected
    rank0, rank1 = read_steps(log / "rank0.jsonl"), read_steps(log / "rank1.jsonl")
    assert rank0 == rank1
    proposed = [
        drafts for step in rank0 if step and step["next_drafts"] for drafts in step["next_drafts"]
    ]
    lengths = {len(drafts) for drafts in proposed}
    assert lengths == ({2} if probe_every == 64 else {2, 3})
    if probe_every != 64:
        assert llm.engine.num_continued_steps > 5


@pytest.mark.parametrize("variant", ["dense", "ple", "moe"])
def test_two_ranks_continue_steps_through_finishes_arrivals_and_prompt_chunks(
    tiny_checkpoints, tmp_path, variant
):
    """Steps continued on the device that drop the sequences which ended, take in waiting
    requests and carry prompts' chunks run on both ranks (rank 0 sends what changed; each rank
    rebuilds the step from it): greedy and seeded sampling equal one device without MTP, and the
    ranks agree at every step. Three sequences at most and a 24-token budget: requests wait,
    long prompts come in chunks."""
    prompts = [*PROMPTS, [2, *range(90, 120)], [2, 8, 4, 6], [2, *range(130, 147)]]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (6, 17, 9)
    ] + [
        SamplingParams(max_tokens=m, temperature=1.0, seed=m, ignore_eos=True) for m in (12, 5, 14)
    ]
    limits = dict(max_num_seqs=3, max_num_batched_tokens=24)

    def run(llm: LLM) -> list[list[int]]:
        try:
            return token_ids(llm.generate(prompts, params))
        finally:
            llm.engine.shutdown()

    expected = run(LLM(str(tiny_checkpoints.get(variant)), device="cpu", **limits))
    log = tmp_path / "steps"
    llm = on_two_ranks(tiny_checkpoints, variant, log, **limits)
    changed = []
    launch_continued = llm.engine.runner.launch_continued

    def continued(previous, pages, draft_len, keep=None, prompt_chunks=()):
        changed.append((keep is not None, [chunk.samples for chunk in prompt_chunks]))
        return launch_continued(previous, pages, draft_len, keep, prompt_chunks)

    llm.engine.runner.launch_continued = continued
    assert run(llm) == expected
    assert any(dropped for dropped, _ in changed)  # a continued step dropped ended sequences
    chunks = [samples for _, step in changed for samples in step]
    assert True in chunks and False in chunks  # prompts' last and middle chunks went on
    rank0, rank1 = read_steps(log / "rank0.jsonl"), read_steps(log / "rank1.jsonl")
    assert len(rank0) > 10 and rank0 == rank1


def test_kv_heads_and_widths_split_per_rank(tiny_checkpoints):
    cfg = load_config(tiny_checkpoints.get("moe"))
    shard = shard_text_config(cfg, 2)
    assert shard.num_heads == cfg.num_heads // 2
    assert shard.moe_intermediate_size == cfg.moe_intermediate_size // 2
    for full, local in zip(cfg.layers, shard.layers):
        # 2 KV heads split one per rank; a single KV head is held by both ranks
        assert local.num_kv_heads == max(1, full.num_kv_heads // 2)
        assert local.mlp_width == full.mlp_width // 2
    with pytest.raises(ConfigError, match="tensor-parallel-size 3"):
        shard_text_config(cfg, 3)


def test_a_size_the_model_cannot_split_by_fails_before_any_worker(tiny_checkpoints):
    with pytest.raises(ConfigError, match="tensor-parallel-size 3 does not divide"):
        LLM(str(tiny_checkpoints.get("dense")), device="cpu", tensor_parallel_size=3)


# ---- the real server ----------------------------------------------------------------------------


def start_tp_server(tiny_checkpoints, *extra: str) -> ServerProcess:
    target = tiny_checkpoints.get("dense")
    assistant = tiny_checkpoints.get_assistant("dense")
    args = [
        "-m", "gemma4serve.cli", "--model", str(target), "--draft", str(assistant),
        "--device", "cpu", "--host", "127.0.0.1", "--port", "0", "-tp", "2",
        "--served-model-name", "tiny", "--num-draft-tokens", "3", "--disable-uvicorn-access-log",
        # few sequences and a small budget: requests wait, long prompts come in chunks
        "--max-num-seqs", "4", "--max-num-batched-tokens", "32", *extra,
    ]  # fmt: skip
    return ServerProcess(args, ready_timeout=240)


def logged_pid(server: ServerProcess, pattern: str) -> int:
    matches = [re.search(pattern, line) for line in server.lines]
    return int(next(m for m in matches if m).group(1))


def alive(pid: int) -> bool:
    """Running (an exited process that no one has reaped yet is a zombie: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tp_server(tiny_checkpoints):
    with start_tp_server(tiny_checkpoints) as proc:
        yield proc, tiny_checkpoints.get("dense")


def test_server_with_two_ranks_serves_the_one_device_tokens(tp_server):
    server, target = tp_server
    llm = LLM(str(target), device="cpu")
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, GREEDY)]
    assert len(set(expected)) > 1
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)
    for prompt, text in zip(PROMPTS, expected):
        completion = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert completion.usage.completion_tokens == 20
        assert completion.choices[0].text == text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_concurrent_streams_and_disconnects_on_two_ranks(tp_server):
    """Twelve requests at once (four sequences at most: the others wait, long prompts come in
    chunks) and four streams that disconnect after their first tokens: every completed request
    equals one device's greedy output, and every KV page comes back."""
    server, target = tp_server
    prompts = [[2, *range(10 + 7 * i, 10 + 7 * i + 3 + 5 * i)] for i in range(12)]
    lengths = [5 + (7 * i) % 23 for i in range(12)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm = LLM(str(target), device="cpu")
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    start = free_pages(server)

    def complete(i: int) -> list[int]:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": lengths[i]}
        body |= {"temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    def disconnect(i: int) -> int:
        body = {"model": "tiny", "prompt": [2, 3 + i], "max_tokens": 3000, "stream": True}
        body |= {"temperature": 0.0, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            return len([next(events) for _ in range(3)])  # then the connection closes

    with ThreadPoolExecutor(16) as pool:
        completed = [pool.submit(complete, i) for i in range(12)]
        dropped = [pool.submit(disconnect, i) for i in range(4)]
        assert [future.result() for future in completed] == expected
        assert [future.result() for future in dropped] == [3] * 4
    wait_for_free_pages(server, start)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_killed_worker_takes_the_server_down(tp_server):
    """A running stream fails, the server exits non-zero. Last in this file: it ends the module's
    server."""
    server, _ = tp_server
    pid = logged_pid(server, r"rank 1 started \(pid (\d+)\)")
    body = {"model": "tiny", "prompt": [2, 5, 9], "max_tokens": 3000, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0.0}
    rest = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(pid, signal.SIGKILL)
        try:
            rest += lines
        except httpx.HTTPError:  # the connection may end without an event
            rest.append("<connection closed>")
    assert "[DONE]" not in rest[-3:] or any('"error"' in line for line in rest), rest[-5:]
    assert not any('"finish_reason":"length"' in line for line in rest)
    assert server.wait(timeout=30) != 0
    assert any("gemma4serve-tp1 exited" in line for line in server.lines)
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)


def test_a_stop_signal_to_every_process_drains_on_two_ranks(tiny_checkpoints):
    """SIGTERM to the server, the engine process (rank 0) and the worker at once, as systemd stops
    a service: the workers and rank 0 leave the stop to the server, whose drain finishes the
    running stream; everything exits, the server with 0."""
    with start_tp_server(tiny_checkpoints) as server:
        pids = [
            logged_pid(server, r"engine process started \(pid (\d+)\)"),
            logged_pid(server, r"rank 1 started \(pid (\d+)\)"),
        ]
        body = {"model": "tiny", "prompt": [2, 5, 9], "max_tokens": 60, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0.0}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first = next(lines)
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            server.signal(signal.SIGTERM)
            events = [first, *lines]
        assert events[-1] == "data: [DONE]", events[-3:]
        assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        assert server.wait(60) == 0
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "a rank outlived the server"
            time.sleep(0.2)


def test_a_hung_worker_takes_the_server_down(tiny_checkpoints):
    """A rank that hangs (here SIGSTOPped) holds rank 0 in a collective: after
    --engine-iteration-timeout the server kills rank 0, the stream ends with an error and [DONE],
    and the server exits 1."""
    with start_tp_server(tiny_checkpoints, "--engine-iteration-timeout", "3") as server:
        worker = logged_pid(server, r"rank 1 started \(pid (\d+)\)")
        body = {"model": "tiny", "prompt": [2, 5, 9], "max_tokens": 3000, "stream": True}
        body |= {"ignore_eos": True, "temperature": 0.0}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                events = (line for line in r.iter_lines() if line.startswith("data: "))
                next(events)
                os.kill(worker, signal.SIGSTOP)
                rest = list(events)
            assert rest[-1] == "data: [DONE]", rest[-3:]
            assert "the engine stopped responding" in rest[-2]
            assert server.wait(60) == 1
            assert any("it is hung" in line for line in server.lines)
        finally:  # a stopped process cannot notice that its rank 0 is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_a_killed_rank_0_takes_the_server_and_its_worker_down(tiny_checkpoints):
    with start_tp_server(tiny_checkpoints) as server:
        worker = logged_pid(server, r"rank 1 started \(pid (\d+)\)")
        os.kill(logged_pid(server, r"engine process started \(pid (\d+)\)"), signal.SIGKILL)
        assert server.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while alive(worker):  # the worker, inside a collective or waiting for a plan, exits too
            assert time.monotonic() < deadline, "the worker outlived its rank 0"
            time.sleep(0.1)


def test_the_one_shot_path_is_chosen_by_shape_alone():
    """Every rank must take the same path for the same all-reduce: an unaligned view of a shape
    the one-shot kernel takes is still taken (copied first), whatever its address."""
    one_shot = OneShotAllReduce.__new__(OneShotAllReduce)  # the rule only, no buffers
    hidden = torch.zeros(2 * 5376 + 1, dtype=torch.bfloat16)
    assert one_shot.fits(hidden[:5376]) and one_shot.fits(hidden[1:5377])
    assert not one_shot.fits(torch.zeros(5376, dtype=torch.float32))  # bf16 only
    assert not one_shot.fits(torch.zeros(7, dtype=torch.bfloat16))  # not in 16-byte units
    too_big = OneShotAllReduce.MAX_BYTES // 2 + 8
    assert not one_shot.fits(torch.empty(too_big, dtype=torch.bfloat16))


def test_the_fused_all_reduce_norm_is_chosen_by_shape_alone():
    """Decode to verify rows of bf16 take the one-kernel all-reduce + norm, fewer the more peers
    send them; prefill-sized rows and other dtypes take an all-reduce, then the norm (on every
    rank alike)."""
    from gemma4serve_kernels import PeerBuffers

    def rule(world: int) -> FusedAllReduceNorm:
        fused = FusedAllReduceNorm.__new__(FusedAllReduceNorm)  # the rule only, no buffers
        unused = torch.zeros(world, dtype=torch.int64)
        fused.peers = PeerBuffers(0, world, unused, unused, FusedAllReduceNorm.SOURCE_PACKETS, 132)
        return fused

    def rows(n: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.zeros(n, 5376, dtype=dtype)

    assert rule(2).fits(rows(160))  # 32 x 5 verify rows
    assert not rule(2).fits(rows(161))  # a prefill chunk
    assert rule(4).fits(rows(32)) and rule(4).fits(rows(53))
    assert not rule(4).fits(rows(54)) and not rule(4).fits(rows(160))
    assert not rule(2).fits(rows(4, torch.float32))


def test_the_shards_best_tokens_as_keys_give_the_whole_vocabularys_argmax():
    """The largest of the ranks' keys is torch.argmax over the whole logits: across shards the
    larger value wins, ties go to the lower id (+0.0 and -0.0 tie), negative values order."""
    logits = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits[0] = -3.0  # one value everywhere: token 0
    logits[1, 5] = logits[1, 30] = 10.0  # a tie across shards
    logits[2] = 0.0
    logits[2, :24] = -0.0  # -0.0 in the first shard ties +0.0 in the rest: token 0
    logits[3] = -logits[3].abs() - 1  # every value negative
    logits[4, 47] = float("inf")
    for size in (2, 4):
        width = 48 // size
        keys = torch.stack(
            [
                argmax_keys(TorchOps().best_tokens(None, shard, lambda h: h), rank * width)
                for rank, shard in enumerate(logits.split(width, dim=-1))
            ]
        )
        assert torch.equal(key_tokens(keys.max(0).values), logits.argmax(-1)), size


def test_custom_all_reduce_flag():
    argv = ["--model", "m", "-tp", "2"]
    assert not engine_args(parse_args(argv)).disable_custom_all_reduce
    assert engine_args(parse_args([*argv, "--disable-custom-all-reduce"])).disable_custom_all_reduce
