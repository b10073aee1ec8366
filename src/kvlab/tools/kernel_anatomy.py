"""What the fused decode kernel compiles to, on a machine without a GPU: ``python -m kvlab.tools.kernel_anatomy``.

For each storage format of the decode microbenchmark (``kvlab.steps.kernel_bench``: FP8, KIVI INT4, INT2), a small
layer is built on the CPU, ``kvlab.kernels.triton_decode.arguments`` gives the kernel's launch arguments for
it, and Triton compiles that variant for an NVIDIA architecture (sm_90, the H100/H200, by default) with its
own bundled ptxas; ``cuobjdump`` (also shipped with Triton) disassembles it. The kernel's main loop — the
longest loop in the machine code, which walks the codes one tile at a time — is counted per instruction, per
warp and per tile, and divided by the tile's tokens. Rows: instructions per token, in total and by class, with
the registers per thread and the shared memory per program that set how many programs run at once.

A count is not a timing: memory latency, occupancy and issue stalls decide the speed, so only a GPU run
(``kvlab.steps.kernel_bench``) measures it. The count shows what a change to the kernel costs in work per token
before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pandas as pd
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlab.steps.kernel_bench import formats
from kvlab.kernels import decode_attention, kvcache, triton_decode

# Instruction classes by SASS opcode (the part before the first dot).
CLASSES = {
    "tensor_core": {"HMMA", "HGMMA", "IMMA"},
    "shared_memory": {"LDS", "STS", "LDSM", "STSM"},
    "global_memory": {"LDG", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR"},
    "int_to_float": {"I2F", "I2FP"},
    "float_convert": {"F2F", "F2FP", "F2I"},
    "half_math": {"HADD2", "HFMA2", "HMUL2", "HMNMX2"},
    "float_math": {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "MUFU"},
    "integer": {"IMAD", "IADD3", "LOP3", "SHF", "PRMT", "LEA", "SGXT", "VIADD", "ISETP", "SEL", "IABS", "BMSK"},
    "shuffle_sync": {"SHFL", "BAR", "WARPSYNC"},
}
COLUMNS = ["format", "head_dim", "query_dtype", "arch", "triton", "block_t", "num_warps", "num_stages",
           "registers", "shared_bytes", "loop_instructions", "per_token", *(f"per_token_{c}" for c in CLASSES),
           "per_token_other"]
_TRITON_TYPES = {torch.uint8: "u8", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                 torch.float8_e4m3fn: "fp8e4nv"}
_ARGS = ("q_ptr", "o_ptr", "lse_ptr", "kc", "ks", "kz", "vc", "vs", "vz", "dk", "dv", "H", "T", "TK", "TV", "ND", "REP",
         "SPLITS", "TILES_PER_SPLIT", "scaling")


def compile_variant(fmt: str, head_dim: int, query_dtype: torch.dtype = torch.bfloat16, arch: int = 90,
                    heads: int = 2, rep: int = 4, block_t: int | None = None, num_warps: int = 4,
                    num_stages: int | None = None):
    """The kernel compiled for ``sm_<arch>`` for one format of ``kernel_bench.formats`` ('fp8', 'int4', 'int2')
    and head dim, and the compile-time parameters it was given. Nothing runs on a device."""
    spec = formats(group=32, residual=0).get(fmt)
    if spec is None:
        raise ValueError(f"format {fmt!r}: the kernel reads 'fp8', 'int4' or 'int2'")
    if not decode_attention.head_dim_fits(head_dim):
        raise ValueError(f"head_dim {head_dim}: the kernel's tiles need a power of two from 16 to 256")
    if fmt == "fp8" and not decode_attention.fp8_readable(divmod(arch, 10)):
        raise ValueError(f"format 'fp8' on sm_{arch}: the kernel reads E4M3 codes from sm_89 on (FP8 caches take the "
                         "dequantizing path before that)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 replaces Triton's compiler with its interpreter: unset it to compile the kernel")
    g = torch.Generator().manual_seed(0)
    layer = kvcache.layer_from_dense(torch.randn(1, heads, 256, head_dim, generator=g),
                                     torch.randn(1, heads, 256, head_dim, generator=g), spec)
    kind = decode_attention.supported(layer)
    q = torch.zeros(1, heads * rep, head_dim, dtype=query_dtype)
    dense = torch.zeros(1, heads, 1, head_dim, dtype=query_dtype)
    pointers, _, meta = triton_decode.arguments(q, layer, kind, dense, dense, block_t, num_warps, num_stages)
    options = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    ptr_types = [_TRITON_TYPES[pointers[0].dtype], "fp32", "fp32", *(_TRITON_TYPES[x.dtype] for x in pointers[1:])]
    signature = {name: "*" + t for name, t in zip(_ARGS[:11], ptr_types)}
    signature |= {name: "i32" for name in _ARGS[11:19]} | {"scaling": "fp32"} | {name: "constexpr" for name in meta}
    names = triton_decode._decode_kernel.arg_names
    # What the launcher specializes on for real tensors: 16-byte aligned pointers (sizes are not specialized on).
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _ARGS[:11]}
    source = ASTSource(triton_decode._decode_kernel, signature, constexprs=meta, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return compiled, meta | options


def _disassemble(compiled) -> tuple[str, str]:
    """SASS text and resource usage of a compiled kernel, from the cuobjdump Triton ships."""
    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    return sass, usage


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop (a backward branch and the instructions from its target to it)."""
    code = []  # (address, opcode, branch target or None)
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)[^;]*;", line)
        if m:
            target = re.search(r"BRA\s.*?0x([0-9a-f]+)", line)
            code.append((int(m.group(1), 16), m.group(2), int(target.group(1), 16) if target else None))
    address = [a for a, _, _ in code]
    loops = [[op for _, op, _ in code[address.index(target) : i + 1]]
             for i, (a, _, target) in enumerate(code) if target is not None and target < a and target in address]
    if not loops:
        raise RuntimeError("no loop found in the disassembled kernel: has cuobjdump's output format changed?")
    return max(loops, key=len)


