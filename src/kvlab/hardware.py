"""The name of the device a measurement ran on, as rows record it (torch only, so any job can import it)."""

from __future__ import annotations

import platform

import torch


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
