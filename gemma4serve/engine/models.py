"""Load the target (and the drafter) onto the device and set up the KV cache the step runs over."""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gemma4serve.config import FULL, SLIDING, AssistantConfig, ConfigError, TextConfig, load_config
from gemma4serve.engine.args import EngineArgs
from gemma4serve.kv.cache import KVCache
from gemma4serve.kv.sizing import KVPlan, plan_kv
from gemma4serve.model.assistant import Gemma4Assistant
from gemma4serve.model.gemma4 import Gemma4Model
from gemma4serve.weights.dummy import init_dummy_weights
from gemma4serve.weights.hub import resolve_checkpoint
from gemma4serve.weights.loader import load_weights

log = logging.getLogger("gemma4serve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelState:
    target: Gemma4Model
    draft: Gemma4Assistant | None
    kv: KVCache
    kv_plan: KVPlan
    attn: object
    device: torch.device
    dtype: torch.dtype
    page_size: int
    target_dir: Path
    draft_dir: Path | None


def resolve_device_dtype(args: EngineArgs) -> tuple[torch.device, torch.dtype]:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif args.dtype in DTYPES:
        dtype = DTYPES[args.dtype]
    else:
        raise ConfigError(f"dtype {args.dtype!r} is not supported (float32, bfloat16, float16)")
    return device, dtype


def _empty_module(cls, cfg, device, dtype):
    """Build on the meta device and allocate uninitialised storage once: no wasted random init of
    31B weights."""
    with torch.device("meta"):
        module = cls(cfg)
    return module.to(dtype).to_empty(device=device).eval().requires_grad_(False)


def _load(module, path: Path | None, args: EngineArgs, device, dtype, what: str) -> None:
    t0 = time.monotonic()
    if args.load_format == "dummy":
        init_dummy_weights(module, seed=args.seed)
    elif args.load_format in ("auto", "safetensors"):
        load_weights(
            module, path, to_param_name=module.checkpoint_param_name, device=device, dtype=dtype
        )
    else:
        raise ConfigError(f"load_format {args.load_format!r} is not supported (auto, dummy)")
    n = sum(p.numel() for p in module.parameters())
    log.info("%s: %.1fM parameters loaded in %.1fs", what, n / 1e6, time.monotonic() - t0)


def make_attention_backend(
    name: str, device: torch.device, cfg=None, page_size: int = 16, dtype=None
):
    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if (
        name == "auto"
    ):  # the Triton kernels are the fast path on CUDA (with FlashInfer's prefill when it is
        # installed: measured faster, docs/performance.md); torch is the reference everywhere
        name = "triton" if device.type == "cuda" else "torch"
        if name == "triton" and dtype == torch.bfloat16 and has_flashinfer:
            name = "flashinfer"
    if name == "torch":
        from gemma4serve.attention.torch_backend import TorchAttention

        return TorchAttention()
    if name == "triton":
        from gemma4serve.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "flashinfer":
        if device.type != "cuda" or not has_flashinfer:
            raise ConfigError(
                "attention backend 'flashinfer' needs CUDA and the flashinfer extra "
                "(pip install 'gemma4serve[flashinfer]')"
            )
        from gemma4serve.attention.flashinfer_backend import FlashInferAttention

        layouts = {}
        for kind in (SLIDING, FULL):
            hd, nkv = cfg.kind_spec(kind)
            layouts[kind] = (cfg.num_heads, nkv, hd)
        return FlashInferAttention(device, layouts, page_size)
    raise ConfigError(
        f"attention backend {name!r} is not supported (auto, torch, triton, flashinfer)"
    )


def _kv_budget(args: EngineArgs, device: torch.device) -> int | None:
    if args.kv_cache_memory is not None:
        return int(args.kv_cache_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        # Leave room for activations, logits of a full token budget and CUDA graph pools.
        reserve = 2 * 2**30
        return max(0, int(total * args.gpu_memory_utilization) - used - reserve)
    return 512 * 2**20  # CPU: tiny models only


def _checkpoint_dir(name: str, args: EngineArgs) -> Path:
    """A local directory as given when dummy weights need only its config; else the hub's copy."""
    if args.load_format == "dummy" and Path(name).exists():
        return Path(name)
    return resolve_checkpoint(name, args.revision)


def load_models(args: EngineArgs) -> ModelState:
    device, dtype = resolve_device_dtype(args)
    dummy = args.load_format == "dummy"
    target_dir = _checkpoint_dir(args.model, args)
    cfg = load_config(target_dir)
    if not isinstance(cfg, TextConfig):
        raise ConfigError(
            f"{args.model} is an assistant checkpoint; pass it as --draft, with its target as "
            "--model"
        )
    log.info(
        "loading %s (%s, %s) on %s",
        args.model,
        "dummy weights" if dummy else "safetensors",
        dtype,
        device,
    )
    target = _empty_module(Gemma4Model, cfg, device, dtype)
    _load(target, target_dir, args, device, dtype, "target")
    target.bind(device)

    draft, draft_dir = None, None
    if args.draft:
        draft_dir = _checkpoint_dir(args.draft, args)
        dcfg = load_config(draft_dir)
        if not isinstance(dcfg, AssistantConfig):
            raise ConfigError(f"draft model {args.draft} is not a gemma4_assistant checkpoint")
        dcfg.check_fits(cfg)
        draft = _empty_module(Gemma4Assistant, dcfg, device, dtype)
        _load(draft, draft_dir, args, device, dtype, "draft")
        draft.bind(cfg, device)

    k = args.num_draft_tokens if draft is not None else 0
    plan = plan_kv(
        cfg,
        page_size=args.page_size,
        dtype=dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_draft_tokens=k,
        draft_window=draft.cfg.text.sliding_window if draft is not None else None,
        kv_bytes=None if args.kv_cache_tokens is not None else _kv_budget(args, device),
        kv_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
    )
    kv = KVCache(
        cfg, {FULL: plan.full_pages, SLIDING: plan.sliding_pages}, args.page_size, dtype, device
    )
    log.info(
        "KV cache: %.2f GiB, full pool %d pages (%d tokens), sliding pool %d pages, "
        "max_model_len %d",
        plan.bytes / 2**30,
        plan.full_pages - 1,
        (plan.full_pages - 1) * args.page_size,
        plan.sliding_pages - 1,
        plan.max_model_len,
    )
    attn = make_attention_backend(args.attention_backend, device, cfg, args.page_size, dtype)
    return ModelState(
        target=target,
        draft=draft,
        kv=kv,
        kv_plan=plan,
        attn=attn,
        device=device,
        dtype=dtype,
        page_size=args.page_size,
        target_dir=target_dir,
        draft_dir=draft_dir,
    )
