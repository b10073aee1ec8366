"""Build a correct fast tokenizer from the SentencePiece-BPE vocabulary stored in a GGUF file.

Why this exists: transformers (5.2.0) converts the tokenizer of a Gemma-3 GGUF wrongly. For the
Gemma 3 270M GGUF, ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` encodes
"The capital of France is" into 10 pieces with no BOS, instead of
``[2, 818, 5279, 529, 7001, 563]`` (``<bos>`` + SentencePiece-BPE pieces merged by score), and the
model then babbles. This module reads the ``tokenizer.ggml.*`` metadata itself and builds the
tokenizer with the ``tokenizers`` library:

* BPE model: vocab = the GGUF tokens; merges derived from the scores (every split of a normal
  token into two normal tokens is a merge, ranked by the merged token's score, highest first),
  which reproduces SentencePiece's "merge the highest-scoring adjacent pair" rule; byte fallback
  to the ``<0xNN>`` tokens; the unknown token.
* normalizer " " -> "▁" (and a "▁" prefix only when ``tokenizer.ggml.add_space_prefix`` is true);
  decoder inverting it (▁ -> space, byte fallback, fuse).
* control tokens (type 3) are special added tokens and user-defined tokens (type 4: "\\n" runs,
  space runs, HTML tags, ...) are non-special added tokens, so they are matched atomically in raw
  text, as SentencePiece / llama.cpp do ("<start_of_turn>" encodes to one id).
* BOS (and EOS) added by the post-processor as ``tokenizer.ggml.add_bos_token`` says.

The result is a ``transformers.PreTrainedTokenizerFast`` with bos/eos/pad/unk tokens and the GGUF
chat template, so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip it.

The metadata is read with a small reader of the GGUF key/value section (only the header is
touched); ``gguf.GGUFReader`` parses every element of the 262K-entry token arrays into numpy views
and takes ~10 s on the Gemma 3 vocabulary, so it is used only as a fallback for files the fast
reader does not handle (big-endian files, unknown versions).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "GEMMA_TURN_CHAT_TEMPLATE",
    "build_sentencepiece_bpe_tokenizer",
    "read_gguf_tokenizer_metadata",
]

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType): NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4, UNUSED=5, BYTE=6.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# GGUF value types (gguf.GGUFValueType) -> little-endian struct format of one scalar.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_DTYPE = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}
_STRING, _ARRAY = 8, 9
_GGUF_MAGIC = b"GGUF"

# GGUF key -> key of the dict returned by read_gguf_tokenizer_metadata.
_KEYS = {
    "general.architecture": "architecture",
    "tokenizer.ggml.model": "model",
    "tokenizer.ggml.pre": "pre",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "padding_token_id",
    "tokenizer.ggml.unknown_token_id": "unknown_token_id",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
    "tokenizer.ggml.add_space_prefix": "add_space_prefix",
    "tokenizer.chat_template": "chat_template",
}

# Used only when the GGUF carries no tokenizer.chat_template but its vocabulary has Gemma's turn
# markers (the Gemma 3 270M GGUF has none). Gemma turn format: an optional system message is
# prepended to the first user turn; "assistant" is rendered as the "model" role.
GEMMA_TURN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- set turns = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.prefix = messages[0]['content'] if messages[0]['content'] is string"
    " else messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- set ns.prefix = ns.prefix + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{%- if loop.first %}{{ ns.prefix }}{% endif -%}"
    "{%- if m['content'] is string %}{{ m['content'] | trim }}"
    "{%- else %}{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif -%}"
)


class _UnsupportedLayout(Exception):
    """The fast reader cannot parse this file; fall back to gguf.GGUFReader."""


def _read_kv_fast(path: Path) -> dict[str, Any]:
    """Parse the key/value section of a little-endian GGUF v2/v3 file (only the keys in _KEYS)."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(mm[:4])!r})")
        (version,) = struct.unpack_from("<I", mm, 4)
        if version not in (2, 3):  # also catches big-endian files (version bytes swapped)
            raise _UnsupportedLayout(f"GGUF version field {version}")
        _n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        off = 24
        out: dict[str, Any] = {}

        def read_str(o: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", mm, o)
            return mm[o + 8 : o + 8 + n].decode("utf-8"), o + 8 + n

        def read_value(vtype: int, o: int, keep: bool) -> tuple[Any, int]:
            if vtype in _SCALAR_FMT:
                fmt = _SCALAR_FMT[vtype]
                return struct.unpack_from(fmt, mm, o)[0], o + struct.calcsize(fmt)
            if vtype == _STRING:
                if keep:
                    return read_str(o)
                (n,) = struct.unpack_from("<Q", mm, o)
                return None, o + 8 + n
            if vtype == _ARRAY:
                itype, n = struct.unpack_from("<IQ", mm, o)
                o += 12
                if itype in _SCALAR_DTYPE:
                    dtype = np.dtype(_SCALAR_DTYPE[itype]).newbyteorder("<")
                    vals = None
                    if keep:
                        arr = np.frombuffer(mm, dtype=dtype, count=n, offset=o)
                        vals = arr.tolist()
                        del arr  # release the buffer export before the mmap closes
                    return vals, o + n * dtype.itemsize
                items = [] if keep else None
                for _ in range(n):
                    v, o = read_value(itype, o, keep)
                    if keep:
                        items.append(v)
                return items, o
            raise _UnsupportedLayout(f"GGUF value type {vtype}")

        for _ in range(n_kv):
            key, off = read_str(off)
            (vtype,) = struct.unpack_from("<I", mm, off)
            off += 4
            value, off = read_value(vtype, off, key in _KEYS)
            if key in _KEYS:
                out[key] = value
        return out


def _read_kv_gguf_reader(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(path)
    out: dict[str, Any] = {}
    for key in _KEYS:
        field = reader.get_field(key)
        if field is None:
            continue
        value = field.contents()
        if isinstance(value, np.generic):
            value = value.item()
        elif isinstance(value, list):
            value = [v.item() if isinstance(v, np.generic) else v for v in value]
        out[key] = value
    return out


def read_gguf_tokenizer_metadata(gguf_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Tokenizer metadata of a GGUF file as plain Python types.

    Keys (value ``None`` when the GGUF key is absent): ``architecture`` (general.architecture),
    ``model`` and ``pre`` (tokenizer.ggml.model / .pre), ``tokens`` (list[str]), ``scores``
    (list[float]), ``token_type`` (list[int]), ``bos_token_id``, ``eos_token_id``,
    ``padding_token_id``, ``unknown_token_id`` (int), ``add_bos_token``, ``add_eos_token``,
    ``add_space_prefix`` (bool) and ``chat_template`` (str).
    """
    path = Path(gguf_path)
    try:
        raw = _read_kv_fast(path)
    except (_UnsupportedLayout, struct.error) as exc:
        logger.info("fast GGUF reader cannot parse %s (%s); using gguf.GGUFReader", path, exc)
        raw = _read_kv_gguf_reader(path)
    meta: dict[str, Any] = {name: None for name in _KEYS.values()}
    for key, name in _KEYS.items():
        if key in raw:
            meta[name] = raw[key]
    for name in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        if meta[name] is not None:
            meta[name] = int(meta[name])
    for name in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if meta[name] is not None:
            meta[name] = bool(meta[name])
    if meta["scores"] is not None:
        meta["scores"] = [float(s) for s in meta["scores"]]
    if meta["token_type"] is not None:
        meta["token_type"] = [int(t) for t in meta["token_type"]]
    return meta


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece-BPE merges: every split of a normal token into two normal tokens, ranked by
    the merged token's score (highest first; ties by token id). O(V x token length)."""
    mergeable = {t for t, ty in zip(tokens, types) if ty == _NORMAL}
    order = sorted(
        (i for i, ty in enumerate(types) if ty == _NORMAL and len(tokens[i]) > 1),
        key=lambda i: (-scores[i], i),
    )
    merges: list[tuple[str, str]] = []
    append = merges.append
    for i in order:
        tok = tokens[i]
        for k in range(1, len(tok)):
            left = tok[:k]
            if left in mergeable:
                right = tok[k:]
                if right in mergeable:
                    append((left, right))
    return merges


def _token(tokens: list[str], idx: int | None, what: str) -> str | None:
    if idx is None:
        return None
    if not 0 <= idx < len(tokens):
        raise ValueError(f"GGUF {what} id {idx} is outside the vocabulary (size {len(tokens)})")
    return tokens[idx]


def build_sentencepiece_bpe_tokenizer(
    gguf_path: str | os.PathLike[str], *, chat_template: str | None = None
):
    """Fast tokenizer (``transformers.PreTrainedTokenizerFast``) for a GGUF whose
    ``tokenizer.ggml.model`` is "llama" (SentencePiece BPE with scores), e.g. Gemma 3.

    ``chat_template`` overrides the GGUF's ``tokenizer.chat_template``; when the GGUF has none and
    its vocabulary has ``<start_of_turn>``/``<end_of_turn>``, :data:`GEMMA_TURN_CHAT_TEMPLATE` is used.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path = Path(gguf_path)
    meta = read_gguf_tokenizer_metadata(path)
    model = meta["model"]
    if model != "llama":
        raise ValueError(
            f"unsupported GGUF tokenizer: tokenizer.ggml.model is {model!r} in {path.name}; "
            "only 'llama' (SentencePiece BPE) is supported"
        )
    tokens: list[str] | None = meta["tokens"]
    scores: list[float] | None = meta["scores"]
    if not tokens or scores is None or len(scores) != len(tokens):
        raise ValueError(f"{path.name}: tokenizer.ggml.tokens/scores missing or of different lengths")
    types = meta["token_type"] or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path.name}: tokenizer.ggml.token_type has {len(types)} entries, expected {len(tokens)}")

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            logger.warning("%s: duplicate token %r at ids %d and %d; keeping the first", path.name, tok, vocab[tok], i)
            continue
        vocab[tok] = i

    bos = _token(tokens, meta["bos_token_id"], "bos_token")
    eos = _token(tokens, meta["eos_token_id"], "eos_token")
    pad = _token(tokens, meta["padding_token_id"], "padding_token")
    unk = _token(tokens, meta["unknown_token_id"], "unknown_token")
    add_bos = bool(meta["add_bos_token"]) if meta["add_bos_token"] is not None else bos is not None
    add_eos = bool(meta["add_eos_token"])
    # llama.cpp's default for SentencePiece vocabularies without the key is to add the prefix.
    add_prefix = True if meta["add_space_prefix"] is None else bool(meta["add_space_prefix"])

    bpe = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "▁")
    decoder_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        # "▁" prefix on the first text segment only (not after special tokens), stripped on decode.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        decoder_steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decoder_steps)

    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    single, pair, special_ids = "$A:0", "$B:1", []
    if add_bos:
        if bos is None:
            raise ValueError(f"{path.name}: add_bos_token is true but there is no bos_token_id")
        single, pair = f"{bos}:0 {single}", f"{bos}:1 {pair}"
        special_ids.append((bos, vocab[bos]))
    if add_eos:
        if eos is None:
            raise ValueError(f"{path.name}: add_eos_token is true but there is no eos_token_id")
        single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
        special_ids.append((eos, vocab[eos]))
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} {pair}", special_tokens=special_ids
    )

    if chat_template is None:
        chat_template = meta["chat_template"]
    if chat_template is None and "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        chat_template = GEMMA_TURN_CHAT_TEMPLATE

    kwargs: dict[str, Any] = {
        "tokenizer_object": tok,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name, value in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad), ("unk_token", unk)):
        if value is not None:
            kwargs[name] = value
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return PreTrainedTokenizerFast(**kwargs)
