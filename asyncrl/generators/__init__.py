"""Generators: turn PromptTasks into Trajectories (in-process torch model, SGLang servers, plugins)."""
