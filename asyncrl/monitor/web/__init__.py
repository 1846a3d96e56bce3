"""The web monitor: `asyncrl monitor --web` and `asyncrl launch --web` (docs/monitor.md).

records -> model.py (WebRun: RunView's figures + series.py's bounded histories and timeline)
  -> server.py (aiohttp: the page, each run's state, a rate-bounded server-sent event stream;
     access.py: loopback, or a token) -> static/ (hand-written SVG charts, no network).
command.py holds the two commands' shells (following run directories; the launch's reporter).
"""
