"""Tensor parallelism over NCCL on two GPUs, in bf16 with CUDA graphs (the all-reduces inside).

A rank's partial sums are all-reduced in another order than one GPU's whole GEMM sums them, so in
bf16 TP=2 and TP=1 agree up to near-ties (the rule of test_engine_gpu.py). The ranks themselves
must agree exactly, step for step (NCCL gives every rank the same sum).
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import queue
import time

import pytest
import torch

from gemma4serve import LLM, SamplingParams
from gemma4serve.structured.spec import StructuredOutputsParams
from tests.gpu.test_engine_gpu import assert_same_or_near_tie, gpu_llm
from tests.hf_oracle import load_hf_target
from tests.test_model_parity import prompt_of

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
CONSTRAINED = SamplingParams(
    max_tokens=24,
    temperature=0.8,
    seed=3,
    structured_outputs=StructuredOutputsParams(json_object=True),
)
# More requests than the engine's 8 sequences, ending at different steps: continued steps drop
# the ended sequences and take in the waiting ones.
STAGGERED = [
    SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(12)
]


def tokens(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def run_two_gpus(target: str, draft: str, prompts: list[list[int]], log: str) -> dict:
    """TP=2 with MTP in this process: each params' tokens, and whether graphs and continued steps
    ran. Called in a fresh process per engine (one tensor-parallel group per process, as a
    server has)."""
    # A fixed k: adaptive rates carry over between generates, so a seeded rerun could verify
    # other row counts and round a bf16 sample differently (test_engine_gpu.py's rule).
    two = gpu_llm(
        target,
        draft,
        tensor_parallel_size=2,
        num_draft_tokens=3,
        adaptive_draft_length=False,
        tensor_parallel_step_log=log,
    )
    changed = []
    launch_continued = two.engine.runner.launch_continued

    def continued(previous, pages, draft_len, keep=None, prompt_chunks=()):
        changed.append(keep is not None or bool(prompt_chunks))
        return launch_continued(previous, pages, draft_len, keep, prompt_chunks)

    two.engine.runner.launch_continued = continued
    try:
        staggered = tokens(two, prompts * 3, STAGGERED)
        return {
            "graphs": two.engine.runner.graphs is not None,
            "staggered": staggered,
            "changed": sum(changed),
            "greedy": tokens(two, prompts, GREEDY),
            "sampled": [tokens(two, prompts, SAMPLED) for _ in range(2)],
            "constrained": tokens(two, prompts, CONSTRAINED),
            "continued": two.engine.num_continued_steps,
        }
    finally:
        two.engine.shutdown()


def _call(results, fn, args, timeout: float) -> None:
    from gemma4serve.cli import setup_logging

    setup_logging("info")  # the engine's progress shows in the test's output
    faulthandler.dump_traceback_later(timeout - 20)  # a hang shows where, before the kill
    try:
        results.put(("ok", fn(*args)))
    except BaseException as e:
        results.put(("error", repr(e)))
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()


def in_fresh_process(fn, *args, timeout: float = 300):
    """fn(*args) in a spawned process, killed (with its tensor-parallel worker, which follows its
    parent) if it does not answer within `timeout` seconds."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    process = spawn.Process(target=_call, args=(results, fn, args, timeout))
    process.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                status, value = results.get(timeout=1)
                break
            except queue.Empty:
                alive = process.is_alive()
                assert alive and time.monotonic() < deadline, (
                    f"no answer (exit code {process.exitcode}, timeout {timeout} s)"
                )
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert status == "ok", value
    return value


