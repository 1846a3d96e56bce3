"""A multi-turn, tool-using generator plugin for asyncrl: see agent.py and docs/generators.md."""
