"""Load the target (and the drafter) onto the device and set up the KV cache the step runs over."""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gemma4serve.attention.metadata import causal_metadata
from gemma4serve.config import FULL, SLIDING, AssistantConfig, ConfigError, TextConfig, load_config
from gemma4serve.engine.args import EngineArgs
from gemma4serve.kv.cache import KVCache, page_tokens
from gemma4serve.kv.sizing import KVPlan, plan_kv
from gemma4serve.model.assistant import Gemma4Assistant
from gemma4serve.model.gemma4 import ForwardContext, Gemma4Model
from gemma4serve.parallel.group import TensorParallel
from gemma4serve.parallel.shards import (
    checkpoint_shard,
    shard_assistant_config,
    shard_text_config,
)
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


def _empty_module(cls, cfg, device, dtype, tp: TensorParallel | None):
    """Build on the meta device and allocate uninitialised storage once: no wasted random init of
    31B weights. Each tensor is made with `torch.empty`: `Module.to_empty`'s `empty_like` of meta
    tensors imports torch.fx's symbolic shapes, a second of every start."""
    with torch.device("meta"):
        module = cls(cfg, tp)
    for owner in module.modules():
        tensors = [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]
        for name, meta in tensors:
            kind = dtype if meta.is_floating_point() else meta.dtype
            tensor = torch.empty(meta.shape, dtype=kind, device=device)
            setattr(owner, name, nn.Parameter(tensor) if isinstance(meta, nn.Parameter) else tensor)
    return module.eval().requires_grad_(False)


def _load(
    module, path: Path | None, args: EngineArgs, device, dtype, what: str, shard_of=None
) -> None:
    """`shard_of`: under tensor parallelism, the part of each checkpoint tensor this rank loads."""
    t0 = time.monotonic()
    if args.load_format == "dummy":
        init_dummy_weights(module, seed=args.seed)
    elif args.load_format in ("auto", "safetensors"):
        load_weights(
            module,
            path,
            to_param_name=module.checkpoint_param_name,
            device=device,
            dtype=dtype,
            shard_of=shard_of,
        )
    else:
        raise ConfigError(f"load_format {args.load_format!r} is not supported (auto, dummy)")
    n = sum(p.numel() for p in module.parameters())
    log.info("%s: %.1fM parameters loaded in %.1fs", what, n / 1e6, time.monotonic() - t0)


def make_attention_backend(name: str, device: torch.device, cfg=None, tokens: dict | None = None):
    """`tokens`: positions per KV page of each attention type (FlashInfer plans with them)."""
    if name == "auto":
        # The Triton kernels are the fast path on CUDA, installed FlashInfer or not (its prefill
        # loses on the served mixed steps: docs/performance.md); torch is the reference elsewhere.
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from gemma4serve.attention.torch_backend import TorchAttention

        return TorchAttention()
    if name == "triton":
        from gemma4serve.attention.triton_backend import TritonAttention

        return TritonAttention()
    if name == "flashinfer":
        if device.type != "cuda" or importlib.util.find_spec("flashinfer") is None:
            raise ConfigError(
                "attention backend 'flashinfer' needs CUDA and the flashinfer extra "
                "(pip install 'gemma4serve[flashinfer]')"
            )
        from gemma4serve.attention.flashinfer_backend import FlashInferAttention

        layouts = {}
        for kind in (SLIDING, FULL):
            hd, nkv = cfg.kind_spec(kind)
            layouts[kind] = (cfg.num_heads, nkv, hd)
        return FlashInferAttention(device, layouts, tokens)
    raise ConfigError(
        f"attention backend {name!r} is not supported (auto, torch, triton, flashinfer)"
    )


def _kv_budget(
    args: EngineArgs, device: torch.device, activations: int, tp: TensorParallel | None
) -> int:
    """Bytes for the KV arena (of each rank): the --kv-cache-memory given, or what
    --gpu-memory-utilization of the device leaves after what is in use (the allocator's cache
    emptied first) and the measured activation reserve; under tensor parallelism the smallest
    rank's, so that every rank has the pages rank 0 schedules."""
    if args.kv_cache_memory is not None:
        return int(args.kv_cache_memory)
    if device.type != "cuda":
        return 512 * 2**20  # CPU: tiny models only
    torch.cuda.empty_cache()  # cached free blocks of the load are not in use
    free, total = torch.cuda.mem_get_info(device)
    budget = max(0, int(total * args.gpu_memory_utilization) - (total - free) - activations)
    return budget if tp is None else tp.min_int(budget, device)


