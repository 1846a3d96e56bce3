"""A multi-turn, tool-using environment for asyncrl: see environment.py and docs/environments.md."""