@pytest.mark.parametrize("variant", ["dense", "moe", "ple"])
def test_two_gpus_emit_the_one_gpu_tokens(tiny_checkpoints, tmp_path, variant):
    """Greedy TP=2 with MTP equals TP=1 without it up to near-ties, also where continued steps
    drop and take in sequences; the ranks agree exactly on every step's tokens and drafts,
    greedy, sampled and constrained, with graphs replayed."""
    target = tiny_checkpoints.get(variant)
    draft = tiny_checkpoints.get_assistant(variant)
    prompts = [prompt_of(n, seed=n) for n in (5, 17, 40, 3)]
    one = gpu_llm(target)
    want = tokens(one, prompts, GREEDY)
    want_staggered = tokens(one, prompts * 3, STAGGERED)
    log = tmp_path / "steps"
    two = in_fresh_process(run_two_gpus, str(target), str(draft), prompts, str(log), timeout=180)
    assert two["graphs"]  # rank 0 replays graphs under TP
    assert two["sampled"][0] == two["sampled"][1]  # seeded: the same tokens again
    assert two["continued"] > 0  # async scheduling ran under TP
    judge = load_hf_target(target, dtype=torch.float32, device="cuda")
    noisy = load_hf_target(target, dtype=torch.bfloat16, device="cuda")
    for got, expected, prompt in zip(two["greedy"], want, prompts):
        assert_same_or_near_tie(got, expected, prompt, judge, noisy)
    assert two["changed"] > 0  # continued steps dropped and took in sequences on both ranks
    for got, expected, prompt in zip(two["staggered"], want_staggered, prompts * 3):
        assert_same_or_near_tie(got, expected, prompt, judge, noisy)
    rank0 = [json.loads(line) for line in (log / "rank0.jsonl").read_text().splitlines()]
    rank1 = [json.loads(line) for line in (log / "rank1.jsonl").read_text().splitlines()]
    assert len(rank0) > 20
    assert rank0 == rank1
    assert any(step and step["next_drafts"] for step in rank0)


def _rank_main(fn, rank: int, port: int, results) -> None:
    faulthandler.dump_traceback_later(100)  # a hang shows where, before the kill
    try:
        results.put((rank, "ok", fn(rank, port)))
    except BaseException as e:
        results.put((rank, "error", repr(e)))
        raise


def on_two_ranks(fn, timeout: float = 150) -> list:
    """[fn(0, port), fn(1, port)], each rank in a spawned process on its GPU; killed if they do
    not both answer within `timeout` seconds."""
    from gemma4serve.parallel.workers import _free_port

    port = _free_port()
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    processes = [spawn.Process(target=_rank_main, args=(fn, r, port, results)) for r in (0, 1)]
    for process in processes:
        process.start()
    answers: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(answers) < 2:
            assert time.monotonic() < deadline, f"no answer within {timeout} s: {answers}"
            try:
                rank, status, value = results.get(timeout=1)
            except queue.Empty:
                continue
            assert status == "ok", f"rank {rank}: {value}"
            answers[rank] = value
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    return [answers[0], answers[1]]


