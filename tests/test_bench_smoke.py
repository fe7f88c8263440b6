"""bench/bench_offline.py end to end on a tiny checkpoint (CPU, seconds): it prints its tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ["conc", "reqs", "out tok/s", "tot tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
           "ITL p50", "ITL p99", "acc len", "draft %", "roof TPOT", "% roof"]  # fmt: skip


def run_bench(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    bench = str(ROOT / "bench" / "bench_offline.py")
    proc = subprocess.run(
        [sys.executable, bench, "--tiny", "--device", "cpu", *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def table(out: str) -> dict[int, dict[str, float]]:
    """The results table: {concurrency: {column: value}}."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["conc", "reqs"])
    rows = {}
    for line in lines[start + 1 :]:
        cells = line.split()
        if not cells:
            break
        if not cells[0].isdigit():  # a level's detail lines: step times, slow steps
            continue
        assert len(cells) == len(COLUMNS), line
        rows[int(cells[0])] = dict(zip(COLUMNS, map(float, cells)))
    return rows


def test_bench_prints_a_row_per_concurrency():
    out = run_bench(
        "--input-len", "60", "--output-len", "12", "--concurrency", "1", "3", "--num-prompts", "3",
        "--num-draft-tokens", "3", "--forced-acceptance", "3.1", "--bandwidth-gbps", "50",
        "--matmul-tflops", "5",
    )  # fmt: skip
    first = out.splitlines()[0]
    assert first.startswith("command: ") and "--forced-acceptance 3.1" in first
    assert "device: CPU" in out
    assert "bandwidth for the roofline: 50 GB/s (given)" in out
    rows = table(out)
    assert set(rows) == {1, 3}
    for row in rows.values():
        assert row["reqs"] == 3
        assert row["out tok/s"] > 0 and row["tot tok/s"] > row["out tok/s"]
        assert 0 < row["TTFT p50"] <= row["TTFT p99"]
        assert 0 < row["TPOT p50"] <= row["TPOT p99"]
        assert row["roof TPOT"] > 0
        # Forced acceptance of 3.1 tokens per step; every step drafts but the one that ends each
        # prompt.
        assert 2.0 < row["acc len"] <= 4.0
        assert 50 < row["draft %"] < 100
    assert out.count("GB/step") == 2
    assert "matmul rate for the roofline: 5 TFLOP/s (given)" in out
    assert out.count("out tok/s (prompts' GEMMs and decode steps overlapped)") == 2
    # Every measured prompt is prefilled whole: the warm-up's prompts are others (a 60-token prompt
    # would otherwise hit the prefix cache).
    assert out.count("(180 prompt tokens,") == 2


def test_bench_hf_baseline_on_the_same_weights():
    pytest.importorskip("transformers")
    out = run_bench(
        "--input-len", "20", "--output-len", "8", "--concurrency", "1", "--num-prompts", "2",
        "--num-draft-tokens", "2", "--hf-baseline",
    )  # fmt: skip
    assert set(table(out)) == {1}
    hf_rows = [
        line
        for line in out.splitlines()
        if line.strip().startswith(("transformers", "+ assistant_model"))
    ]
    assert len(hf_rows) == 2, out
    # Greedy on the same weights: HF generates our tokens exactly, with and without the assistant.
    assert all(line.rstrip().endswith("yes") for line in hf_rows), out
    assert "gemma4serve (this run" in out


