"""Everything that shapes an engine, in one plain dataclass shared by `LLM`, the CLI and the
benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field

# The sampling settings a model's generation_config.json or --override-generation-config may
# default (vLLM's list, less max_new_tokens and skip_special_tokens).
GENERATION_DEFAULTS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass
class EngineArgs:
    model: str
    draft: str | None = None
    tokenizer: str | None = None  # defaults to the model's directory
    revision: str | None = None
    download_dir: str | None = None  # where Hub checkpoints go (default: the HF cache)
    # Default sampling settings: "auto" = the model's generation_config.json, "vllm" = none, or a
    # folder holding a generation_config.json; then these over them (GENERATION_DEFAULTS' keys)
    generation_config: str = "auto"
    override_generation_config: dict = field(default_factory=dict)
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto = cuda if available
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights of the real shapes)
    max_model_len: int | None = (
        None  # default: the config's max_position_embeddings, capped by the KV pool
    )
    max_num_seqs: int = 256  # a cap on the running batch; nothing is reserved per sequence
    max_num_batched_tokens: int = 2048  # a step's tokens; measured against 512, 4096 and 8192
    page_size: int = 16
    num_draft_tokens: int = 4  # k; 0 = no speculation (also when no draft model is given)
    adaptive_draft_length: bool = (
        True  # k, half of k or 0 drafts a step, whichever yields the most tokens per second
    )
    gpu_memory_utilization: float = (
        0.90  # fraction of total GPU memory the engine may use (weights + KV)
    )
    kv_cache_memory: int | None = None  # bytes for KV pages; overrides gpu_memory_utilization
    kv_cache_tokens: int | None = None  # test knob: an arena that holds this many positions
    # auto: triton on CUDA, torch elsewhere; flashinfer only when named (eager prompt steps)
    attention_backend: str = "auto"  # | torch | triton | flashinfer
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = (
        True  # queue the next decode step before reading the current one's tokens
    )
    # Devices (processes) the model is split over; rank 0 runs the engine, the others follow it.
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False  # NCCL for every all-reduce, small ones included
    # Test knob: a folder where every tensor-parallel rank writes each step's tokens, one line
    # per step (rank0.jsonl, rank1.jsonl, ...), to check that the ranks agree.
    tensor_parallel_step_log: str | None = None
    seed: int = 0  # seeds dummy weights and the per-request seeds drawn when a request gives none
    # Benchmark only: force the mean number of tokens per verify step (bonus included) while every
    # draft and verify computation still runs. Random weights accept ~nothing; this measures MTP's
    # speed, not quality.
    forced_acceptance: list[float] | float | None = None
    served_model_name: str | None = None
    # False: outputs carry new token ids only, and stop strings are not looked for; the server
    # process detokenizes (engine/output_processor.py) when the engine runs in a process of its own.
    detokenize: bool = True
