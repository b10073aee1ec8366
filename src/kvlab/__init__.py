"""kvlab: which KV-cache compression is safe on which task, measured on real models (see README.md)."""

import os

# Large CPU tensors on transparent huge pages: PyTorch's CPU allocator reads this variable once, at torch's first
# allocation, so it is set here, before any kvlab module imports torch (a user's own value wins). The engine fills a
# fresh float32 (rows × tokens × vocabulary) block per teacher-forced pass, and with 4 KB pages faulting it in cost
# more than computing it (docs/benchmarks.md "Engine history"). Values are unchanged: only where the memory comes from.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
