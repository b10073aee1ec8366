"""A randomly initialised small decoder with a byte-level tokenizer, made locally — for fast tests only."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the format of the Qwen family, so prompts look like the real model's.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens plus ChatML specials: one token per byte, no merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def tiny_model(spec: dict, vocab_size: int) -> torch.nn.Module:
    """Randomly initialised decoder of `spec['architecture']` with the given sizes and seed."""
    heads, kv_heads, head_dim = spec["heads"], spec["kv_heads"], spec["head_dim"]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["hidden_size"] * 2,
        num_hidden_layers=spec["layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
    )
    config = AutoConfig.for_model(spec["architecture"], **kwargs)
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = vocab_size - 1  # <|im_end|>, the last special token
    return model.eval()
