"""Where a decode step and a draft loop spend their GPU time: kernel totals from the torch profiler.

  python bench/profile_step.py --model configs/gemma-4-31B-it --draft configs/gemma-4-31B-it-assistant
  python bench/profile_step.py --engine-loop --draft ''   # the served decode loop, graphs and all

--engine-loop profiles the engine's own step loop (one greedy request, async scheduling) instead of bare graph
replays: it prints the wall time per step next to the graph replay alone, and the kernels launched outside
the graph (continuation inputs, acceptance, the copy to the host), which is what TPOT pays on top of a step.

With programmatic dependent launch a kernel starts while its predecessor drains, so its profiled time includes
that wait; the "charged" column (see `report`) is what each kernel adds to the step with that overlap counted
once, and GEMMA4SERVE_DISABLE_PDL=1 gives per-kernel times without overlap.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import fake_decoding_sequences, replay_target  # noqa: E402

from gemma4serve.engine.args import EngineArgs  # noqa: E402
from gemma4serve.engine.cuda_graphs import CudaGraphs  # noqa: E402
from gemma4serve.engine.engine import LLMEngine  # noqa: E402


def report(prof, title: str, steps: int) -> None:
    """Per kernel name: the profiler's kernel time, and the time it is charged on the step's critical path.

    With PDL a kernel is resident (and counted by the profiler) while it waits for its predecessor, so kernel
    times overlap and overcount. Charged time does not: kernels in start order, each is charged from the latest
    end before it (or its own start, after an idle gap) to its own end; the charges sum to the busy time."""
    kernels = sorted(
        (
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower()
            and "memset" not in e.name.lower()
        ),
        key=lambda e: e.time_range.start,
    )
    rows = {}
    last_end = float("-inf")
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        t, c, n = rows.get(e.name, (0.0, 0.0, 0))
        rows[e.name] = (t + end - start, c + max(0.0, end - max(last_end, start)), n + 1)
        last_end = max(last_end, end)
    total = sum(t for t, _, _ in rows.values()) / steps
    charged = sum(c for _, c, _ in rows.values()) / steps
    n = sum(k for _, _, k in rows.values()) // steps
    print(
        f"\n## {title}: {charged / 1e3:.2f} ms busy per step ({total / 1e3:.2f} ms of kernel time), {n} kernels"
    )
    print("  charged  kernel time  count  kernel")
    for name, (t, c, k) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:18]:
        print(f"{c / steps / 1e3:8.3f} ms {t / steps / 1e3:8.3f} ms x{k // steps:<5} {name[:100]}")


def engine_loop(a) -> None:
    """Wall time per step of the served decode loop against its graph replay, and the kernels around it."""
    from gemma4serve.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineArgs(
            model=a.model,
            draft=a.draft or None,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=a.batch,
            num_draft_tokens=a.k if a.draft else 0,
            max_model_len=a.context + 512,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(a.batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 10 for j in range(a.context)], params)
    for _ in range(40):  # prefill, graph warm-up
        engine.step()
    torch.cuda.synchronize()
    steps, t0 = 100, time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    graphs = engine.runner.graphs
    key = (
        graphs.bucket(a.batch),
        1,
        True,
    )  # the served loop is greedy: its graph ends in the greedy head
    graph = graphs.target_graphs[key if key in graphs.target_graphs else key[:2] + (False,)][0]
    replay = CudaGraphs._time(graph, reps=20)
    print(
        f"\n## engine loop, batch {a.batch}: {wall * 1e3:.3f} ms per step; decode graph replay alone "
        f"{replay * 1e3:.3f} ms; difference {1e3 * (wall - replay):.3f} ms"
    )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if (
            e.device_type == torch.autograd.DeviceType.CUDA and e.count < 20 * 8
        ):  # the graph's are x60 layers
            rows[e.key] = (e.device_time_total / 20, e.count / 20)
    print(
        f"kernels and copies run fewer than 8 times per step (outside the layers): "
        f"{sum(t for t, _ in rows.values()) / 1e3:.3f} ms per step"
    )
    for name, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        print(f"{t:9.1f} us x{c:<4.1f} {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/gemma-4-31B-it")
    ap.add_argument("--draft", default="configs/gemma-4-31B-it-assistant")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=1128)
    ap.add_argument(
        "--engine-loop", action="store_true", help="profile the served step loop (see above)"
    )
    a = ap.parse_args()
    if a.engine_loop:
        return engine_loop(a)
    engine = LLMEngine(
        EngineArgs(
            model=a.model,
            draft=a.draft,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=a.batch,
            num_draft_tokens=a.k,
            max_model_len=a.context + 64,
            enforce_eager=True,
        )
    )
    s = engine.state
    for k, title in ((0, "decode step"), (a.k, f"verify step (k={a.k})")):
        chunks = fake_decoding_sequences(engine, a.batch, a.context, k)
        g = CudaGraphs(s, a.batch, engine.max_model_len, a.k)
        g.buckets, g.q_lens = [a.batch], [k + 1]
        g.capture()
        for _ in range(3):
            replay_target(g, chunks)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                replay_target(g, chunks)
            torch.cuda.synchronize()
        report(prof, title, 5)
        if k:
            B = a.batch
            tok = torch.zeros(B, dtype=torch.int64, device="cuda")
            hid = torch.zeros(B, s.target.cfg.hidden_size, dtype=s.dtype, device="cuda")
            P = torch.full((B,), a.context, dtype=torch.int64, device="cuda")
            rows = torch.arange(B, dtype=torch.int32, device="cuda")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    g.run_draft(tok, hid, P, rows)
                torch.cuda.synchronize()
            report(prof, f"draft loop (k={a.k})", 5)
        for ch in chunks:
            engine.kv.free(ch.seq.pages)


if __name__ == "__main__":
    main()
