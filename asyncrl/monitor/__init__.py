"""The live monitor: the end of the metrics stream (docs/monitor.md).

scheduler records (scheduler/records.py) -> stream.py (PUB socket, sinks.py, in-process dashboard)
  -> aggregate.py (RunView: records folded one by one) -> panels.py (drawn frames) -> live.py
attach.py: `asyncrl monitor` (SUB + metrics.jsonl catch-up); report.py: `asyncrl report` plots;
web/: `asyncrl monitor --web` and `launch --web`, the same records as a web page (web/__init__.py).
A pure consumer of records: imports nothing from the scheduler, learner or generators, and is
wired to the launcher by the app layer (asyncrl/job.py); nothing here imports torch.
"""
