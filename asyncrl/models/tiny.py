"""The embedded model: a small Llama-style causal LM and a character tokenizer, in Hugging Face format.

Nothing is downloaded: the tokenizer is built with `tokenizers` and saved with `transformers`, the
model is a fresh `LlamaForCausalLM` from a small config. `asyncrl sft` then warm-starts it on the
built-in task (see `asyncrl.models.sft`). Everything here writes ordinary HF directories, so the
rest of the system loads the embedded model exactly like a user's local checkpoint.
"""

from __future__ import annotations

from pathlib import Path

# Characters of the built-in tasks. Order fixes the token ids; the specials come first.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = tuple("0123456789+-*=(), ")


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` with <bos>/<eos>/<pad>/<unk>."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_model(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 64,
    seed: int = 0,
):
    """A fresh small `LlamaForCausalLM` (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def create_base(out_dir: Path, *, seed: int = 0, **model_kwargs) -> Path:
    """Write an untrained model and its tokenizer to `out_dir` (HF format)."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed=seed, **model_kwargs)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
