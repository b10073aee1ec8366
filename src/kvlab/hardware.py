"""The name of the device a measurement ran on, as rows record it (torch only, so any job can import it)."""

from __future__ import annotations

import platform

import torch


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def bf16_matmul_native(device: str) -> bool:
    """Whether bf16 matrix products run in hardware here: any CUDA GPU of compute capability 8.0 or newer, or a
    CPU with AMX tiles or AVX512-BF16 (elsewhere torch emulates bf16 on the CPU, many times slower than fp32:
    measured 45x on an AVX2-only EPYC, see the README). torch exposes the CPU checks only as torch.cpu._is_*."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    cpu = torch.cpu
    return any(getattr(cpu, probe, lambda: False)() for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def other_dtype(dtype: str, device: str) -> str | None:
    """The compute dtype a run's noise floor is measured against (config `dtype_floor`): float32 beside a half-precision
    run; bfloat16 beside a float32 run where bf16 matmuls are native; None where they are not (an emulated bf16 pass
    would take longer than the job)."""
    if dtype != "float32":
        return "float32"
    return "bfloat16" if bf16_matmul_native(device) else None


def compute_dtype(requested: str, device: str) -> str:
    """The config's `dtype`, with `auto` resolved where the job runs: bfloat16 where bf16 matmuls are native,
    float32 elsewhere."""
    if requested != "auto":
        return requested
    return "bfloat16" if bf16_matmul_native(device) else "float32"