def anatomy(fmt: str, head_dim: int, arch: int = 90, **kw) -> dict:
    """One row: the main loop's instructions per token of one compiled variant, by class."""
    compiled, meta = compile_variant(fmt, head_dim, arch=arch, **kw)
    sass, usage = _disassemble(compiled)
    loop = main_loop(sass)
    counts = collections.Counter(loop)
    tokens = meta["BLOCK_T"]
    row = {"format": fmt, "head_dim": head_dim, "query_dtype": str(kw.get("query_dtype", torch.bfloat16)).split(".")[-1],
           "arch": f"sm_{arch}", "triton": triton.__version__, "block_t": tokens, "num_warps": meta["num_warps"],
           "num_stages": meta["num_stages"], "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
           "shared_bytes": compiled.metadata.shared, "loop_instructions": len(loop), "per_token": len(loop) / tokens}
    classified = 0
    for name, ops in CLASSES.items():
        n = sum(c for op, c in counts.items() if op in ops)
        row[f"per_token_{name}"] = n / tokens
        classified += n
    row["per_token_other"] = (len(loop) - classified) / tokens
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlab.tools.kernel_anatomy", description=__doc__.splitlines()[0])
    ap.add_argument("--format", action="append", choices=["fp8", "int4", "int2"], dest="formats",
                    help="storage format (repeatable; default: all three, FP8 only from sm_89)")
    ap.add_argument("--head-dim", action="append", type=int, dest="head_dims", help="head dim (repeatable; default 64 and 128)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability without the dot: 90 = H100/H200 (default), 80 = A100")
    ap.add_argument("--out", type=Path, help="Parquet file for the rows")
    args = ap.parse_args(argv)
    default = ["fp8", "int4", "int2"] if decode_attention.fp8_readable(divmod(args.arch, 10)) else ["int4", "int2"]
    rows = [anatomy(f, d, arch=args.arch) for f in args.formats or default for d in args.head_dims or [64, 128]]
    table = pd.DataFrame(rows, columns=COLUMNS)
    print(table[["format", "head_dim", "block_t", "registers", "shared_bytes", "per_token", "per_token_integer",
                 "per_token_half_math", "per_token_shared_memory", "per_token_tensor_core"]].round(1).to_string(index=False))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        table.to_parquet(args.out, index=False)


if __name__ == "__main__":
    main()
