"""The tiny checkpoint writer: transformers 5.17 (the oracle) must load every file strictly, with
our values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gemma4serve.config import FULL, SLIDING, AssistantConfig, TextConfig, load_config
from gemma4serve.demo.checkpoints import (
    VARIANTS,
    ensure_demo_model,
    write_tiny_assistant,
    write_tiny_checkpoint,
)
from tests.test_loader import file_tensors

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration  # noqa: E402
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM  # noqa: E402


def assert_strict_hf_load(cls, ckpt, *, ignored=()):
    model, info = cls.from_pretrained(ckpt, output_loading_info=True, dtype=torch.bfloat16)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{cls.__name__} did not load {ckpt} strictly: {problems}"
    # The values are ours, not HF's re-initialization (which would set norms and layer_scalar to 1).
    hf_state = model.state_dict()
    for name, t in file_tensors(ckpt).items():
        if name in ignored:
            continue
        assert torch.equal(hf_state[name], t), name
    return model


def dead_kv_names(ckpt) -> set[str]:
    """k/v weights of KV-shared layers: in the release files, ignored by HF (and by us)."""
    cfg = load_config(ckpt)
    shared = [layer.index for layer in cfg.layers if layer.kv_shared]
    return {
        name
        for name in file_tensors(ckpt)
        for index in shared
        for weight in ("k_proj", "k_norm", "v_proj")
        if f".layers.{index}.self_attn.{weight}" in name
    }


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("release_format", [True, False], ids=["release", "text"])
def test_hf_loads_target_strictly(tiny_checkpoints, variant, release_format):
    ckpt = tiny_checkpoints.get(variant, release_format)
    cls = Gemma4ForConditionalGeneration if release_format else Gemma4ForCausalLM
    dead = dead_kv_names(ckpt)
    assert bool(dead) == (variant == "ple" and release_format)
    model = assert_strict_hf_load(cls, ckpt, ignored=dead)

    # Logits are spread out (not degenerate) and well inside the softcap.
    ids = torch.tensor([[2, 105] + list(range(380, 410))])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    assert torch.isfinite(logits).all()
    assert 1.0 < logits.std().item() and logits.abs().max().item() < 25.0
    assert len(set(logits.argmax(-1).tolist())) > 5


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_loads_assistant_strictly(tiny_checkpoints, variant):
    ckpt = tiny_checkpoints.get_assistant(variant)
    assert_strict_hf_load(Gemma4AssistantForCausalLM, ckpt)
    cfg = load_config(ckpt)
    assert isinstance(cfg, AssistantConfig)
    cfg.check_fits(load_config(tiny_checkpoints.get(variant)))
    assert cfg.use_ordered_embeddings == (variant == "ple")
    assert cfg.text.layer_types == (SLIDING, SLIDING, SLIDING, FULL)
    if cfg.use_ordered_embeddings:
        order = file_tensors(ckpt)["masked_embedding.token_ordering"]
        assert order.dtype == torch.int64
        assert torch.equal(order.sort().values, torch.arange(cfg.text.vocab_size))
        assert cfg.text.vocab_size % cfg.num_centroids == 0


def test_hf_loads_sharded_checkpoint(tiny_checkpoints):
    ckpt = tiny_checkpoints.get("moe", True, shards=3)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (ckpt / "model.safetensors").exists()
    assert_strict_hf_load(Gemma4ForConditionalGeneration, ckpt)
    assert file_tensors(ckpt).keys() == file_tensors(tiny_checkpoints.get("moe", True)).keys()


def test_variant_shapes_and_configs(tiny_checkpoints):
    windows = {}
    for variant in VARIANTS:
        target = load_config(tiny_checkpoints.get(variant))
        assistant = load_config(tiny_checkpoints.get_assistant(variant))
        assert isinstance(target, TextConfig)
        assert target.vocab_size == 512
        assert (
            math.isqrt(target.hidden_size) ** 2 != target.hidden_size
        )  # bf16(sqrt(H)) rounding matters
        assert {SLIDING, FULL} <= set(target.layer_types)
        assert target.final_logit_softcapping == 30.0
        assert target.eos_token_ids == (1, 106, 50)
        assert 8 <= target.sliding_window <= 16
        windows[variant] = (target.sliding_window, assistant.text.sliding_window)
    assert any(t != a for t, a in windows.values())

    dense, moe, ple = (load_config(tiny_checkpoints.get(v)) for v in VARIANTS)
    assert dense.k_eq_v and dense.kind_spec(FULL) == (32, 1) and dense.kind_spec(SLIDING) == (16, 2)
    assert moe.moe and moe.num_experts == 8 and moe.top_k_experts == 2 and moe.k_eq_v
    assert (
        ple.ple_dim > 0 and ple.num_kv_shared_layers > 0 and ple.double_wide_mlp and not ple.k_eq_v
    )
    assert {layer.mlp_width for layer in ple.layers if layer.kv_shared} == {
        2 * ple.intermediate_size
    }


def test_weights_are_randomized(tiny_checkpoints):
    tensors = file_tensors(tiny_checkpoints.get("moe", False))
    for suffix in ("norm.weight", "layer_scalar", "router.scale", "router.per_expert_scale"):
        picked = [t.float().flatten() for n, t in tensors.items() if n.endswith(suffix)]
        assert picked, suffix
        values = torch.cat(picked)
        assert values.std() > 0.1 and (values - 1).abs().mean() > 0.1, suffix
    scalars = torch.cat([t.float() for n, t in tensors.items() if n.endswith("layer_scalar")])
    assert ((scalars > 0.5) & (scalars < 1.5)).all()


def test_deterministic_from_seed(tmp_path, tiny_checkpoints):
    a = write_tiny_checkpoint(tmp_path / "a", "ple", seed=0)
    b = tiny_checkpoints.get("ple")
    c = write_tiny_checkpoint(tmp_path / "c", "ple", seed=1)
    for name in (
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # Release and text-only formats of a variant hold the same values.
    release, text = file_tensors(a), file_tensors(tiny_checkpoints.get("ple", False))
    for name, t in text.items():
        assert torch.equal(release[name.replace("model.", "model.language_model.", 1)], t), name
    d = write_tiny_assistant(tmp_path / "d", "ple", seed=0)
    cached = tiny_checkpoints.get_assistant("ple")
    assert (d / "model.safetensors").read_bytes() == (cached / "model.safetensors").read_bytes()


def test_checkpoint_files(tiny_checkpoints):
    ckpt = tiny_checkpoints.get("dense")
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 106, 50] and gen["do_sample"] is True and gen["top_k"] == 64
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "gemma4" and cfg["architectures"] == [
        "Gemma4ForConditionalGeneration"
    ]
    text = json.loads((tiny_checkpoints.get("dense", False) / "config.json").read_text())
    assert text["model_type"] == "gemma4_text" and text["architectures"] == ["Gemma4ForCausalLM"]
    assert not any("lm_head" in n for n in file_tensors(ckpt))  # tied
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (ckpt / f).exists()


def test_ensure_demo_model_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4SERVE_CACHE", str(tmp_path))
    target, assistant = ensure_demo_model()
    assert target.is_relative_to(tmp_path) and assistant.is_relative_to(tmp_path)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == (target, assistant)
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    load_config(assistant).check_fits(load_config(target))
    assert_strict_hf_load(Gemma4ForConditionalGeneration, target)
    assert_strict_hf_load(Gemma4AssistantForCausalLM, assistant)
