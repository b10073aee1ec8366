"""Ready for one GPU, checked on the CPU (issue 53, part 4): the engine's passes record no autograd graph, masked
attention over grouped heads takes a path CUDA's fused kernels accept and computes the same attention, a model loads
straight to its device with its dtype floor's copy only while the floor needs it, and a SLURM job's memory follows
the model and the context."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import Batch, compress, prefill
from kvlab.steps.evaluate import load_model
from kvlab.methods import Variant

@pytest.fixture(scope="module")
def sample(tiny):
    from kvlab.tasks import KINDS

    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 3}
    return KINDS["niah"].generate("niah_single", spec, tiny[1], 700)[0]


KIVI4 = {"scheme": "kivi", "bits": 4, "group": 32, "residual": 32, "key_axis": "channel", "value_axis": "token"}


def test_a_jobs_model_asks_for_no_gradient_and_batch_forward_records_no_graph(tiny_dir):
    """A job's model (load_model) holds weights that need no gradient; and Batch.forward runs under no_grad itself
    (its decorators once sat on `streamable`): even a model whose weights ask for gradients, called where autograd
    is on, gives logits without a graph, and its modules run with autograd off."""
    for pack in (True, False):
        model = load_model(tiny_dir, "float32", "cpu", verify=False, pack=pack)[0]
        assert not any(p.requires_grad for p in model.parameters()), pack
    model.requires_grad_(True)  # as a model straight from transformers: only forward's own no_grad can save it now
    ids = list(range(40, 140))
    base = prefill(model, ids)
    caches = [compress(model, base, Variant("full", "full", 1.0)), compress(model, base, Variant("kivi4", "quant", 1.0, KIVI4))]
    seen = []
    hook = model.model.register_forward_hook(lambda module, args, out: seen.append(torch.is_grad_enabled()))
    try:
        with torch.enable_grad():
            batch = Batch(model, caches)
            logits = [batch.forward(torch.tensor([[7, 8, 9]] * 2), len(ids)), batch.forward(torch.tensor([[10]] * 2), len(ids) + 3)]
    finally:
        hook.remove()
    assert seen == [False, False]
    assert all(x.grad_fn is None and not x.requires_grad for x in logits)


def additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (6, 3), (7, 1), (4, 4)])
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("mask", ["none", "causal", "shared", "per_head", "sliced"])
def test_masked_attention_over_copied_kv_heads_is_the_grouped_attention(hq, hkv, n, mask):
    """`_sdpa` with each K/V head copied to its query heads (the path CUDA takes under a mask, `repeats_kv`) gives
    the attention that SDPA's grouped heads (`enable_gqa`) give, in fp32 on odd shapes: a one-token step and a chunk,
    without a mask and causal, a mask every head shares, one per query head, and a wider mask sliced to the keys
    (as sdpa_gqa slices it: not contiguous), with rows whose keys are partly hidden as padding hides them."""
    from kvlab.engine.attention import _sdpa

    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + n)
    b, kv, d = 3, 37, 24
    query = torch.randn(b, hq, n, d, generator=g)
    key, value = torch.randn(b, hkv, kv, d, generator=g), torch.randn(b, hkv, kv, d, generator=g)
    held = torch.tensor([kv - n, 20, 9])  # each row's own entries; the rest padding, then the chunk causally
    j, q = torch.arange(kv), torch.arange(n)
    allowed = (j[None, None, :] < held[:, None, None]) | ((j[None, None, :] >= kv - n) & (j[None, None, :] <= kv - n + q[None, :, None]))
    masks = {
        "none": None,
        "causal": None,
        "shared": additive(allowed[:, None]),
        "per_head": additive(allowed[:, None] & (torch.rand(b, hq, 1, kv, generator=g) > 0.3) | (j >= kv - n)),
        "sliced": additive(torch.nn.functional.pad(allowed[:, None], (0, 11)))[..., :kv],
    }
    m, causal = masks[mask], mask == "causal" and n > 1
    copied = _sdpa(query, key, value, m, 0.0, None, causal, repeat=True)
    grouped = _sdpa(query, key, value, m, 0.0, None, causal, repeat=False)
    assert copied.shape == grouped.shape == (b, hq, n, d)
    torch.testing.assert_close(copied, grouped, rtol=1e-6, atol=1e-6)
    # and both are attention: softmax(q·k / sqrt(d) + mask)·v with each query head reading its group's K/V head
    k, v = key.repeat_interleave(hq // hkv, dim=1), value.repeat_interleave(hq // hkv, dim=1)
    scores = query @ k.transpose(-1, -2) / d**0.5
    if m is not None:
        scores = scores + m
    elif causal:
        scores = scores.masked_fill(j[None, :] > q[:, None], float("-inf"))  # SDPA's is_causal: from the first key
    torch.testing.assert_close(copied, scores.softmax(-1) @ v, rtol=1e-5, atol=1e-5)


def test_kv_heads_are_copied_only_under_a_mask_on_cuda_for_grouped_heads():
    from kvlab.engine.attention import repeats_kv

    mask, cuda, cpu = torch.zeros(1, 1, 1, 4), torch.device("cuda"), torch.device("cpu")
    assert repeats_kv(cuda, mask, 14, 2)
    assert not repeats_kv(cuda, None, 14, 2)  # the flash kernel takes grouped heads without a mask
    assert not repeats_kv(cuda, mask, 14, 14)  # nothing to copy
    assert not repeats_kv(cpu, mask, 14, 2)  # the CPU's flash kernel takes both: the copy would only cost memory


def test_the_engines_passes_give_the_same_logits_with_kv_heads_copied(tiny, sample, monkeypatch):
    """The tiny model's batched passes over rows of different lengths (a mask in every layer) with the K/V heads
    copied, as on CUDA, give the logits of SDPA's grouped heads: the rows a GPU job writes are those of the path the
    CPU runs."""
    import kvlab.engine.attention as attention

    model, _ = tiny
    assert model.config.num_attention_heads != model.config.num_key_value_heads  # grouped heads
    ids = sample.prompt.context
    base = prefill(model, ids)
    snap = {"press": "SnapKVPress", "kwargs": {"window_size": 16, "kernel_size": 5}}
    caches = [compress(model, base, Variant("full", "full", 1.0)), compress(model, base, Variant("snapkv", "kvpress", 0.25, snap))]
    tail = torch.tensor([sample.prompt.question[:6]] * 2)

    def passes():
        batch = Batch(model, caches)
        return [batch.forward(tail, len(ids), logits_to_keep=tail.shape[1]), batch.forward(tail[:, :1], len(ids) + tail.shape[1])]

    copied = []
    monkeypatch.setattr(attention, "repeats_kv", lambda device, mask, hq, hkv: copied.append(mask is not None) or (mask is not None and hq != hkv))
    with_copies = passes()
    monkeypatch.undo()
    assert copied and all(copied)  # every layer of both passes had a mask (the rows' lengths differ) and copied
    for a, b in zip(with_copies, passes()):
        assert torch.equal(a, b)  # bitwise: the CPU's flash kernel reads a copied head as it reads the shared one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's fused SDPA kernels")
def test_on_cuda_masked_grouped_attention_runs_in_a_fused_kernel():
    """On the first GPU lent: a masked call over grouped heads (`_sdpa`'s default there copies the K/V heads) runs
    with the math kernel ruled out, and gives the grouped math path's attention (bf16 rounding)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvlab.engine.attention import _sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 14, 64, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    allowed = torch.arange(300, device="cuda")[None, :] < torch.tensor([300, 170], device="cuda")[:, None]
    mask = torch.zeros(2, 1, 64, 300, device="cuda", dtype=torch.bfloat16).masked_fill_(~allowed[:, None, None], -1e4)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        fused = _sdpa(q, k, v, mask, 0.0, None, False)
    with sdpa_kernel([SDPBackend.MATH]):
        math = _sdpa(q, k, v, mask, 0.0, None, False, repeat=False)
    torch.testing.assert_close(fused.float(), math.float(), rtol=2e-2, atol=2e-2)


def test_a_model_loads_straight_to_its_device(tiny_dir, monkeypatch):
    """load_model hands transformers the device (`device_map`) off the CPU, so each weight goes from the file to the
    device and the model is never whole in host memory; on the CPU it loads as before (no device_map). The CUDA
    device is pretended (transformers loads the tiny model to the CPU instead), and `ready` only records it."""
    import kvlab.steps.evaluate as evaluate
    from transformers import AutoModelForCausalLM

    load, asked, readied = AutoModelForCausalLM.from_pretrained, [], []

    def from_pretrained(path, **kwargs):
        asked.append(kwargs.get("device_map"))
        return load(path, **{**kwargs, "device_map": "cpu"} if "device_map" in kwargs else kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(evaluate, "ready", lambda model, device: readied.append(device) or model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = evaluate.load_model(tiny_dir, "float32", "cuda", verify=False)[0]
    evaluate.load_model(tiny_dir, "float32", "cpu", verify=False)
    assert asked == ["cuda", None] and readied == ["cuda", "cpu"]
    # what transformers gives with a device_map: every weight placed, none left on the meta device
    assert {p.device.type for p in model.parameters()} == {"cpu"}


NEEDLE = {"kind": "niah", "context_tokens": [384], "depths": [0.3], "samples": 3, "seed": 0}


def floor_run(tiny_dir, tmp_path, monkeypatch, **extra):
    """run_job on three single-sample batches of the tiny model, its model loads and engine calls recorded."""
    import weakref

    import kvlab.steps.evaluate as evaluate
    from kvlab.methods import build

    loads, calls, floors = [], [], []
    load, evaluate_samples = evaluate.load_model, evaluate.evaluate_samples

    def counted_load(model_dir, dtype, device, verify=True, pack=True):
        loads.append(dtype)
        model, tokenizer = load(model_dir, dtype, device, verify=verify, pack=pack)
        floors.append(weakref.ref(model))
        return model, tokenizer

    def spied(*args):
        reading = args[6]
        calls.append((reading.other is not None, reading.other_samples, [ref() is not None for ref in floors[1:]]))
        return evaluate_samples(*args)

    monkeypatch.setattr(evaluate, "load_model", counted_load)
    monkeypatch.setattr(evaluate, "evaluate_samples", spied)
    monkeypatch.setattr(evaluate, "samples_at_once", lambda tokens: 1)
    monkeypatch.setattr(evaluate, "other_dtype", lambda dtype, device: "float32")  # a second copy even where bf16 is emulated
    run = {"methods": build({"full": {"kind": "full"}}), "budgets": [0.5], "question_modes": ["agnostic"], "max_new_tokens": 4,
           "noise_floor_samples": 0, "dtype": "float32", "device": "cpu", "threads": 1, **extra}
    rows = evaluate.run_job(tiny_dir, "niah_single", NEEDLE, 384, run, tmp_path / "rows.parquet")
    return rows, loads, calls


def test_the_dtype_floors_copy_is_loaded_only_while_its_samples_run(tiny_dir, tmp_path, monkeypatch):
    """A job whose task the dtype floor does not list (kvlab.state.jobs.run_params gives it no dtype_floor_samples) loads
    the model once; a listed job loads the floor's copy for the batches holding the floor's samples and lets it go
    after them, so the rest of the job runs beside one copy of the weights."""
    from kvlab.state.jobs import run_params

    config = {"budgets": [0.5], "question_modes": ["agnostic"], "max_new_tokens": 4, "noise_floor_samples": 0,
              "dtype": "float32", "device": "cpu", "dtype_floor": {"samples": 1, "tasks": ["prose_kl"]}}
    assert "dtype_floor_samples" not in run_params(config, {}, None)
    assert run_params({**config, "dtype_floor": {"samples": 1, "tasks": []}}, {}, None).get("dtype_floor_samples") is None
    rows, loads, calls = floor_run(tiny_dir, tmp_path / "plain", monkeypatch)
    assert loads == ["float32"] and [c[:2] for c in calls] == [(False, 0)] * 3
    assert rows["dtype_noise_kl"].isna().all()
    monkeypatch.undo()
    rows, loads, calls = floor_run(tiny_dir, tmp_path / "floor", monkeypatch, dtype_floor_samples=1)
    assert loads == ["float32", "float32"]  # the job's model, then the floor's copy
    assert calls == [(True, 1, [True]), (False, 0, [False]), (False, 0, [False])]  # released after the first batch
    assert rows.sort_values("draw")["dtype_noise_kl"].notna().tolist() == [True, False, False]


QWEN_0_5B = {"n_params": 494_032_768, "num_layers": 24, "hidden_size": 896, "num_kv_heads": 2, "head_dim": 64}
LLAMA_8B = {"n_params": 8_030_261_248, "num_layers": 32, "hidden_size": 4096, "num_kv_heads": 8, "head_dim": 128}


def test_a_jobs_memory_request_follows_the_model_and_the_context():
    """eval_mem_mb covers the peaks measured on Qwen2.5-0.5B in fp32 (issue 53: 9.4 GB at 4K, 15.4 GB at 8K; prose_kl
    10.2 GB at 1K) with room to spare but not twice over, grows with the context and the model's size, adds the dtype
    floor's copy, and asks a GPU job's host only for the process (its weights load to the device)."""
    from kvlab.state.jobs import MEM_FLOOR_MB, eval_mem_mb

    for tokens, peak in ((1024, 10_200), (4096, 9_400), (8192, 15_400)):
        assert peak < eval_mem_mb(QWEN_0_5B, "float32", "cpu", tokens) < 2 * peak
    lengths = [eval_mem_mb(QWEN_0_5B, "float32", "cpu", n) for n in (4096, 8192, 16384, 32768)]
    assert lengths[0] == MEM_FLOOR_MB and lengths == sorted(set(lengths))
    # about 1.5 GB more per 1K tokens (the measured rate), with the headroom
    assert lengths[-1] - lengths[-2] == pytest.approx(1.25 * 1.5 * 16.384 * 1000, rel=0.1)
    assert eval_mem_mb(LLAMA_8B, "bfloat16", "cpu", 32768) > eval_mem_mb(QWEN_0_5B, "bfloat16", "cpu", 32768)
    assert eval_mem_mb(QWEN_0_5B, "bfloat16", "cpu", 32768) < eval_mem_mb(QWEN_0_5B, "float32", "cpu", 32768)
    # the floor's fp32 copy of a bf16 8B model: its 32 GB, with the headroom
    floor = eval_mem_mb(LLAMA_8B, "bfloat16", "cpu", 8192, dtype_floor=True) - eval_mem_mb(LLAMA_8B, "bfloat16", "cpu", 8192)
    assert floor == pytest.approx(1.25 * 4 * LLAMA_8B["n_params"] / 1e6, abs=1000)
    assert eval_mem_mb(LLAMA_8B, "bfloat16", "cuda", 32768, dtype_floor=True) == eval_mem_mb(QWEN_0_5B, "float32", "cuda", 1024)
    assert eval_mem_mb(LLAMA_8B, "float32", "cpu", 0) == MEM_FLOOR_MB  # a dataset's natural lengths: not known here


def test_a_jobs_memory_is_to_be_decided_until_its_model_is_acquired(tmp_path):
    """job_mem_mb (the evaluate rule's mem_mb) raises FileNotFoundError naming the rule's input, the model folder,
    until the card is there (Snakemake's sign to decide the value when the job is ready), then reads it."""
    import json

    from kvlab.state.jobs import eval_mem_mb, job_mem_mb

    config = {"dtype": "bfloat16", "device": "cpu", "dtype_floor": {"samples": 5, "tasks": ["prose_kl"]}}
    model = tmp_path / "model"
    with pytest.raises(FileNotFoundError) as missing:
        job_mem_mb(config, str(model), "prose_kl", 8192)
    assert missing.value.filename == str(model)
    model.mkdir()
    (model / "card.json").write_text(json.dumps(LLAMA_8B))
    assert job_mem_mb(config, str(model), "prose_kl", 8192) == eval_mem_mb(LLAMA_8B, "bfloat16", "cpu", 8192, dtype_floor=True)
    assert job_mem_mb(config, str(model), "niah_single", 8192) == eval_mem_mb(LLAMA_8B, "bfloat16", "cpu", 8192)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_slurm_profile_asks_each_evaluation_job_for_its_memory_and_a_gpu_on_cuda(tmp_path, device):
    """Through the SLURM profile, each evaluation job's mem_mb is eval_mem_mb of its model's card (read once the
    model is acquired; a larger card stands in for the smoke preset's tiny model here), its task's dtype floor and
    its context length; gpu=1 on cuda."""
    import json
    import re

    import yaml

    from conftest import snakemake, workflow_copy
    from kvlab.state.config import resolve
    from kvlab.state.jobs import eval_mem_mb

    work = workflow_copy(tmp_path / "work")
    model = work / "resources" / "models" / "tiny-qwen2"
    model.mkdir(parents=True)
    (model / "card.json").write_text(json.dumps(LLAMA_8B))
    proc = snakemake(work, "--profile", "profiles/slurm", "results/report.html", "-n", "--config", "preset=smoke",
                     f"device={device}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load((work / "config.yaml").read_text())
    config = resolve({**config, "preset": "smoke"}, work / "workflow" / "config.schema.yaml")
    jobs = re.findall(r"^rule evaluate:\n.*?wildcards: model=tiny-qwen2, task=(\w+), ctx=(\d+)\n.*?resources: (.*?)\n",
                      proc.stdout, flags=re.M | re.S)
    assert jobs
    floor = config["dtype_floor"]
    for task, ctx, resources in jobs:
        measured = bool(floor["samples"]) and task in floor["tasks"]
        expected = eval_mem_mb(LLAMA_8B, config["dtype"], device, int(ctx), measured)
        assert f"mem_mb={expected}," in resources and f"gpu={int(device == 'cuda')}" in resources, (task, ctx, resources)