def _fused_all_reduce_norm_checks(rank: int, port: int) -> list[float]:
    """The fused kernel against NCCL's all-reduce, then the norm kernel, at decode to verify row
    counts: eagerly back to back, in a chain of 200 calls, after a GEMV that sent its rows
    itself, and replayed in a CUDA graph."""
    import torch.distributed as dist

    from gemma4serve.parallel.group import FusedAllReduceNorm
    from gemma4serve.parallel.workers import init_group
    from gemma4serve_kernels import gemv, gemv_mlp, rmsnorm_residual_add

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    tp = init_group(rank, 2, f"tcp://127.0.0.1:{port}", device, custom_all_reduce=True)
    fused = tp.fused_norm
    assert fused is not None
    hidden, eps = 5376, 1e-6
    shared = torch.Generator().manual_seed(0)  # the same draws on both ranks
    own = torch.Generator().manual_seed(1 + rank)  # this rank's partial sums

    def rand(generator, *shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).bfloat16().to(device)

    def reference(x, h, scalar, next_weight):
        total = h.clone()
        dist.all_reduce(total)
        if next_weight is None:
            return rmsnorm_residual_add(x, total, w, eps, scalar), None
        return rmsnorm_residual_add(x, total, w, eps, scalar, next_weight)

    w, w2 = rand(shared, hidden), rand(shared, hidden)
    scalar = torch.tensor([0.37], dtype=torch.bfloat16, device=device)
    sums = []
    calls = []
    most = 2 * FusedAllReduceNorm.SOURCE_PACKETS // hidden  # the rows its buffers hold
    for rows in (1, 3, 16, 160, most, 1, 5, 5):
        x, h = rand(shared, rows, hidden, scale=4), rand(own, rows, hidden, scale=9)
        options = (scalar, None) if rows % 2 else (None, w2)
        calls.append((x, h, options, fused(x, h, w, eps, *options)))
    for x, h, options, (y, z) in calls:  # after all launches: no sync between them
        ry, rz = reference(x, h, *options)
        assert torch.equal(y, ry) and (z is None if rz is None else torch.equal(z, rz))
        sums.append(y.float().sum().item())
    x = rand(shared, 4, hidden, scale=4)
    partials = [rand(own, 4, hidden, scale=9) for _ in range(200)]
    y, want = x, x
    for h in partials:  # each call's residual is the previous call's output
        y, _ = fused(y, h, w, eps, None, None)
    for h in partials:
        want, _ = reference(want, h, None, None)
    assert torch.equal(y, want)
    sums.append(y.float().sum().item())
    # A row-parallel GEMV that sends its rows itself (one K split, and the split-K path), then
    # the all-reduce told so; the GEMV stores what it would without sending.
    w_row = rand(own, hidden, 1024, scale=0.05)
    for rows, config in ((1, None), (4, (32, 256, 2, 3, 2)), (16, None)):
        x, a = rand(shared, rows, hidden, scale=4), rand(own, rows, 1024)
        h = gemv(a, w_row, config=config, push=fused.peers)
        y, _ = fused(x, h, w, eps, None, None, pushed=True)
        assert torch.equal(y, reference(x, h, None, None)[0])
        assert torch.equal(h, gemv(a, w_row, config=config))
        sums.append(y.float().sum().item())
    # The chained MLP (gate_up then down split along K) at a rank's shape of the 31B sends too.
    gate_up, down = rand(own, 2 * 10752, hidden, scale=0.02), rand(own, hidden, 10752, scale=0.02)
    for rows in (1, 5):
        x, a = rand(shared, rows, hidden, scale=4), rand(own, rows, hidden)
        h = gemv_mlp(a, gate_up, down, push=fused.peers)
        y, _ = fused(x, h, w, eps, None, None, pushed=True)
        assert torch.equal(y, reference(x, h, None, None)[0])
        assert torch.equal(h, gemv_mlp(a, gate_up, down))
        sums.append(y.float().sum().item())
    static_x, static_h = rand(shared, 5, hidden), rand(own, 5, hidden)
    static_a = rand(own, 5, 1024)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # three calls: both buffer parities on every replay
        y1, z1 = fused(static_x, static_h, w, eps, None, w2)
        y2, _ = fused(y1, static_h, w, eps, scalar, None)
        h3 = gemv(static_a, w_row, push=fused.peers)
        y3, _ = fused(y2, h3, w, eps, None, None, pushed=True)
    for _ in range(20):
        static_x.copy_(rand(shared, 5, hidden, scale=4))
        static_h.copy_(rand(own, 5, hidden, scale=9))
        static_a.copy_(rand(own, 5, 1024))
        graph.replay()
        ry1, rz1 = reference(static_x, static_h, None, w2)
        ry2, _ = reference(ry1, static_h, scalar, None)
        ry3, _ = reference(ry2, h3, None, None)
        assert torch.equal(y1, ry1) and torch.equal(z1, rz1) and torch.equal(y2, ry2)
        assert torch.equal(y3, ry3)
        sums.append(y3.float().sum().item())
    del graph
    dist.destroy_process_group()
    return sums


def test_fused_all_reduce_norm_equals_nccl_then_norm():
    """The one-kernel all-reduce + residual norm equals NCCL's sum then the norm kernel, bit for
    bit, and both ranks get the same rows."""
    rank0, rank1 = on_two_ranks(_fused_all_reduce_norm_checks)
    assert rank0 == rank1