def test_bench_serve_over_the_real_server(tiny_checkpoints, tmp_path):
    """bench/bench_serve.py starts the server, warms each level up, streams a few requests per
    level, prints a row per concurrency with the accepted length from /metrics and the roofline,
    and saves JSON. The warm-up must not put the measured prompts in the prefix cache."""
    target, assistant = tiny_checkpoints.get("dense"), tiny_checkpoints.get_assistant("dense")
    result_file = tmp_path / "result.json"
    server_args = "--device cpu --num-draft-tokens 3 --max-model-len 256 --forced-acceptance 3.1"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_serve.py"), "--model", str(target),
         "--draft", str(assistant), "--server-args", server_args, "--input-len", "60",
         "--output-len", "12", "--concurrency", "1", "3", "--num-prompts", "3",
         "--bandwidth-gbps", "50", "--matmul-tflops", "5", "--result-file", str(result_file),
         "--save-detailed"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()  # the server's log goes to stderr
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["conc", "reqs"])
    rows = {
        int(line.split()[0]): line.split()
        for line in lines[header + 1 :]
        if line.split() and line.split()[0].isdigit()
    }
    assert set(rows) == {1, 3} and all(row[1] == "3" for row in rows.values())
    levels = json.loads(result_file.read_text())["levels"]
    assert [level["concurrency"] for level in levels] == [1, 3]
    for level in levels:
        assert level["completed"] == 3 and level["failed"] == 0
        assert level["output_tokens"] == 3 * 12 and level["output_throughput"] > 0
        assert 0 < level["p50_ttft_ms"] <= level["p99_ttft_ms"]
        assert 0 < level["p50_tpot_ms"] <= level["p99_tpot_ms"]
        # Forced acceptance of 3.1 tokens per verify step, read from the server's counters.
        assert 2.0 < level["mean_accepted_length"] <= 4.0
        assert level["preemptions"] == 0
        assert 0 <= level["mean_queue_ms"] <= level["p99_ttft_ms"]  # from the server's histogram
        assert level["prompt_tokens"] == 3 * 60 and level["prefix_cache_hit_tokens"] == 0
        assert level["roofline_tpot_ms"] > 0
        # The server's steps: every prompt row and at least one row per output token after the
        # first; a request needs at least 4 steps (12 outputs, at most 4 a verify step), one at a
        # time at c = 1.
        steps = level["engine_steps"]
        assert steps >= 4 * (3 if level["concurrency"] == 1 else 1)
        assert level["mean_step_tokens"] * steps >= 3 * (60 + 11)
        assert level["mean_step_ms"] == pytest.approx(1e3 * level["duration_s"] / steps)
        # --save-detailed: each request's own times, which the level's percentiles are made of.
        assert level["output_lens"] == [12] * 3 and level["errors"] == [""] * 3
        assert min(level["start_times"]) == 0 and all(0 < len(x) <= 11 for x in level["itls"])
        ttfts_ms = sorted(t * 1e3 for t in level["ttfts"])
        assert level["p50_ttft_ms"] == pytest.approx(ttfts_ms[1])
        assert ttfts_ms[0] <= level["p99_ttft_ms"] <= ttfts_ms[-1]
        # The first wave (the level's first `concurrency` requests, sent together) apart.
        sent_ms = [t * 1e3 for t in level["ttfts"]]
        if level["concurrency"] == 1:
            assert level["first_wave_max_ttft_ms"] == pytest.approx(sent_ms[0])
            assert level["after_first_wave_p50_ttft_ms"] == pytest.approx(
                (sent_ms[1] + sent_ms[2]) / 2
            )
        else:  # every request is in the first wave
            assert "first_wave_max_ttft_ms" not in level
        # The roofline's verify steps carry the drafts the server's counters report (3 here: on
        # the CPU the draft length stays fixed).
        assert level["mean_draft_length"] == pytest.approx(3, abs=0.5)
        # Overlapping the prompts' GEMMs with the decode steps can only beat running them in turn;
        # the KV and drafter reads that no GEMM hides sit between the two.
        waves, mixed, overlapped = (
            level["roofline_in_waves_output_throughput"],
            level["roofline_mixed_output_throughput"],
            level["roofline_output_throughput"],
        )
        assert 0 < waves <= overlapped and mixed <= overlapped
        assert level["gpu_power"] is None  # a server on the CPU: nothing sampled, no line printed
    assert "matmul rate for the roofline: 5 TFLOP/s (given)" in proc.stdout
    assert lines[1].startswith("date: 20") and "device: CPU" in proc.stdout  # what docs record
    assert "GPU while it ran" not in proc.stdout
    assert (
        sum("out tok/s (prompts' GEMMs and decode steps overlapped)" in line for line in lines) == 2
    )
    assert sum("TTFT of the first 1 requests (sent together)" in line for line in lines) == 1
    assert sum(line.lstrip().startswith("engine steps ") for line in lines) == 2


