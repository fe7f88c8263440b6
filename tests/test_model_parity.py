"""The target decoder against transformers 5.17 on tiny random checkpoints (fp32, CPU).

Every variant: dense, MoE and PLE, each in the release and the text-only config format.
"""

from __future__ import annotations

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
