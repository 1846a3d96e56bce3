"""A Python-tool agent for asyncrl: the model writes code, the sandbox runs it (environment.py)."""
