"""The live monitor: the end of the metrics stream (docs/monitor.md).

launcher write_record -> stream.py (PUB socket, sinks.py, in-process dashboard)
  -> aggregate.py (RunView: records folded one by one) -> panels.py (drawn frames) -> live.py
attach.py: `asyncrl monitor` (SUB + metrics.jsonl catch-up); report.py: `asyncrl report` plots.
Imported only by the launcher (stream.py) and the CLI layer; nothing here imports torch.
"""
