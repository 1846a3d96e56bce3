"""Environments for agentic multi-turn episodes (docs/environments.md).

`base.py` the Environment seam and its registry; `render.py` observations to token ids;
`host.py` where environments run (in-process) and their failure kinds; `pool.py` + `worker.py` +
`wire.py` jailed worker processes; `jail.py` the kernel's confinement; `sandbox.py` model-written
code; `tools.py` tools, the tool-call parser, ToolEnvironment; `remote.py` + `server.py`
environments over HTTP. The episode runner that drives them is `generators/episode_runner.py`.
"""