@torch.inference_mode()
def _measure_activations(target, attn, cfg, args: EngineArgs, dtype, device) -> int:
    """Bytes a step needs besides weights and KV, measured: an eager forward of the largest
    prefill chunk and the logits of the most sampled rows (in fp32, as the sampler makes them),
    twice over, since the CUDA graphs' pool and eager steps hold theirs at once."""
    if device.type != "cuda":
        return 0
    chunk = min(args.max_num_batched_tokens, cfg.max_position_embeddings)
    rows = min(args.max_num_batched_tokens, args.max_num_seqs * (args.num_draft_tokens + 1))
    tokens = page_tokens(cfg, args.page_size)
    num_pages = sum(-(-chunk // n) for n in tokens.values()) + 1
    probe = KVCache(cfg, num_pages, tokens, dtype, device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(chunk, dtype=torch.int64, device=device)
    positions = torch.arange(chunk, device=device)
    tables = {
        kind: torch.arange(1, 1 + -(-chunk // n), dtype=torch.int32, device=device)[None]
        + (0 if kind == SLIDING else -(-chunk // tokens[SLIDING]))
        for kind, n in tokens.items()
    }
    window = {SLIDING: cfg.sliding_window, FULL: 0}
    token_group = torch.zeros(chunk, dtype=torch.int32, device=device)
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    meta = causal_metadata(token_group, positions, tables, window, starts, chunk, tokens)
    hidden = target(ids, positions, ForwardContext(meta, probe, attn))
    logits = target.logits(hidden[:1].expand(rows, -1).contiguous()).float()
    del logits, hidden
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    return 2 * peak + 2**29


def _checkpoint_dir(name: str, args: EngineArgs) -> Path:
    """A local directory as given when dummy weights need only its config; else the hub's copy."""
    if args.load_format == "dummy" and Path(name).exists():
        return Path(name)
    return resolve_checkpoint(name, args.revision, cache_dir=args.download_dir)


def check_tensor_parallel(args: EngineArgs) -> None:
    """Refuse a --tensor-parallel-size the devices or the model cannot take, before any worker
    starts; the checkpoints are resolved here once (downloaded), before the workers read them."""
    size = args.tensor_parallel_size
    device, _ = resolve_device_dtype(args)
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ConfigError(
            f"--tensor-parallel-size {size} needs {size} GPUs; {torch.cuda.device_count()} visible"
        )
    cfg = load_config(_checkpoint_dir(args.model, args))
    if isinstance(cfg, TextConfig):
        shard_text_config(cfg, size)
    if args.draft:
        draft_cfg = load_config(_checkpoint_dir(args.draft, args))
        if isinstance(draft_cfg, AssistantConfig):
            shard_assistant_config(draft_cfg, size)


def load_models(args: EngineArgs, tp: TensorParallel | None = None) -> ModelState:
    """The models and KV cache of one device; under tensor parallelism (`tp`), this rank's
    shard of them: its heads, MLP columns and vocabulary rows, and its heads' KV pages."""
    device, dtype = resolve_device_dtype(args)
    if tp is not None and device.type == "cuda":
        device = torch.device("cuda", tp.rank)
    dummy = args.load_format == "dummy"
    target_dir = _checkpoint_dir(args.model, args)
    full_cfg = load_config(target_dir)
    if not isinstance(full_cfg, TextConfig):
        raise ConfigError(
            f"{args.model} is an assistant checkpoint; pass it as --draft, with its target as "
            "--model"
        )
    cfg = full_cfg if tp is None else shard_text_config(full_cfg, tp.size)
    log.info(
        "loading %s (%s, %s) on %s",
        args.model,
        "dummy weights" if dummy else "safetensors",
        dtype,
        device,
    )
    # Bound before loading: the weights load straight into the layout the ops read (fused q/k/v
    # and gate/up), with no temporaries the allocator would keep cached.
    target = _empty_module(Gemma4Model, cfg, device, dtype, tp)
    target.bind(device)
    shard_of = None
    if tp is not None:

        def shard_of(param, shape):
            return checkpoint_shard(param, shape, full_cfg, tp, vocab_parallel=True)

    _load(target, target_dir, args, device, dtype, "target", shard_of)
    target.finish_loading()

    draft, draft_dir = None, None
    if args.draft:
        draft_dir = _checkpoint_dir(args.draft, args)
        dcfg = load_config(draft_dir)
        if not isinstance(dcfg, AssistantConfig):
            raise ConfigError(f"draft model {args.draft} is not a gemma4_assistant checkpoint")
        dcfg.check_fits(full_cfg)
        full_dcfg = dcfg
        draft_shard_of = None
        if tp is not None:
            dcfg = shard_assistant_config(full_dcfg, tp.size)

            def draft_shard_of(param, shape):
                return checkpoint_shard(param, shape, full_dcfg.text, tp, vocab_parallel=False)

        draft = _empty_module(Gemma4Assistant, dcfg, device, dtype, tp)
        draft.bind(cfg, device)
        _load(draft, draft_dir, args, device, dtype, "draft", draft_shard_of)
        draft.finish_loading()

    k = args.num_draft_tokens if draft is not None else 0
    tokens = page_tokens(cfg, args.page_size)
    attn = make_attention_backend(args.attention_backend, device, cfg, tokens)
    activations = 0
    if args.kv_cache_tokens is None and args.kv_cache_memory is None:
        activations = _measure_activations(target, attn, cfg, args, dtype, device)
    plan = plan_kv(
        cfg,
        page_size=args.page_size,
        dtype=dtype,
        num_draft_tokens=k,
        draft_window=draft.cfg.text.sliding_window if draft is not None else None,
        cache_boundary_rows=math.lcm(*tokens.values()) if args.enable_prefix_caching else 0,
        kv_bytes=None
        if args.kv_cache_tokens is not None
        else _kv_budget(args, device, activations, tp),
        kv_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
    )
    kv = KVCache(cfg, plan.num_pages, plan.page_tokens, dtype, device)
    window_rows = plan.sliding_keep + 2 * (k + 1)
    log.info(
        "KV cache: %.2f GiB (activation reserve %.2f GiB), %d pages of %.2f MiB: %d positions "
        "per page for full layers, %d for sliding layers; capacity %d tokens for one sequence; "
        "max_model_len %d; max concurrency for %d-token requests: %.1fx",
        plan.bytes / 2**30,
        activations / 2**30,
        plan.num_pages - 1,
        plan.page_bytes / 2**20,
        plan.page_tokens[FULL],
        plan.page_tokens[SLIDING],
        (plan.num_pages - 1 - plan.request_pages(0, window_rows)) * plan.page_tokens[FULL],
        plan.max_model_len,
        plan.max_model_len,
        plan.max_concurrency(plan.max_model_len, window_rows),
    )
    return ModelState(
        target=target,
        draft=draft,
        kv=kv,
        kv_plan=plan,
        attn=attn,
        device=device,
        dtype=dtype,
        target_dir=target_dir,
        draft_dir=draft_dir,
    )
