"""Launcher and scheduler: spawns and supervises processes, owns the prompt frontier and admission."""
