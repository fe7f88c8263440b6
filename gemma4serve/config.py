"""Typed Gemma 4 configs with every per-layer quantity derived once (docs/gemma4.md §1).

Three `model_type`s are accepted: `gemma4` (the multimodal release wrapper; the text decoder lives
under `text_config`), `gemma4_text`, and `gemma4_assistant` (the MTP drafter). Anything else, or a
feature this engine does not implement, fails here, at startup, with a message that names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SLIDING = "sliding_attention"
FULL = "full_attention"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # full layers of 31B/26B: no v_proj, V = v_norm(raw k_proj output)
    kv_shared: bool  # reads the store layer's KV of its kind, owns none
    kv_layer: int  # the producer layer whose KV this layer attends to (itself unless kv_shared)
    mlp_width: int


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    head_dim: int
    rotated_pairs: int  # frequency pairs that rotate; the rest pass through (proportional RoPE)


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    global_head_dim: int
    num_global_kv_heads: int | None
    k_eq_v: bool
    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict  # kind -> RopeSpec
    rms_norm_eps: float
    final_logit_softcapping: float | None
    ple_dim: int  # hidden_size_per_layer_input; PLE is on iff > 0
    ple_vocab_size: int
    num_kv_shared_layers: int
    double_wide_mlp: bool
    moe: bool
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    max_position_embeddings: int
    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    layers: tuple[LayerSpec, ...]

    @property
    def first_shared(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def store_layer(self, kind: str) -> int:
        """The last producer layer of `kind`: KV-shared layers and the drafter read its KV."""
        owners = [
            layer.index for layer in self.layers if layer.kind == kind and not layer.kv_shared
        ]
        if not owners:
            raise ConfigError(f"no producer layer of type {kind}")
        return owners[-1]

    @property
    def producer_layers(self) -> list[LayerSpec]:
        return [layer for layer in self.layers if not layer.kv_shared]

    def kind_spec(self, kind: str) -> tuple[int, int]:
        """(head_dim, num_kv_heads) of a layer type."""
        layer = next(layer for layer in self.layers if layer.kind == kind)
        return layer.head_dim, layer.num_kv_heads

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)


@dataclass(frozen=True)
class AssistantConfig:
    text: TextConfig
    backbone_hidden_size: int
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_top_k: int

    def check_fits(self, target: TextConfig) -> None:
        """Refuse a drafter whose frozen-KV reads or embedding would not line up with the target."""
        problems = []
        if self.backbone_hidden_size != target.hidden_size:
            problems.append(
                f"backbone_hidden_size {self.backbone_hidden_size} "
                f"!= target hidden_size {target.hidden_size}"
            )
        if self.text.vocab_size != target.vocab_size:
            problems.append(
                f"vocab_size {self.text.vocab_size} != target vocab_size {target.vocab_size}"
            )
        for kind in (SLIDING, FULL):
            if kind not in self.text.layer_types:
                continue
            if kind not in target.layer_types:
                problems.append(f"drafter has {kind} layers, the target has none")
                continue
            draft_head_dim, draft_kv_heads = self.text.kind_spec(kind)
            target_head_dim, target_kv_heads = target.kind_spec(kind)
            if draft_head_dim != target_head_dim:
                problems.append(f"{kind} head_dim {draft_head_dim} != target {target_head_dim}")
            if draft_kv_heads != target_kv_heads:
                problems.append(f"{kind} num_kv_heads {draft_kv_heads} != target {target_kv_heads}")
        if problems:
            raise ConfigError("draft model does not fit the target: " + "; ".join(problems))


def _rope_specs(text_cfg: dict, head_dim: int, global_head_dim: int) -> dict:
    params = text_cfg.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    }
    out = {}
    for kind, hd in ((SLIDING, head_dim), (FULL, global_head_dim)):
        rope_params = params.get(kind)
        if rope_params is None:
            raise ConfigError(f"rope_parameters has no entry for {kind}")
        rtype = rope_params.get("rope_type", "default")
        if rtype == "default":
            pairs = hd // 2
        elif rtype == "proportional":
            if rope_params.get("factor", 1.0) not in (1, 1.0):
                raise ConfigError(
                    f"proportional RoPE with factor {rope_params['factor']} is not supported"
                )
            pairs = int(rope_params.get("partial_rotary_factor", 1.0) * hd // 2)
        else:
            raise ConfigError(f"rope_type {rtype!r} ({kind}) is not supported")
        theta = float(rope_params["rope_theta"])
        out[kind] = RopeSpec(theta=theta, head_dim=hd, rotated_pairs=pairs)
    return out


def parse_text_config(text_cfg: dict, *, eos_token_ids=None) -> TextConfig:
    model_type = text_cfg.get("model_type", "gemma4_text")
    if model_type != "gemma4_text":
        raise ConfigError(
            f"text config model_type {model_type!r} is not supported (expected gemma4_text)"
        )
    if text_cfg.get("use_bidirectional_attention") == "all":
        raise ConfigError(
            "use_bidirectional_attention='all' (a non-causal decoder) is not supported"
        )
    if text_cfg.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (no released Gemma 4 uses it)")
    act = text_cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation {act!r} is not supported")

    num_layers = int(text_cfg.get("num_hidden_layers", 30))
    layer_types = text_cfg.get("layer_types")
    if layer_types is None:
        layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    for layer_type in layer_types:
        if layer_type not in (SLIDING, FULL):
            raise ConfigError(f"unknown layer type {layer_type!r}")
    layer_types[-1] = FULL  # HF forces the last layer to full attention

    head_dim = int(text_cfg.get("head_dim", 256))
    global_head_dim = int(text_cfg.get("global_head_dim", 512))
    nkv = int(text_cfg.get("num_key_value_heads", 4))
    n_global_kv = text_cfg.get("num_global_key_value_heads")
    k_eq_v = bool(text_cfg.get("attention_k_eq_v", False))
    n_shared = int(text_cfg.get("num_kv_shared_layers") or 0)
    first_shared = num_layers - n_shared
    inter = int(text_cfg.get("intermediate_size", 9216))
    double_wide = bool(text_cfg.get("use_double_wide_mlp", False))

    moe = bool(text_cfg.get("enable_moe_block", False))
    moe_inter = (
        text_cfg.get("moe_intermediate_size") or text_cfg.get("expert_intermediate_size") or 0
    )
    if moe and not (text_cfg.get("num_experts") and text_cfg.get("top_k_experts") and moe_inter):
        raise ConfigError(
            "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
        )

    # HF 5.17 serialises the full layers' head dim / KV heads as `per_layer_config` overrides; the
    # release configs carry `global_head_dim` / `num_global_key_value_heads` instead. Accept both.
    overrides = text_cfg.get("per_layer_config")
    if overrides is not None:
        overrides = {int(k): v for k, v in overrides.items()}
    else:
        full_override = {"head_dim": global_head_dim}
        if k_eq_v and n_global_kv is not None:
            full_override["num_key_value_heads"] = n_global_kv
        overrides = {
            i: full_override for i, layer_type in enumerate(layer_types) if layer_type == FULL
        }
    store = {}
    for i in range(first_shared):
        store[layer_types[i]] = i
    layers = []
    for i, kind in enumerate(layer_types):
        full = kind == FULL
        shared = n_shared > 0 and i >= first_shared
        if shared and kind not in store:
            raise ConfigError(f"KV-shared layer {i} ({kind}) has no producer layer of its type")
        override = overrides.get(i, {})
        layers.append(
            LayerSpec(
                index=i,
                kind=kind,
                head_dim=int(override.get("head_dim", head_dim)),
                num_kv_heads=int(override.get("num_key_value_heads", nkv)),
                k_eq_v=k_eq_v and full,
                kv_shared=shared,
                kv_layer=store[kind] if shared else i,
                mlp_width=inter * (2 if double_wide and shared and first_shared > 0 else 1),
            )
        )

    eos = eos_token_ids if eos_token_ids is not None else text_cfg.get("eos_token_id", 1)
    if isinstance(eos, int):
        eos = [eos]
    softcap = text_cfg.get("final_logit_softcapping")
    full_head_dim = next(
        (layer.head_dim for layer in layers if layer.kind == FULL), global_head_dim
    )
    return TextConfig(
        vocab_size=int(text_cfg.get("vocab_size", 262144)),
        hidden_size=int(text_cfg.get("hidden_size", 2304)),
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=int(text_cfg.get("num_attention_heads", 8)),
        num_kv_heads=nkv,
        head_dim=head_dim,
        global_head_dim=full_head_dim,
        num_global_kv_heads=n_global_kv,
        k_eq_v=k_eq_v,
        layer_types=tuple(layer_types),
        sliding_window=int(text_cfg.get("sliding_window", 512)),
        rope=_rope_specs(text_cfg, head_dim, full_head_dim),
        rms_norm_eps=float(text_cfg.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=float(softcap) if softcap else None,
        ple_dim=int(text_cfg.get("hidden_size_per_layer_input") or 0),
        ple_vocab_size=int(text_cfg.get("vocab_size_per_layer_input") or 0),
        num_kv_shared_layers=n_shared,
        double_wide_mlp=double_wide,
        moe=moe,
        num_experts=int(text_cfg.get("num_experts") or 0),
        top_k_experts=int(text_cfg.get("top_k_experts") or 0),
        moe_intermediate_size=int(moe_inter),
        max_position_embeddings=int(text_cfg.get("max_position_embeddings", 131072)),
        bos_token_id=int(text_cfg.get("bos_token_id", 2)),
        eos_token_ids=tuple(int(e) for e in eos),
        pad_token_id=int(text_cfg.get("pad_token_id", 0)),
        layers=tuple(layers),
    )


def parse_config(cfg: dict) -> TextConfig | AssistantConfig:
    """A target (`gemma4` / `gemma4_text`) or an assistant (`gemma4_assistant`) config dict."""
    model_type = cfg.get("model_type")
    if model_type == "gemma4":
        eos = cfg.get("eos_token_id")
        return parse_text_config(cfg["text_config"], eos_token_ids=eos)
    if model_type == "gemma4_text":
        return parse_text_config(cfg)
    if model_type == "gemma4_assistant":
        text_cfg = dict(cfg["text_config"])
        if not text_cfg.get("num_kv_shared_layers"):
            text_cfg["num_kv_shared_layers"] = text_cfg.get("num_hidden_layers")
        if (
            int(text_cfg.get("hidden_size_per_layer_input") or 0)
            or text_cfg.get("enable_moe_block")
            or text_cfg.get("use_double_wide_mlp")
        ):
            raise ConfigError("an assistant must have no PLE, no MoE and no double-wide MLP")
        # Every layer is KV-shared: it reads the *target's* store layers, so needs no producer.
        text = _parse_assistant_text(text_cfg)
        return AssistantConfig(
            text=text,
            backbone_hidden_size=int(cfg["backbone_hidden_size"]),
            use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
            num_centroids=int(cfg.get("num_centroids", 2048)),
            centroid_top_k=int(cfg.get("centroid_intermediate_top_k", 32)),
        )
    raise ConfigError(
        f"model_type {model_type!r} is not supported: gemma4serve serves gemma4, gemma4_text "
        "and gemma4_assistant checkpoints"
    )


def _parse_assistant_text(text_cfg: dict) -> TextConfig:
    # Parse as a non-shared stack (for head dims / KV heads per type), then mark every layer shared.
    plain = parse_text_config({**text_cfg, "num_kv_shared_layers": 0})
    layers = tuple(
        LayerSpec(
            layer.index,
            layer.kind,
            layer.head_dim,
            layer.num_kv_heads,
            layer.k_eq_v,
            True,
            -1,
            layer.mlp_width,
        )
        for layer in plain.layers
    )
    return TextConfig(
        **{**plain.__dict__, "layers": layers, "num_kv_shared_layers": plain.num_layers}
    )


def load_config(path: str | Path) -> TextConfig | AssistantConfig:
    """Read `config.json` (a file or a checkpoint directory) and, for targets, the EOS ids of
    `generation_config.json` (the IT models stop on [1, 106, 50])."""
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {cfg_file}") from None
    parsed = parse_config(cfg)
    gen_file = cfg_file.parent / "generation_config.json"
    if isinstance(parsed, TextConfig) and gen_file.exists():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if gen_eos is not None:
            gen_eos = [gen_eos] if isinstance(gen_eos, int) else gen_eos
            parsed = TextConfig(
                **{**parsed.__dict__, "eos_token_ids": tuple(int(e) for e in gen_eos)}
            )
    return parsed
