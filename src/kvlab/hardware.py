"""The name of the device a measurement ran on, as rows record it (torch only, so any job can import it)."""

from __future__ import annotations

import platform

import torch


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model, how it multiplies bf16 matrices (AMX tiles, AVX512-BF16, or not natively:
    the CPU kinds' speeds differ severalfold) and torch's threads."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu = torch.cpu
    bf16 = ("AMX" if getattr(cpu, "_is_amx_tile_supported", lambda: False)() else
            "AVX512-BF16" if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() else "no native bf16")
    return f"cpu ({_cpu_model()}, {bf16}, {torch.get_num_threads()} threads)"


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bf16_matmul_native(device: str) -> bool:
    """Whether bf16 matrix products run in hardware here: any CUDA GPU of compute capability 8.0 or newer, or a
    CPU with AMX tiles or AVX512-BF16 (elsewhere torch emulates bf16 on the CPU, many times slower than fp32:
    measured 45x on an AVX2-only EPYC, see the README). torch exposes the CPU checks only as torch.cpu._is_*."""
    if device == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    cpu = torch.cpu
    return any(getattr(cpu, probe, lambda: False)() for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def cpu_kind(device: str) -> str:
    """The kind rows name beside a time: bf16-capable, or fp32 only (the speeds of the two differ severalfold)."""
    return "bf16-capable" if bf16_matmul_native(device) else "fp32 only (no AVX512-BF16 or AMX)"


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
