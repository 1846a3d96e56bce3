"""Built-in verifiable tasks: prompt datasets and exact reward functions."""
