"""The name of the device a measurement ran on, as rows record it (torch only, so any job can import it)."""

from __future__ import annotations

import ctypes
import platform

import torch

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model, how it multiplies bf16 matrices (AMX tiles, AVX512-BF16, or not natively:
    the CPU kinds' speeds differ severalfold) and torch's threads."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu = torch.cpu
    bf16 = ("AMX" if getattr(cpu, "_is_amx_tile_supported", lambda: False)() else
            "AVX512-BF16" if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() else "no native bf16")
    return f"cpu ({cpu_model()}, {bf16}, {torch.get_num_threads()} threads)"


def cpu_model() -> str:
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


def hand_back() -> bool:
    """Hand the memory this process has freed back to the kernel now (glibc's malloc_trim; False elsewhere). With
    `keep_freed_memory` the heap keeps every freed block for reuse, so peak RSS is the high-water mark of every phase
    so far, fragmented: an evaluation sample run in waves under a memory budget (kvlab.state.memory) calls this before each
    wave, so that what a wave holds is what it uses (measured: one 8K sample in two waves, 2.31 GB of RSS over the
    loaded model without it, beside 2.37 GB for one wave)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def keep_freed_memory() -> bool:
    """Let this process reuse the memory it frees instead of handing it back to the kernel (glibc only; False
    elsewhere, and nothing changes). glibc serves a large block from a fresh memory map (above 128 KB until a freed
    one raises that threshold, and always above 32 MB) and unmaps it when freed, so each of the engine's large
    temporaries (a teacher-forced batch's logits, 0.5 GB at 1,600 rows of Qwen's 152K vocabulary; its KV
    concatenations; attention's buffers) lands in pages the kernel must map and zero again: 370K page faults in
    three prose_kl samples, 19% of their wall time on a 2-core AMX Xeon in bf16 (33.5 -> 27.1 s, the same rows; peak
    RSS 4.9 -> 5.2 GB). With no maps, and the heap trimmed only past 2 GB free at its top, a freed block is reused as
    it is. CPU inference servers get the same reuse from a caching allocator preloaded into the process (jemalloc,
    tcmalloc); mallopt gives it from inside the job, with nothing to install or preload."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def avx512_or_amx() -> bool:
    """Whether the CPU has AVX-512 or AMX tiles: torch's probes, the ones vLLM's CPU attention asks before it runs an
    FP8 KV cache."""
    cpu = torch.cpu
    return any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_supported", "_is_amx_tile_supported"))
