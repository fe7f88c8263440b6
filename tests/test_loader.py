"""Weight loading (safetensors -> module), dummy weights, and checkpoint resolution."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from torch import nn

from gemma4serve.config import load_config, parse_config
from gemma4serve.demo.checkpoints import LAYER_NORMS
from gemma4serve.weights.dummy import init_dummy_weights
from gemma4serve.weights.hub import CheckpointNotFoundError, resolve_checkpoint
from gemma4serve.weights.loader import WeightLoadError, checkpoint_files, load_weights

# ---- a module with HF's parameter names (prefix stripped), built from our parsed config ----------


def linear(n_out, n_in):
    return nn.Linear(n_in, n_out, bias=False)


def norm(n):
    module = nn.Module()
    module.weight = nn.Parameter(torch.empty(n))
    return module


class Layer(nn.Module):
    def __init__(self, cfg, spec, *, with_kv=True):
        super().__init__()
        H, nh, hd = cfg.hidden_size, cfg.num_heads, spec.head_dim
        for name in LAYER_NORMS:
            setattr(self, name, norm(H))
        self.register_buffer("layer_scalar", torch.empty(1))
        self.self_attn = nn.Module()
        self.self_attn.q_proj = linear(nh * hd, H)
        self.self_attn.q_norm = norm(hd)
        self.self_attn.o_proj = linear(H, nh * hd)
        if with_kv and not spec.kv_shared:
            self.self_attn.k_proj = linear(spec.num_kv_heads * hd, H)
            self.self_attn.k_norm = norm(hd)
            if not spec.k_eq_v:
                self.self_attn.v_proj = linear(spec.num_kv_heads * hd, H)
        self.mlp = nn.Module()
        self.mlp.gate_proj = linear(spec.mlp_width, H)
        self.mlp.up_proj = linear(spec.mlp_width, H)
        self.mlp.down_proj = linear(H, spec.mlp_width)
        if cfg.ple_dim:
            self.per_layer_input_gate = linear(cfg.ple_dim, H)
            self.per_layer_projection = linear(H, cfg.ple_dim)
            self.post_per_layer_input_norm = norm(H)
        if cfg.moe:
            E, intermediate = cfg.num_experts, cfg.moe_intermediate_size
            self.router = nn.Module()
            self.router.proj = linear(E, H)
            self.router.scale = nn.Parameter(torch.empty(H))
            self.router.per_expert_scale = nn.Parameter(torch.empty(E))
            self.experts = nn.Module()
            self.experts.gate_up_proj = nn.Parameter(torch.empty(E, 2 * intermediate, H))
            self.experts.down_proj = nn.Parameter(torch.empty(E, H, intermediate))
            for name in (
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
            ):
                setattr(self, name, norm(H))


class TextWeights(nn.Module):
    """The decoder's checkpoint names minus the prefix: `embed_tokens`, `layers.{i}...`, `norm`."""

    def __init__(self, cfg, *, with_kv=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        if cfg.ple_dim:
            L, D = cfg.num_layers, cfg.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(cfg.ple_vocab_size, L * D)
            self.per_layer_model_projection = linear(L * D, cfg.hidden_size)
            self.per_layer_projection_norm = norm(D)
        self.layers = nn.ModuleList(Layer(cfg, spec, with_kv=with_kv) for spec in cfg.layers)
        self.norm = norm(cfg.hidden_size)
        self.lm_head = linear(cfg.vocab_size, cfg.hidden_size)
        self.lm_head.weight = self.embed_tokens.weight  # tied: never in the checkpoint


class AssistantWeights(nn.Module):
    def __init__(self, acfg):
        super().__init__()
        self.model = TextWeights(acfg.text, with_kv=False)
        Ha, Hb = acfg.text.hidden_size, acfg.backbone_hidden_size
        self.pre_projection = linear(Ha, 2 * Hb)
        self.post_projection = linear(Hb, Ha)
        if acfg.use_ordered_embeddings:
            self.masked_embedding = nn.Module()
            self.masked_embedding.centroids = linear(acfg.num_centroids, Ha)
            self.masked_embedding.register_buffer(
                "token_ordering", torch.zeros(acfg.text.vocab_size, dtype=torch.int64)
            )


def text_param_name(prefix: str, cfg):
    """The checkpoint -> module mapping a model module supplies: strip the prefix, skip the rest."""
    shared = {layer.index for layer in cfg.layers if layer.kv_shared}

    def to_param_name(name: str) -> str | None:
        if not name.startswith(prefix):
            return None  # vision / audio towers
        name = name[len(prefix) :]
        match = re.match(r"layers\.(\d+)\.self_attn\.(k_proj|k_norm|v_proj)\.", name)
        if match and int(match.group(1)) in shared:
            return None  # dead k/v weights of KV-shared layers
        return name

    return to_param_name


def file_tensors(ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for f in checkpoint_files(ckpt):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def load_target(ckpt, dtype=torch.float32, module=None):
    cfg = load_config(ckpt)
    module = module or TextWeights(cfg)
    release = json.loads((ckpt / "config.json").read_text())["model_type"] == "gemma4"
    prefix = "model.language_model." if release else "model."
    load_weights(
        module,
        ckpt,
        to_param_name=text_param_name(prefix, cfg),
        device="cpu",
        dtype=dtype,
        progress=False,
    )
    return module, prefix


@pytest.mark.parametrize(
    "variant,release_format,shards",
    [
        ("dense", True, 1),
        ("dense", False, 1),
        ("moe", True, 3),
        ("moe", False, 2),
        ("ple", True, 1),
        ("ple", False, 1),
    ],
)
def test_load_target(tiny_checkpoints, variant, release_format, shards):
    ckpt = tiny_checkpoints.get(variant, release_format, shards=shards)
    assert (ckpt / "model.safetensors.index.json").exists() == (shards > 1)
    module, prefix = load_target(ckpt)
    params = module.state_dict()
    to_name = text_param_name(prefix, load_config(ckpt))
    loaded = 0
    for name, t in file_tensors(ckpt).items():
        pname = to_name(name)
        if pname is not None:
            assert torch.equal(params[pname], t.float()), name
            loaded += 1
    assert loaded == len({id(t) for t in module.state_dict(keep_vars=True).values()})
    assert torch.equal(module.lm_head.weight, module.embed_tokens.weight)


def test_load_keeps_integer_buffers_and_converts_floats(tiny_checkpoints):
    ckpt = tiny_checkpoints.get_assistant("ple")
    acfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    module = AssistantWeights(acfg)
    load_weights(
        module, ckpt, to_param_name=lambda n: n, device="cpu", dtype=torch.bfloat16, progress=True
    )
    order = module.masked_embedding.token_ordering
    assert order.dtype == torch.int64
    assert torch.equal(order, file_tensors(ckpt)["masked_embedding.token_ordering"])
    assert torch.equal(
        module.pre_projection.weight, file_tensors(ckpt)["pre_projection.weight"].float()
    )


def test_missing_weights_are_named(tiny_checkpoints):
    ckpt = tiny_checkpoints.get("dense", False)
    module = TextWeights(load_config(ckpt))
    module.extra = linear(3, 3)
    module.layers[0].register_buffer("lost_scalar", torch.ones(1))
    with pytest.raises(WeightLoadError, match=r"2 module weight\(s\) missing") as e:
        load_target(ckpt, module=module)
    assert "extra.weight" in str(e.value) and "layers.0.lost_scalar" in str(e.value)

    module.optional_weights = {"extra.weight", "layers.0.lost_scalar"}
    load_target(ckpt, module=module)


def test_checkpoint_without_a_weight_the_module_needs(tiny_checkpoints):
    ckpt = tiny_checkpoints.get("moe", True)
    cfg = load_config(ckpt)
    skip = text_param_name("model.language_model.", cfg)

    def without_expert_scale(name):
        return None if name.endswith("layers.2.router.per_expert_scale") else skip(name)

    with pytest.raises(WeightLoadError, match=r"layers\.2\.router\.per_expert_scale"):
        load_weights(
            TextWeights(cfg), ckpt, device="cpu", dtype=None, progress=False,
            to_param_name=without_expert_scale,
        )  # fmt: skip


def test_shape_mismatch_is_named(tiny_checkpoints):
    ckpt = tiny_checkpoints.get("dense", True)
    module = TextWeights(load_config(ckpt))
    # A full k_eq_v layer has 1 KV head of 32: [32, 48].
    module.layers[2].self_attn.k_proj = linear(64, 48)
    with torch.no_grad():
        module.norm.weight.fill_(7.0)
    with pytest.raises(WeightLoadError) as e:
        load_target(ckpt, module=module)
    assert (
        "model.language_model.layers.2.self_attn.k_proj.weight: checkpoint [32, 48], "
        "module layers.2.self_attn.k_proj.weight expects [64, 48]"
    ) in str(e.value)
    # Nothing was copied: every check runs on the headers first.
    assert (module.norm.weight == 7.0).all()


def test_unknown_and_duplicate_targets_are_named(tiny_checkpoints):
    ckpt = tiny_checkpoints.get("dense", True)
    cfg = load_config(ckpt)
    strip = text_param_name("model.language_model.", cfg)

    def keep_vision(name):
        return name.removeprefix("model.") if "vision" in name else strip(name)

    with pytest.raises(
        WeightLoadError, match=r"model\.vision_tower\.std_bias -> vision_tower\.std_bias"
    ):
        load_weights(TextWeights(cfg), ckpt, device="cpu", dtype=None, progress=False,
                     to_param_name=keep_vision)  # fmt: skip
    dup = "model.language_model.layers.0.input_layernorm.weight"
    twice = r"loaded from two checkpoint tensors:\n  norm\.weight <- model\.language_model\."
    with pytest.raises(WeightLoadError, match=twice) as e:
        load_weights(TextWeights(cfg), ckpt, device="cpu", dtype=None, progress=False,
                     to_param_name=lambda n: "norm.weight" if n == dup else strip(n))  # fmt: skip
    message = str(e.value)
    assert dup in message and (
        "missing from the checkpoint:\n  layers.0.input_layernorm.weight" in message
    )


def test_meta_module_is_refused(tiny_checkpoints):
    ckpt = tiny_checkpoints.get("dense", False)
    with torch.device("meta"):
        module = TextWeights(load_config(ckpt))
    with pytest.raises(WeightLoadError, match="meta device"):
        load_target(ckpt, module=module)


def test_no_weights_file(tmp_path):
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        load_weights(nn.Linear(2, 2), tmp_path, to_param_name=lambda n: n, device="cpu", dtype=None)


# ---- dummy weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights(tiny_checkpoints, dtype):
    acfg = load_config(tiny_checkpoints.get_assistant("ple"))
    module = AssistantWeights(acfg).to(dtype)
    init_dummy_weights(module, seed=3)
    state = module.state_dict()
    for name, tensor in state.items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), name
    norms = torch.cat(
        [
            tensor.float()
            for name, tensor in state.items()
            if name.endswith("norm.weight") or name.endswith("layer_scalar")
        ]
    )
    assert ((norms > 0.85) & (norms < 1.15)).all()
    weight = module.pre_projection.weight.float()
    assert 0.015 < weight.std() < 0.025
    order = module.masked_embedding.token_ordering
    assert torch.equal(order.sort().values, torch.arange(acfg.text.vocab_size))
    assert module.model.lm_head.weight is module.model.embed_tokens.weight  # tied: filled once
    again = AssistantWeights(acfg).to(dtype)
    init_dummy_weights(again, seed=3)
    assert all(torch.equal(again.state_dict()[name], tensor) for name, tensor in state.items())
    init_dummy_weights(again, seed=4)
    assert not torch.equal(again.pre_projection.weight, module.pre_projection.weight)


# ---- resolve_checkpoint --------------------------------------------------------------------------


def test_resolve_local_dir(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints.get("dense")
    assert resolve_checkpoint(str(ckpt)) == ckpt
    with pytest.raises(CheckpointNotFoundError, match="no config.json"):
        resolve_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint directory"):
        resolve_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        resolve_checkpoint(str(ckpt / "config.json"))


def test_resolve_from_offline_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--google--gemma-4-tiny"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert resolve_checkpoint("google/gemma-4-tiny", cache_dir=tmp_path) == snap
    with pytest.raises(
        CheckpointNotFoundError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"
    ):
        resolve_checkpoint("google/not-there", cache_dir=tmp_path)
