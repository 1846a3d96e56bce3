"""Model and tokenizer helpers: the embedded tiny model, local checkpoint loading, warm-start SFT."""
