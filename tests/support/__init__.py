"""Test-only support code that the shipped package must not carry (`tests.support.*`).

- `tests.support.sglang`: the stand-in SGLang server (the HTTP contract of the `sglang` generator
  over a real torch model, on CPU), for the sglang tests and `asyncrl bench sglang-client`;
  `python -m tests.support.sglang.server` from the repository root.
- `tests.support.waiting`: how a test waits on a launched run, never by sleeping: the launcher's
  output read line by line as it comes (`LineStream`, the `launch_streamed` fixture), the run's
  records from its metrics PUB socket (`RunRecords`), a worker's log woken by inotify.
- `tests.support.gate` and `tests.support.gated_generator`: a FIFO gate the test opens (the `gate`
  fixture) and a torch generator plugin that holds late groups until it does, so a test acts in
  the middle of a run however fast or loaded the machine is.

Importable as `tests.support` when the repository root is on `sys.path`, as it is under
`python -m pytest` at the root (CI's command) and for every process a test starts there.
"""