def test_bench_with_json_object_constrains_every_request():
    out = run_bench(
        "--input-len", "24", "--output-len", "12", "--concurrency", "1", "3", "--num-prompts", "3",
        "--num-draft-tokens", "3", "--bandwidth-gbps", "50", "--json-object",
    )  # fmt: skip
    assert "--json-object" in out.splitlines()[0]
    rows = table(out)
    assert set(rows) == {1, 3} and all(row["reqs"] == 3 for row in rows.values())


def test_bench_json_object_both_runs_each_level_plain_then_constrained():
    out = run_bench(
        "--input-len", "24", "--output-len", "12", "--concurrency", "1", "--num-prompts", "2",
        "--num-draft-tokens", "3", "--bandwidth-gbps", "50", "--json-object", "both",
    )  # fmt: skip
    labels = [
        line.strip() for line in out.splitlines() if line.strip() in ("plain:", "json_object:")
    ]
    assert labels == ["plain:", "json_object:"], out
    assert out.count("GB/step") == 2


def replay_scheduler_row(*args: str) -> list[str]:
    """The last table row of bench/replay_scheduler.py on the 31B's page plan in a 700-page arena:
    conc, reqs, steps, mixed, prefill tokens, preempt, mean running, padded %."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "replay_scheduler.py"),
         "--model", str(ROOT / "configs" / "gemma-4-31B-it"), "--pages", "700", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()[-1].split()


def test_replay_scheduler_reservation_prevents_preemption():
    """In a tight arena, with the admission reservation no request is preempted and each prompt is
    computed once; reserving nothing for the outputs preempts and computes prompts again."""
    level = ["--concurrency", "16", "--num-prompts", "24", "--input-len", "300",
             "--output-len", "600"]  # fmt: skip
    conc, reqs, steps, mixed, prefill, preempt, running, padded = replay_scheduler_row(*level)
    assert (int(reqs), int(prefill), int(preempt)) == (24, 24 * 300, 0)
    unreserved = replay_scheduler_row(*level, "--no-reservation")
    assert int(unreserved[5]) > 0 and int(unreserved[4]) > 24 * 300


def test_replay_scheduler_counts_mixed_graph_padding():
    """A lone 300-token prompt: its step replays the 384-row mixed graph, 84 rows of padding."""
    row = replay_scheduler_row(
        "--concurrency", "1", "--num-prompts", "1", "--input-len", "300", "--output-len", "4"
    )
    conc, reqs, steps, mixed, prefill, preempt, running, padded = row
    assert (int(mixed), int(prefill), float(padded)) == (1, 300, 28.0)


def test_replay_scheduler_padding_counts_draft_rows():
    """Two 300-token prompts in a 400-token budget: step 1 fills its 400-row graph; step 2 takes
    the first request's verify (1 + 4 drafts) beside the second's last 200 prompt tokens, 205 rows
    on the 256-row graph: 51 rows of padding over 605, 8.4%."""
    row = replay_scheduler_row(
        "--concurrency", "2", "--num-prompts", "2", "--input-len", "300", "--output-len", "4",
        "--max-num-batched-tokens", "400",
    )  # fmt: skip
    conc, reqs, steps, mixed, prefill, preempt, running, padded = row
    assert (int(mixed), int(prefill), float(padded)) == (2, 600, 8.4)


def test_power_sampler_summarizes_what_nvidia_smi_printed(monkeypatch, tmp_path):
    """bench/gpu_power.py over a stand-in nvidia-smi that prints four samples (two held down by
    power: the software cap, then the cap and the hardware brake; one line that does not parse)
    and runs until the sampler stops it."""
    printed = tmp_path / "printed"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo '1980, 300.5, 0x0000000000000000'\n"
        "echo '1455, 690.9, 0x0000000000000004'\n"
        "echo '1470, 695.0, 0x0000000000000084'\n"
        "echo '[N/A], [N/A], [N/A]'\n"
        f"touch {printed}\n"
        "exec sleep 60\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_power

    monkeypatch.setattr(gpu_power, "gpu_uuids", lambda devices: ["GPU-0"] * devices)
    with gpu_power.PowerSampler(devices=1) as power:
        for _ in range(600):  # until the stand-in has printed (it is stopped right after)
            if printed.exists():
                break
            time.sleep(0.05)
    assert power.summary == gpu_power.PowerSummary(
        samples=3, clock_mhz=1470, power_w=690.9, capped_share=pytest.approx(2 / 3)
    )
    assert "SM clock median 1470 MHz" in power.summary.line()
    assert "power cap in 67% of 3 samples" in power.summary.line()
    # No nvidia-smi, or no devices asked for: the sampler starts nothing.
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    for devices in (1, 0):
        with gpu_power.PowerSampler(devices) as power:
            pass
        assert power.summary is None


def test_output_bounds_by_hand(monkeypatch):
    """The three bounds of a loop of 4 requests (100 prompt tokens, 30 outputs, 3 tokens a verify
    step of 2 drafts): GEMMs 0.4 s of prompts (1 GFLOP a token: the 0.5 past the last K/V write
    left out) + 0.18 s of verify rows (1.5 GFLOP each) at 1 TFLOP/s, decode steps 10 x 16 GB at
    1 TB/s = 0.16 s, of which the KV and drafter reads (6 GB a step) no GEMM hides."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from bench_offline import Roofline, output_bounds

    roof = Roofline(
        target=10e9, draft=1e9, kv=5e9, bandwidth=1e12, decode_target=9e9, prompt_flops=1e9,
        row_flops=1.5e9, num_draft_tokens=2,
    )  # fmt: skip
    bounds = output_bounds(roof, 4, 100, 30, 3.0, 1e12)
    assert bounds.num_draft_tokens == 2
    assert bounds.overlapped == pytest.approx(120 / 0.58)  # the GEMMs bind
    assert bounds.mixed == pytest.approx(120 / (0.58 + 0.06))
    assert bounds.in_waves == pytest.approx(120 / (0.4 + 0.16))
    # Without drafts: 30 one-token steps of 14 GB, 120 rows of GEMMs.
    plain = output_bounds(roof, 4, 100, 30, None, 1e12)
    assert plain.num_draft_tokens == 0
    assert plain.overlapped == pytest.approx(120 / 0.58)
    assert plain.mixed == pytest.approx(120 / (0.58 + 30 * 5e9 / 1e12))
    assert plain.in_waves == pytest.approx(120 / (0.4 + 30 * 14e9 / 1e12))


def test_kernel_registers_compiles_every_phase_of_the_attention_kernel():
    """bench/kernel_registers.py compiles the attention kernel for sm_90 on the CPU (outside the
    interpreter the tests run under): a prefill tile, whose short groups' tiles are constexprs of
    their own, and a split decode tile."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    tool = str(ROOT / "bench" / "kernel_registers.py")
    shape = ["--head-dim", "64", "--group", "2", "--block-n", "32", "--warps", "4"]
    for phase in (["--block-t", "32", "--query-rows", "1024"],
                  ["--block-t", "1", "--query-rows", "1", "--stages", "3", "--split"]):  # fmt: skip
        proc = subprocess.run(
            [sys.executable, tool, *shape, *phase], capture_output=True, text=True, timeout=300,
            env=env, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        row = proc.stdout.strip().splitlines()[-1]
        assert "|" in row and "fails" not in row, proc.stdout
