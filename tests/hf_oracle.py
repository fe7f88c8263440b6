"""transformers 5.17 as the oracle (a test dependency only).

It loads the tiny checkpoints strictly, in fp32 eager.
"""

from __future__ import annotations

import torch


def load_hf_target(path, dtype=torch.float32, device="cpu", attn="eager"):
    import json

    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    release = json.loads((path / "config.json").read_text())["model_type"] == "gemma4"
    cls = Gemma4ForConditionalGeneration if release else Gemma4ForCausalLM
    model, info = cls.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.to(device).eval()


def load_hf_assistant(path, dtype=torch.float32, device="cpu"):
    from transformers import Gemma4AssistantForCausalLM

    model, info = Gemma4AssistantForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.to(device).eval()


def text_model(hf):
    """The Gemma4TextModel inside either wrapper."""
    inner = hf.model
    return inner.language_model if hasattr(inner, "language_model") else inner


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    device = next(hf.parameters()).device
    return hf(torch.tensor([ids], device=device)).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    device = next(hf.parameters()).device
    from transformers import GenerationConfig

    # No EOS: the engine runs with ignore_eos; min_new_tokens would instead *suppress* EOS logits.
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    saved, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
    try:
        out = hf.generate(torch.tensor([ids], device=device), generation_config=config)
    finally:
        hf.generation_config.eos_token_id = saved
    return out[0, len(ids) :].tolist()
