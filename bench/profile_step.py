"""Where a decode step and a draft loop spend their GPU time: kernel totals from the torch profiler.

  python bench/profile_step.py --model configs/gemma-4-31B-it \\
      --draft configs/gemma-4-31B-it-assistant
  python bench/profile_step.py --engine-loop --draft ''   # the served decode loop, graphs and all
  python bench/profile_step.py --mixed 2048 --batch 32   # a prefill chunk beside 32 decodes
  python bench/profile_step.py --mixed 4000 --prompt-len 1024 --batch 32 --k 2   # as served
  python bench/profile_step.py --engine-loop --draft '' -tp 2   # rank 0 of tensor parallelism

--engine-loop profiles the engine's own step loop (one greedy request, async scheduling) instead of
bare graph replays: it prints the wall time per step next to the graph replay alone, every kernel's
charged time (the graph's too; the only per-kernel view under TP), and the kernels launched outside
the graph (continuation inputs, acceptance, the copy to the host), which is what
TPOT pays on top of a step; then the GPU's idle gaps and the host's time per step (waiting for the
GPU, working, and where the work goes under cProfile). Without a drafter it also splits the GEMVs
by layer kind and projection against their weight bytes at the copy rate.

--mixed N times the steps that carry N prompt tokens beside `--batch` decoding sequences (what
every arriving request costs the running ones): one prompt, or with --prompt-len prompts of that
length and a shorter last one (the serving benchmark's 1024-token prompts fill a step's budget
four at a time); wall time per step against the GPU's busy time, and where that busy time goes.

With programmatic dependent launch a kernel starts while its predecessor drains, so its profiled
time includes that wait; the "charged" column (see `report`) is what each kernel adds to the step
with that overlap counted once, and GEMMA4SERVE_DISABLE_PDL=1 gives per-kernel times without
overlap.
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

from bench_step import copy_bandwidth, fake_decoding_sequences, replay_target  # noqa: E402

from gemma4serve.engine.args import EngineArgs  # noqa: E402
from gemma4serve.engine.cuda_graphs import CudaGraphs  # noqa: E402
from gemma4serve.engine.engine import LLMEngine  # noqa: E402


def charged_kernels(prof) -> list[tuple]:
    """(event, charged µs) of every kernel in start order: each is charged from the latest end
    before it (or its own start, after an idle gap) to its own end, so the charges sum to the busy
    time however PDL overlaps the kernels."""
    kernels = sorted(
        (
            event
            for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in event.name.lower()
            and "memset" not in event.name.lower()
        ),
        key=lambda event: event.time_range.start,
    )
    out, last_end = [], float("-inf")
    for event in kernels:
        start, end = event.time_range.start, event.time_range.end
        out.append((event, max(0.0, end - max(last_end, start))))
        last_end = max(last_end, end)
    return out


def report(prof, title: str, steps: int) -> None:
    """Print per kernel name the profiler's kernel time and the time charged on the critical path.

    With PDL a kernel is resident (and counted by the profiler) while it waits for its predecessor,
    so kernel times overlap and overcount; charged time (`charged_kernels`) does not.
    """
    rows = {}
    for event, charged in charged_kernels(prof):
        t, c, n = rows.get(event.name, (0.0, 0.0, 0))
        rows[event.name] = (t + event.time_range.end - event.time_range.start, c + charged, n + 1)
    total = sum(t for t, _, _ in rows.values()) / steps
    charged = sum(c for _, c, _ in rows.values()) / steps
    n = sum(k for _, _, k in rows.values()) // steps
    print(
        f"\n## {title}: {charged / 1e3:.2f} ms busy per step "
        f"({total / 1e3:.2f} ms of kernel time), {n} kernels"
    )
    print("  charged  kernel time  count  kernel")
    for name, (t, c, k) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:24]:
        print(f"{c / steps / 1e3:8.3f} ms {t / steps / 1e3:8.3f} ms x{k // steps:<5} {name[:100]}")


def gemv_roles(prof, steps: int, engine) -> None:
    """The target's GEMVs by layer kind and projection, charged time against each one's weight
    bytes at the copy rate. Only for a step of four GEMVs a layer (qkv, o_proj, gate_up, down, in
    that order: no drafter, no MoE or PLE), which this matches by count."""
    layers = engine.state.target.layers
    gemvs = [charged for event, charged in charged_kernels(prof) if event.name == "_gemv_kernel"]
    if len(gemvs) != steps * 4 * len(layers):
        print(f"\n(no GEMV breakdown: {len(gemvs) / steps:.0f} GEMVs a step, not 4 a layer)")
        return
    rows: dict[tuple[str, str], dict] = {}
    for i, charged in enumerate(gemvs):
        layer = layers[(i // 4) % len(layers)]
        role, weight = [
            ("qkv", layer.self_attn.qkv),
            ("o_proj", layer.self_attn.o_proj.weight),
            ("gate_up", layer.mlp.gate_up),
            ("down", layer.mlp.down_proj.weight),
        ][i % 4]
        row = rows.setdefault(
            (layer.self_attn.spec.kind, role),
            dict(charged=0.0, bytes=0, count=0, shape=list(weight.shape)),
        )
        row["charged"] += charged / steps
        row["bytes"] += weight.numel() * weight.element_size() / steps
        row["count"] += 1 / steps
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print("\n## the GEMVs by layer kind and projection, per step (this rank's weights)")
    print("  charged  at copy rate   share  count  layers, projection [N, K]")
    for (kind, role), row in sorted(rows.items()):
        charged, floor = row["charged"], row["bytes"] / bandwidth * 1e6  # µs
        print(
            f"{charged / 1e3:8.3f} ms {floor / 1e3:8.3f} ms {100 * floor / charged:6.1f}% "
            f"x{row['count']:<5.0f} {kind}, {role} {row['shape']}"
        )
    charged = sum(row["charged"] for row in rows.values())
    floor = sum(row["bytes"] for row in rows.values()) / bandwidth * 1e6
    print(f"{charged / 1e3:8.3f} ms {floor / 1e3:8.3f} ms {100 * floor / charged:6.1f}%  all")


def idle_gaps(prof, steps: int, top: int = 8) -> None:
    """The GPU's idle time per step and the kernel pairs around the longest gaps (a gap is time
    with no kernel resident: the host had queued nothing)."""
    spans = sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    gaps, last_end, last_name = {}, spans[0][1], spans[0][2]  # pair -> every gap's length
    for start, end, name in spans[1:]:
        if start > last_end:
            gaps.setdefault(f"{last_name[:50]} -> {name[:50]}", []).append(start - last_end)
        if end > last_end:
            last_end, last_name = end, name
    idle = sum(sum(lengths) for lengths in gaps.values())
    # times seen and the longest tell a gap in every step from a rare long one
    print(f"\nGPU idle: {idle / steps / 1e3:.3f} ms per step; the longest, per step:")
    print("  us/step  times  longest us  kernels before -> after")
    for key, lengths in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(lengths) / steps:9.1f} {len(lengths):6d} {max(lengths):11.1f}  {key}")


def host_time(engine, steps: int) -> None:
    """Per step: the host's time waiting for the GPU (the step handles' event synchronize) and the
    rest, then where the rest goes under cProfile (which slows the host)."""
    import cProfile
    import pstats

    waited = [0.0]
    synchronize = torch.cuda.Event.synchronize

    def timed(event):
        t = time.perf_counter()
        synchronize(event)
        waited[0] += time.perf_counter() - t

    torch.cuda.Event.synchronize = timed
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    finally:
        torch.cuda.Event.synchronize = synchronize
    print(
        f"\n## host: {wall / steps * 1e3:.3f} ms per step, {waited[0] / steps * 1e3:.3f} ms of it "
        f"waiting for the GPU, {(wall - waited[0]) / steps * 1e3:.3f} ms working"
    )
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [engine.step() for _ in range(steps)])
    print(f"cProfile, {steps} steps (cumulative seconds; the profiler slows the host):")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


def engine_loop(args) -> None:
    """Time the served decode loop per step against its graph replay; list the kernels around it."""
    from gemma4serve.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            draft=args.draft or None,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=args.batch,
            num_draft_tokens=args.k if args.draft else 0,
            max_model_len=args.context + 1024,
            tensor_parallel_size=args.tensor_parallel_size,
            forced_acceptance=args.forced_acceptance,
        )
    )
    # Long enough for every measured step at 3+ tokens a step (forced acceptance): 240 steps.
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 10 for j in range(args.context)], params)
    for _ in range(40):  # prefill, graph warm-up
        engine.step()
    torch.cuda.synchronize()
    steps, t0 = 100, time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    print(f"\n## engine loop, batch {args.batch}: {wall * 1e3:.3f} ms per step")
    # Under PDL kernel times overlap (a kernel waits while resident): the charged column counts
    # each microsecond of the step once.
    report(prof, "the engine loop's kernels, the graph's too", 20)
    gemv_roles(prof, 20, engine)
    idle_gaps(prof, 20)
    rows = {}
    for event in prof.key_averages():
        # Keep what runs outside the layers: the graph's kernels run once per layer (x60 a step).
        if event.device_type == torch.autograd.DeviceType.CUDA and event.count < 20 * 8:
            rows[event.key] = (event.device_time_total / 20, event.count / 20)
    print(
        f"kernels and copies run fewer than 8 times per step (outside the layers): "
        f"{sum(t for t, _ in rows.values()) / 1e3:.3f} ms per step"
    )
    for name, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        print(f"{t:9.1f} us x{c:<4.1f} {name[:110]}")
    host_time(engine, 40)
    # Last of all: a lone replay rewrites the graph's outputs, which the step in flight reads next
    # (steps after it would embed whatever it left there).
    if args.tensor_parallel_size == 1:  # a lone replay on rank 0 would wait on the other ranks
        graphs = engine.runner.graphs
        # The served loop is greedy: its graph ends in the greedy head (where one is captured).
        key = (graphs.bucket(args.batch), engine.stats.draft_length + 1, True)
        graph = graphs.target_graphs[key if key in graphs.target_graphs else key[:2] + (False,)][0]
        replay = CudaGraphs._time(graph, reps=20)
        print(
            f"\n## the graph's replay alone: {replay * 1e3:.3f} ms; the engine loop's step "
            f"{1e3 * (wall - replay):.3f} ms more"
        )
    engine.shutdown()  # tensor-parallel workers leave (nothing to do on one device)


def mixed_step(args) -> None:
    """Wall time against GPU busy time of steps carrying `args.mixed` prompt tokens.

    The server's default sequence cap and token budget (the budget grown only where the prompt and
    the verifications would not fit it), so the step replays the mixed graph bucket serving
    replays: a smaller cap or budget gives other buckets, and other attention grids and splits."""
    from gemma4serve.sampling_params import SamplingParams

    k = args.k if args.draft else 0
    served = EngineArgs.max_num_batched_tokens
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            draft=args.draft or None,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            num_draft_tokens=k,
            max_model_len=max(args.context, args.mixed) + 512,
            max_num_batched_tokens=max(served, args.mixed + args.batch * (k + 1)),
            forced_acceptance=args.forced_acceptance,
        )
    )
    graphs = engine.runner.graphs
    if args.eager_mixed and graphs is not None:
        graphs.fits_mixed = lambda *_: False  # the runner's one graph-or-eager choice
    decoding = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(
            f"r{i}", [(7 * i + j) % 1000 + 10 for j in range(args.context)], decoding
        )
    for _ in range(40):  # prefill, graph warm-up
        engine.step()
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    length = args.prompt_len or args.mixed
    lengths = [length] * (args.mixed // length)
    if args.mixed % length:
        lengths.append(args.mixed % length)
    probes, walls = 5, []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(probes):
            for n, tokens in enumerate(lengths):
                prompt = [(11 * i + 13 * n + j) % 1000 + 10 for j in range(tokens)]
                engine.add_request(f"p{i}.{n}", prompt, one_token)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            # Under async scheduling the prompt may join the step after the one already queued:
            # time both steps, as the busy time below counts both.
            engine.step()
            engine.step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    wall = sorted(walls)[probes // 2]
    rows = args.mixed + args.batch * (k + 1)
    if args.eager_mixed or graphs is None:
        how = "eager, exact rows"
    else:
        bucket = next(t for t in graphs.mixed_tokens if t >= rows)
        how = f"the {bucket}-row mixed graph, {bucket - rows} rows padding"
    print(
        f"\n## steps with prompts of {lengths} tokens beside {args.batch} decodes (k={k}; {rows} "
        f"rows if one step takes them all: {how}): {wall * 1e3:.2f} ms wall for the probe's two "
        f"steps (median of {probes})"
    )
    report(prof, "each probe and the decode step after it", probes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="configs/gemma-4-31B-it")
    parser.add_argument("--draft", default="configs/gemma-4-31B-it-assistant")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=1128)
    parser.add_argument(
        "--engine-loop", action="store_true", help="profile the served step loop (see above)"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="with --engine-loop: rank 0's kernels of a tensor-parallel engine",
    )
    parser.add_argument(
        "--forced-acceptance",
        type=float,
        help="with --engine-loop or --mixed: tokens per verify step (dummy weights accept almost "
        "no drafts, so the adaptive draft length would stop drafting)",
    )
    parser.add_argument(
        "--mixed", type=int, default=0, help="time steps carrying this many prompt tokens (above)"
    )
    parser.add_argument(
        "--prompt-len", type=int, help="with --mixed: prompts of this length (default: one prompt)"
    )
    parser.add_argument(
        "--eager-mixed",
        action="store_true",
        help="with --mixed: run the steps with prompts eagerly at their exact rows, not on the "
        "padded mixed graphs",
    )
    args = parser.parse_args()
    if args.mixed:
        return mixed_step(args)
    if args.engine_loop:
        return engine_loop(args)
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            draft=args.draft,
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=args.batch,
            num_draft_tokens=args.k,
            max_model_len=args.context + 64,
            enforce_eager=True,
        )
    )
    state = engine.state
    for k, title in ((0, "decode step"), (args.k, f"verify step (k={args.k})")):
        chunks = fake_decoding_sequences(engine, args.batch, args.context, k)
        graphs = CudaGraphs(state, args.batch, engine.max_model_len, args.k)
        graphs.buckets, graphs.q_lens = [args.batch], [k + 1]
        graphs.draft_lengths = [k] if k else []
        graphs.capture()
        for _ in range(3):
            replay_target(graphs, chunks)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                replay_target(graphs, chunks)
            torch.cuda.synchronize()
        report(prof, title, 5)
        if k:
            B = args.batch
            tokens = torch.zeros(B, dtype=torch.int64, device="cuda")
            hidden = torch.zeros(B, state.target.cfg.hidden_size, dtype=state.dtype, device="cuda")
            P = torch.full((B,), args.context, dtype=torch.int64, device="cuda")
            rows = torch.arange(B, dtype=torch.int32, device="cuda")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graphs.run_draft(tokens, hidden, P, rows, k)
                torch.cuda.synchronize()
            report(prof, f"draft loop (k={args.k})", 5)
        for ch in chunks:
            engine.kv.free(ch.seq, committed=0)


if __name__ == "__main__":
    main()
