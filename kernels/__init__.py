"""gemma4serve's Triton kernels (installed as `gemma4serve_kernels`; the folder is `kernels/`).

All of them run on CUDA and, for tests, on CPU under TRITON_INTERPRET=1.
"""

from .activation import gelu_tanh_mul, gelu_tanh_times
from .all_reduce_norm import PeerBuffers, all_reduce_residual_norm
from .counter_random import random_row_keys, random_uniform
from .first_max import first_max
from .gemv import MAX_ROWS as GEMV_MAX_ROWS
from .gemv import gemv, gemv_mlp
from .greedy_head import floor_table, greedy_head, quantize_rows, value_table
from .kv_write import kv_write
from .moe import moe_align, moe_experts, moe_route
from .norm import rms_norm, rmsnorm_residual_add, rmsnorm_rope
from .paged_attention import LONG_PREFIX, attention_config, paged_attention
from .qkv_epilogue import qkv_epilogue
from .step_inputs import rope_tables, write_slots

__all__ = [
    "all_reduce_residual_norm",
    "attention_config",
    "first_max",
    "floor_table",
    "GEMV_MAX_ROWS",
    "gelu_tanh_mul",
    "gelu_tanh_times",
    "gemv",
    "gemv_mlp",
    "greedy_head",
    "kv_write",
    "LONG_PREFIX",
    "moe_align",
    "moe_experts",
    "moe_route",
    "paged_attention",
    "PeerBuffers",
    "qkv_epilogue",
    "quantize_rows",
    "random_row_keys",
    "random_uniform",
    "rms_norm",
    "rmsnorm_residual_add",
    "rmsnorm_rope",
    "rope_tables",
    "value_table",
    "write_slots",
]
