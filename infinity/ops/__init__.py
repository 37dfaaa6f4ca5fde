"""Typed, validating wrappers over the native kernels (with pure-PyTorch fallbacks)."""

from infinity.ops.adam import bias_corrections, cpu_adam_step
from infinity.ops.adam_compact import (
    code_table,
    cpu_adam_step_8bit,
    cpu_adam_step_bf16_moments,
    dequantize_8bit,
    guard_moment,
    moment_bound,
    new_8bit_state,
    quantize_8bit,
)
from infinity.ops.bf16_master import cpu_adam_step_bf16_master, round_bf16_master, widen_bf16_master
from infinity.ops.cpu import (
    available_cpu_capabilities,
    cpu_capability,
    cpu_capability_override,
    get_num_threads,
    set_cpu_capability,
    set_num_threads,
)
from infinity.ops.finite import all_finite

__all__ = [
    "all_finite",
    "available_cpu_capabilities",
    "bias_corrections",
    "cpu_adam_step",
    "cpu_adam_step_8bit",
    "cpu_adam_step_bf16_master",
    "cpu_adam_step_bf16_moments",
    "cpu_capability",
    "cpu_capability_override",
    "code_table",
    "dequantize_8bit",
    "get_num_threads",
    "guard_moment",
    "moment_bound",
    "new_8bit_state",
    "quantize_8bit",
    "round_bf16_master",
    "set_cpu_capability",
    "set_num_threads",
    "widen_bf16_master",
]
