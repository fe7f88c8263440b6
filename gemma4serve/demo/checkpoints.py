"""Tiny random Gemma 4 checkpoints (targets and MTP assistants) in the released file layout.

For tests and the built-in demo: each variant exercises one family of the real models at toy size,
with every norm weight, `layer_scalar` and router scale randomized (Gemma 4's RMSNorm multiplies by
w, so the default 1.0 would hide a missing norm). Weights are a pure function of (variant, seed,
tensor name), so the release-format and text-only files of a variant hold identical values.

- "dense": 31B-like. k_eq_v full layers with their own KV-head count, an explicit sliding/full
           pattern.
- "moe":   26B-A4B-like. 8 experts, top-2, alongside the dense MLP in every layer; k_eq_v.
- "ple":   E2B-like. Per-layer embeddings, the last 3 layers reuse KV (and, as in the published E2B
           files, the release format still carries their unused k/v weights), double-wide MLP on
           those layers.

Assistants: 4 layers (3 sliding + 1 full) with the target's head dims and KV heads per type; dense
and moe use an lm_head, ple the centroid head with a random `token_ordering`.

No transformers import: only torch, safetensors, tokenizers and json.
tests/test_tiny_checkpoint.py checks that transformers 5.17 loads every variant strictly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from gemma4serve.config import FULL, SLIDING, parse_text_config
from gemma4serve.demo.tokenizer import MULTIMODAL_TOKEN_IDS, SPECIAL_TOKENS, build_tiny_tokenizer

LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)

VARIANTS = ("dense", "moe", "ple")
VOCAB_SIZE = 512
DEMO_TEMPLATE = Path(__file__).parent / "chat_template.jinja"
DEMO_VERSION = "demo-v1"  # bump when the demo model changes, so stale caches are not reused

# Standard deviations of the random matrices. Big enough that logits are spread (the tied LM head
# sees RMS-normalized states, so logit std ~ sqrt(H) * EMBED_STD ~ 2), small enough to stay far from
# the softcap.
MATRIX_STD = 0.08
EMBED_STD = 0.3

ROPE_PARAMETERS = {
    FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    SLIDING: {"rope_theta": 10000.0, "rope_type": "default"},
}

# A tiny SigLIP-style vision tower for the release format, so that loaders meet (and skip) real
# `model.vision_tower.*` / `model.embed_vision.*` tensors as in the published files.
VISION_CONFIG = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "patch_size": 4,
    "position_embedding_size": 16,
    "pooling_kernel_size": 3,
    "standardize": True,
    "use_clipped_linears": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    "default_output_length": 4,
}


# ---- configs ------------------------------------------------------------------------------------


def _text_config(**fields) -> dict:
    """A complete gemma4_text config dict, release-style (every field the real files spell out)."""
    cfg = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": 2,
        "dtype": "bfloat16",
        "enable_moe_block": False,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 32,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 48,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "layer_types": None,
        "max_position_embeddings": 4096,
        "model_type": "gemma4_text",
        "moe_intermediate_size": None,
        "num_attention_heads": 4,
        "num_experts": None,
        "num_global_key_value_heads": None,
        "num_hidden_layers": None,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 0,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": json.loads(json.dumps(ROPE_PARAMETERS)),
        "sliding_window": 8,
        "tie_word_embeddings": True,
        "top_k_experts": None,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": VOCAB_SIZE,
        "vocab_size_per_layer_input": VOCAB_SIZE,
    }
    cfg.update(fields)
    cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg


def target_text_config(variant: str) -> dict:
    if variant == "dense":
        return _text_config(
            hidden_size=48, intermediate_size=96, sliding_window=8,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
            num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1,
        )  # fmt: skip
    if variant == "moe":
        return _text_config(
            hidden_size=40, intermediate_size=64, sliding_window=16,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
            num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1,
            enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24,
        )  # fmt: skip
    if variant == "ple":
        return _text_config(
            hidden_size=56, intermediate_size=64, sliding_window=12,
            layer_types=[SLIDING, SLIDING, SLIDING, FULL] * 2,
            num_key_value_heads=1, hidden_size_per_layer_input=8, num_kv_shared_layers=3,
            use_double_wide_mlp=True,
        )  # fmt: skip
    if variant == "demo":  # the built-in demo model: the dense variant, a little larger
        return _text_config(
            hidden_size=96, intermediate_size=256, sliding_window=32,
            layer_types=[SLIDING, SLIDING, SLIDING, FULL] * 2,
            num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1,
        )  # fmt: skip
    raise ValueError(f"unknown tiny variant {variant!r}; expected one of {VARIANTS}")


def assistant_config(variant: str) -> dict:
    target = target_text_config(variant)
    text_config = _text_config(
        hidden_size=64 if variant == "demo" else 32,
        intermediate_size=128 if variant == "demo" else 64,
        layer_types=[SLIDING, SLIDING, SLIDING, FULL],
        # Its own window: it differs from the target's for dense (8 -> 12) and ple (12 -> 8).
        sliding_window={"dense": 12, "moe": 16, "ple": 8, "demo": 32}[variant],
        final_logit_softcapping=None,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=4,
        # Head dims and KV heads per type must be the target's: the drafter reads the target's KV.
        head_dim=target["head_dim"],
        global_head_dim=target["global_head_dim"],
        num_key_value_heads=target["num_key_value_heads"],
        attention_k_eq_v=target["attention_k_eq_v"],
        num_global_key_value_heads=target["num_global_key_value_heads"],
    )
    centroid_head = variant == "ple"
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": target["hidden_size"],
        "centroid_intermediate_top_k": 4,
        "dtype": "bfloat16",
        "model_type": "gemma4_assistant",
        "num_centroids": 16,
        "text_config": text_config,
        "tie_word_embeddings": True,
        "transformers_version": "5.17.0",
        "use_ordered_embeddings": centroid_head,
        **MULTIMODAL_TOKEN_IDS,
    }


def target_config(variant: str, release_format: bool) -> dict:
    text_config = target_text_config(variant)
    if not release_format:
        return {
            "architectures": ["Gemma4ForCausalLM"],
            **text_config,
            "transformers_version": "5.17.0",
        }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "audio_config": None,
        "dtype": "bfloat16",
        "eos_token_id": [1, 106],
        "initializer_range": 0.02,
        "model_type": "gemma4",
        "text_config": text_config,
        "tie_word_embeddings": True,
        "transformers_version": "5.17.0",
        "vision_config": VISION_CONFIG,
        "vision_soft_tokens_per_image": 4,
        **MULTIMODAL_TOKEN_IDS,
        "eoa_token_index": MULTIMODAL_TOKEN_IDS["eoa_token_id"],
    }


GENERATION_CONFIG = {
    "bos_token_id": 2,
    "do_sample": True,
    "eos_token_id": [1, 106, 50],
    "pad_token_id": 0,
    "temperature": 1.0,
    "top_k": 64,
    "top_p": 0.95,
    "transformers_version": "5.17.0",
}

TOKENIZER_CONFIG = {
    "backend": "tokenizers",
    "tokenizer_class": "GemmaTokenizer",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
    "padding_side": "left",
    "model_max_length": 4096,
    # The named Gemma 4 control tokens, as in the released tokenizer_config.json.
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "think_token": "<|think|>",
    "std_token": "<|tool>",
    "etd_token": "<tool|>",
    "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>",
    "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>",
    "escape_token": '<|"|>',
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
    "extra_special_tokens": ["<|video|>"],
}
assert all(
    token in SPECIAL_TOKENS.values()
    for key, token in TOKENIZER_CONFIG.items()
    if key.endswith("_token")
)


# ---- tensors ------------------------------------------------------------------------------------


def text_tensor_shapes(
    text_config: dict, *, dead_shared_kv: bool = False
) -> dict[str, tuple[int, ...]]:
    """Decoder tensors (names without the `model.` / `model.language_model.` prefix) and their
    shapes. `dead_shared_kv`: also list k_proj/k_norm/v_proj for KV-shared layers (present in the
    published E2B/E4B files, ignored by every reader)."""
    cfg = parse_text_config(text_config)
    hidden, num_heads = cfg.hidden_size, cfg.num_heads
    ple_dim, num_layers = cfg.ple_dim, cfg.num_layers
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, hidden)}
    if ple_dim:
        shapes["embed_tokens_per_layer.weight"] = (cfg.ple_vocab_size, num_layers * ple_dim)
        shapes["per_layer_model_projection.weight"] = (num_layers * ple_dim, hidden)
        shapes["per_layer_projection_norm.weight"] = (ple_dim,)
    for layer in cfg.layers:
        prefix = f"layers.{layer.index}."
        for norm in LAYER_NORMS:
            shapes[prefix + norm + ".weight"] = (hidden,)
        shapes[prefix + "layer_scalar"] = (1,)
        q_width, kv_width = num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        shapes[prefix + "self_attn.q_proj.weight"] = (q_width, hidden)
        shapes[prefix + "self_attn.q_norm.weight"] = (layer.head_dim,)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, q_width)
        if not layer.kv_shared or dead_shared_kv:
            shapes[prefix + "self_attn.k_proj.weight"] = (kv_width, hidden)
            shapes[prefix + "self_attn.k_norm.weight"] = (layer.head_dim,)
            if not layer.k_eq_v:
                shapes[prefix + "self_attn.v_proj.weight"] = (kv_width, hidden)
        shapes[prefix + "mlp.gate_proj.weight"] = (layer.mlp_width, hidden)
        shapes[prefix + "mlp.up_proj.weight"] = (layer.mlp_width, hidden)
        shapes[prefix + "mlp.down_proj.weight"] = (hidden, layer.mlp_width)
        if ple_dim:
            shapes[prefix + "per_layer_input_gate.weight"] = (ple_dim, hidden)
            shapes[prefix + "per_layer_projection.weight"] = (hidden, ple_dim)
            shapes[prefix + "post_per_layer_input_norm.weight"] = (hidden,)
        if cfg.moe:
            num_experts, expert_width = cfg.num_experts, cfg.moe_intermediate_size
            shapes[prefix + "router.proj.weight"] = (num_experts, hidden)
            shapes[prefix + "router.scale"] = (hidden,)
            shapes[prefix + "router.per_expert_scale"] = (num_experts,)
            shapes[prefix + "experts.gate_up_proj"] = (num_experts, 2 * expert_width, hidden)
            shapes[prefix + "experts.down_proj"] = (num_experts, hidden, expert_width)
            for norm in (
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
            ):
                shapes[prefix + norm + ".weight"] = (hidden,)
    shapes["norm.weight"] = (hidden,)
    return shapes


def vision_tensor_shapes(text_hidden: int) -> dict[str, tuple[int, ...]]:
    """The tiny vision tower's tensors, full names (they live beside `model.language_model`)."""
    vision = VISION_CONFIG
    hidden, mlp_width = vision["hidden_size"], vision["intermediate_size"]
    head_dim, patch = vision["head_dim"], vision["patch_size"]
    num_heads, num_kv_heads = vision["num_attention_heads"], vision["num_key_value_heads"]
    shapes = {
        "model.vision_tower.std_bias": (hidden,),
        "model.vision_tower.std_scale": (hidden,),
        "model.vision_tower.patch_embedder.position_embedding_table": (
            2,
            vision["position_embedding_size"],
            hidden,
        ),
        "model.vision_tower.patch_embedder.input_proj.weight": (hidden, 3 * patch * patch),
    }
    for index in range(vision["num_hidden_layers"]):
        prefix = f"model.vision_tower.encoder.layers.{index}."
        for proj, heads in (
            ("q_proj", num_heads),
            ("k_proj", num_kv_heads),
            ("v_proj", num_kv_heads),
        ):
            shapes[prefix + f"self_attn.{proj}.linear.weight"] = (heads * head_dim, hidden)
        shapes[prefix + "self_attn.o_proj.linear.weight"] = (hidden, num_heads * head_dim)
        shapes[prefix + "self_attn.q_norm.weight"] = (head_dim,)
        shapes[prefix + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[prefix + "mlp.gate_proj.linear.weight"] = (mlp_width, hidden)
        shapes[prefix + "mlp.up_proj.linear.weight"] = (mlp_width, hidden)
        shapes[prefix + "mlp.down_proj.linear.weight"] = (hidden, mlp_width)
        for norm in LAYER_NORMS:
            shapes[prefix + norm + ".weight"] = (hidden,)
    shapes["model.embed_vision.embedding_projection.weight"] = (text_hidden, hidden)
    return shapes


def assistant_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    # Every assistant layer is KV-shared (it reads the target's KV): it has no k/v weights at all.
    plain = text_tensor_shapes({**cfg["text_config"], "num_kv_shared_layers": 0})
    shapes = {
        f"model.{name}": shape
        for name, shape in plain.items()
        if not re.search(r"self_attn\.(k_proj|k_norm|v_proj)", name)
    }
    hidden, backbone_hidden = cfg["text_config"]["hidden_size"], cfg["backbone_hidden_size"]
    shapes["pre_projection.weight"] = (hidden, 2 * backbone_hidden)
    shapes["post_projection.weight"] = (backbone_hidden, hidden)
    if cfg["use_ordered_embeddings"]:
        shapes["masked_embedding.centroids.weight"] = (cfg["num_centroids"], hidden)
        shapes["masked_embedding.token_ordering"] = (cfg["text_config"]["vocab_size"],)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic random values for one tensor, chosen by what the tensor is."""
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    )
    if name.endswith("token_ordering"):
        return torch.randperm(shape[0], generator=generator, dtype=torch.int64)
    if name.endswith(("layer_scalar", "per_expert_scale")):
        values = torch.rand(shape, generator=generator) + 0.5  # uniform 0.5..1.5
    elif name.endswith(("norm.weight", "router.scale", "std_scale")):
        values = 1.0 + 0.3 * torch.randn(shape, generator=generator)
    elif name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")):
        values = EMBED_STD * torch.randn(shape, generator=generator)
    else:
        values = MATRIX_STD * torch.randn(shape, generator=generator)
    return values.to(dtype)


# ---- writing ------------------------------------------------------------------------------------


def _write_safetensors(out_dir: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    meta = {"format": "pt"}
    if shards <= 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=meta)
        return
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    per_shard = total / shards
    groups: list[list[str]] = [[] for _ in range(shards)]
    written = 0
    for name, tensor in tensors.items():  # fill shards in order, by bytes
        groups[min(int(written // per_shard), shards - 1)].append(name)
        written += tensor.numel() * tensor.element_size()
    groups = [group for group in groups if group]
    weight_map = {}
    for i, group in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: tensors[name] for name in group}, str(out_dir / file_name), metadata=meta)
        weight_map.update({name: file_name for name in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _write_tokenizer_files(out_dir: Path) -> None:
    build_tiny_tokenizer(VOCAB_SIZE).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", TOKENIZER_CONFIG)
    shutil.copyfile(DEMO_TEMPLATE, out_dir / "chat_template.jinja")


def write_tiny_checkpoint(
    out_dir: str | Path,
    variant: str,
    *,
    seed: int = 0,
    release_format: bool = True,
    shards: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a random tiny Gemma 4 target of `variant` ("dense", "moe", "ple") to `out_dir`.

    release_format=True: a `gemma4` wrapper config (Gemma4ForConditionalGeneration), tensors under
    `model.language_model.` plus a tiny vision tower; False: `gemma4_text` (Gemma4ForCausalLM),
    `model.`. shards > 1 writes `model-0000i-of-0000N.safetensors` +
    `model.safetensors.index.json`."""
    if variant not in VARIANTS and variant != "demo":
        raise ValueError(f"unknown tiny variant {variant!r}; expected one of {VARIANTS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = target_config(variant, release_format)
    text_config = cfg["text_config"] if release_format else cfg

    prefix = "model.language_model." if release_format else "model."
    tensors = {
        prefix + name: random_tensor(name, shape, seed, dtype)
        for name, shape in text_tensor_shapes(text_config, dead_shared_kv=release_format).items()
    }
    if release_format:
        vision = vision_tensor_shapes(text_config["hidden_size"])
        tensors.update(
            {name: random_tensor(name, shape, seed, dtype) for name, shape in vision.items()}
        )
    _write_safetensors(out, tensors, shards)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    _write_tokenizer_files(out)
    return out


def write_tiny_assistant(
    out_dir: str | Path, variant: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the MTP assistant for the tiny target `variant` (its `backbone_hidden_size` is that
    target's hidden size)."""
    if variant not in VARIANTS and variant != "demo":
        raise ValueError(f"unknown tiny variant {variant!r}; expected one of {VARIANTS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = assistant_config(variant)
    # Its own seed stream: "assistant/" keeps its embed_tokens apart from the target's.
    shapes = assistant_tensor_shapes(cfg)
    tensors = {
        name: random_tensor("assistant/" + name, shape, seed, dtype)
        for name, shape in shapes.items()
    }
    _write_safetensors(out, tensors, 1)
    _write_json(out / "config.json", cfg)
    _write_tokenizer_files(out)
    return out


def ensure_demo_model(cache_dir: str | Path | None = None) -> tuple[Path, Path]:
    """The built-in demo target and assistant (random weights, tiny vocab), built once and cached
    under `cache_dir`, else $GEMMA4SERVE_CACHE, else ~/.cache/gemma4serve; returns
    (target_dir, assistant_dir)."""
    root = Path(
        cache_dir or os.environ.get("GEMMA4SERVE_CACHE") or Path.home() / ".cache" / "gemma4serve"
    )
    base = root / DEMO_VERSION
    target, assistant = base / "target", base / "assistant"
    done = base / "COMPLETE"
    if not done.exists():
        # Build in a scratch dir and rename it into place, so a crash or a concurrent builder never
        # leaves a half-written model behind the marker.
        base.parent.mkdir(parents=True, exist_ok=True)
        scratch = base.parent / f".{DEMO_VERSION}.tmp-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        write_tiny_checkpoint(scratch / "target", "demo", seed=0, release_format=True)
        write_tiny_assistant(scratch / "assistant", "demo", seed=0)
        (scratch / "COMPLETE").write_text("ok\n")
        try:
            scratch.rename(base)
        except OSError:  # another process won the race (or a stale incomplete dir is in the way)
            if not done.exists():
                shutil.rmtree(base, ignore_errors=True)
                scratch.rename(base)
            else:
                shutil.rmtree(scratch, ignore_errors=True)
    return target, assistant
