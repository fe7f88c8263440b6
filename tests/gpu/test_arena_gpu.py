"""The KV arena at the real models' page layouts: the Triton kernels against the torch reference.

The tiny checkpoints' pages hold 4 or 8 positions; the released models' full-layer pages hold 160
(31B, 26B-A4B), 40 (E4B, not a power of two) or 32 (E2B) positions at a page stride of a whole
arena page. Dummy weights of the real E4B and E2B shapes, teacher-forced logits of a prompt longer
than the sliding window, prefilled in chunks: the Triton attention and K/V writers must give what
the torch reference gives on the same arena.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gemma4serve import LLM
from gemma4serve.attention.torch_backend import TorchAttention
from gemma4serve.config import FULL, SLIDING
from tests.test_model_parity import engine_logits, prompt_of, rel_err

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name, full_tokens", [("gemma-4-E4B-it", 40), ("gemma-4-E2B-it", 32)])
def test_real_page_layouts_match_the_reference(name, full_tokens):
    llm = LLM(
        str(CONFIGS / name),
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        enforce_eager=True,
        attention_backend="triton",
        max_model_len=4096,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        kv_cache_memory=2 * 2**30,
    )
    engine = llm.engine
    assert engine.state.kv_plan.page_tokens == {SLIDING: 16, FULL: full_tokens}
    prompt = prompt_of(3 * engine.cfg.sliding_window + 77, seed=5)
    triton_logits = engine_logits(llm, prompt, chunk=300)
    engine.state.attn = TorchAttention()
    torch_logits = engine_logits(llm, prompt, chunk=300)
    error = rel_err(triton_logits, torch_logits)
    print(f"{name}: Triton vs torch rel err {error:.4f}")
    assert error < 2e-2
    # The prompt's greedy continuation agrees where the reference's margin is clear.
    top2 = torch_logits.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    same = triton_logits.argmax(-1) == torch_logits.argmax(-1)
    assert bool(same[clear].all())
