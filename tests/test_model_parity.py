"""The target decoder against transformers 5.17 on tiny random checkpoints (fp32, CPU).

Every variant: dense, MoE and PLE, each in the release and the text-only config format.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gemma4serve import LLM, SamplingParams
from gemma4serve.engine.runner import scheduled_batch
from gemma4serve.engine.sequence import ScheduledChunk, Sequence
from tests.hf_oracle import hf_greedy, hf_logits, load_hf_target

VARIANTS = ["dense", "moe", "ple"]


def prompt_of(n: int, seed: int) -> list[int]:
    """`n` ordinary (non-special) token ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(110, 500, (n,), generator=generator).tolist()


@torch.inference_mode()
def engine_logits(llm: LLM, prompt: list[int], chunk: int) -> torch.Tensor:
    """All-position logits of one prompt, run in chunks through the engine's step preparation."""
    engine = llm.engine
    seq = Sequence("parity", 0, list(prompt), len(prompt), SamplingParams(), 0, 0, len(prompt))
    out = []
    try:
        for start in range(0, len(prompt), chunk):
            length = min(chunk, len(prompt) - start)
            engine.kv.grow(seq, start, start + length)
            batch = scheduled_batch([ScheduledChunk(seq, start, length, [])])
            batch = dataclasses.replace(batch, readout=None)  # every row's logits are read
            hidden = engine.runner.forward(batch, greedy=False).hidden
            out.append(engine.state.target.logits(hidden).float())
    finally:
        engine.kv.free(seq, committed=0)
    return torch.cat(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(
    scope="module",
    params=[(v, fmt) for v in VARIANTS for fmt in (True, False)],
    ids=lambda p: f"{p[0]}-{'release' if p[1] else 'text'}",
)
def pair(request, tiny_checkpoints):
    variant, release = request.param
    path = tiny_checkpoints.get(variant, release_format=release)
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)
    return variant, llm, load_hf_target(path)


def test_logits_match_hf_one_prefill_and_chunks(pair):
    variant, llm, hf = pair
    window = llm.engine.cfg.sliding_window
    prompt = prompt_of(3 * window + 5, seed=1)  # longer than the sliding window
    ref = hf_logits(hf, prompt)
    free0 = llm.engine.kv_pool_free()
    whole = engine_logits(llm, prompt, chunk=len(prompt))
    # Chunks that straddle the window boundary, including a 1-token chunk.
    chunked = engine_logits(llm, prompt, chunk=window - 3)
    assert rel_err(whole, ref) < 1e-4
    assert rel_err(chunked, ref) < 1e-4
    assert llm.engine.kv_pool_free() == free0


def test_greedy_matches_hf_generate(pair):
    variant, llm, hf = pair
    prompts = [prompt_of(n, seed=n) for n in (5, 2 * llm.engine.cfg.sliding_window + 3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 40)


def test_mixed_batch_equals_each_alone(pair):
    variant, llm, _ = pair
    engine = llm.engine
    free0 = engine.kv_pool_free()
    prompts = [prompt_of(n, seed=100 + n) for n in (1, 7, 30, 45)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, sp)]  # prefill chunks mixed with decodes
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert together == alone
    assert engine.kv_pool_free() == free0


@pytest.mark.parametrize("variant", VARIANTS)
@torch.inference_mode()
def test_rows_past_the_last_kv_write_are_the_read_out_rows(variant, tiny_checkpoints):
    """A prompt step writes the last K/V layer's K/V for every row, runs the rest of the model on
    the rows it samples from alone, and they come out as when every row runs it."""
    llm = LLM(str(tiny_checkpoints.get(variant)), device="cpu", dtype="float32")
    engine, cfg = llm.engine, llm.engine.cfg
    free0 = engine.kv_pool_free()
    prompts = [prompt_of(20, seed=1), prompt_of(9, seed=2)]
    seqs = [
        Sequence(f"s{i}", 0, p, len(p), SamplingParams(), 0, i, len(p) + 1)
        for i, p in enumerate(prompts)
    ]
    # The first prompt's first 12 tokens (nothing read), the second prompt whole (its last row).
    chunks = [ScheduledChunk(seqs[0], 0, 12, []), ScheduledChunk(seqs[1], 0, 9, [])]
    for chunk in chunks:
        engine.kv.grow(chunk.seq, 0, chunk.length)
    batch = scheduled_batch(chunks)
    assert batch.readout.tolist() == [0, 1]
    writer = engine.state.target.layers[cfg.first_shared - 1]  # the last layer writing K/V
    rows = {"projected": [], "mlp": []}

    def count(name):
        return lambda _, args: rows[name].append(len(args[0]))

    hooks = [
        writer.self_attn.register_forward_pre_hook(count("projected")),
        writer.mlp.register_forward_pre_hook(count("mlp")),
    ]
    try:
        read = engine.runner.forward(batch, greedy=False).hidden[20]
        every = engine.runner.forward(
            dataclasses.replace(batch, readout=None), greedy=False
        ).hidden[20]
    finally:
        for hook in hooks:
            hook.remove()
        for seq in seqs:
            engine.kv.free(seq, committed=0)
    assert rows == {"projected": [21, 21], "mlp": [1, 21]}
    torch.testing.assert_close(read, every)
    assert engine.kv_pool_free() == free0


def test_a_prompt_read_only_in_its_last_chunk_matches_hf(pair):
    """A prompt over chunks of 64 + 64 + 2 tokens: the first two chunks' rows leave only their K/V
    (nothing reads them), and the first token's logprobs are the oracle's."""
    variant, llm, hf = pair
    prompt = prompt_of(130, seed=9)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=5))[0]
    got = out.outputs[0].new_logprobs[0].top
    expected = torch.log_softmax(hf_logits(hf, prompt)[-1], dim=-1).topk(5)
    assert [token for token, _ in got] == expected.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([logprob for _, logprob in got]), expected.values, atol=1e-4, rtol=1e-4
    )


def test_prompt_logprobs_match_hf(pair):
    """Prompt logprobs score every prompt token as the oracle's log-softmax does, over prefill
    chunks (every scored row is a read-out row)."""
    variant, llm, hf = pair
    prompt = prompt_of(150, seed=7)  # three chunks of the 64-token budget
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    expected = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
    expected = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    scored = torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]])
    torch.testing.assert_close(scored, expected, atol=1e-4, rtol=1e-4)
