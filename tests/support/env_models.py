"""A small model whose BPE tokenizer merges across turn boundaries, for the environments' token
fidelity tests: decoding an episode and tokenising the text again gives other ids whenever a
model token ends in a digit and the environment's answer starts with one ("1" + "2" -> "12")."""

from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = list("0123456789+=")


def build_bpe_tokenizer(vocab_size: int = 160):
    """A byte-free BPE over digits, '+' and '=' with merges of digit pairs (and longer)."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = ["".join(rng.choice("0123456789") for _ in range(rng.randint(2, 6))) for _ in range(4000)]
    corpus += [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}={rng.randint(0, 198)}" for _ in range(2000)]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=ALPHABET)
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def create_bpe_model(out_dir: Path, *, seed: int = 3) -> Path:
    """An untrained small Llama with the BPE tokenizer, in a Hugging Face directory."""
    from asyncrl.models.tiny import build_model

    tokenizer = build_bpe_tokenizer()
    model = build_model(len(tokenizer), max_positions=128, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
