"""Test-only support code that the shipped package must not carry (`tests.support.*`).

- `tests.support.sglang`: the stand-in SGLang server (the HTTP contract of the `sglang` generator
  over a real torch model, on CPU), for the sglang tests and `asyncrl bench sglang-client`;
  `python -m tests.support.sglang.server` from the repository root.

Importable as `tests.support` when the repository root is on `sys.path`, as it is under
`python -m pytest` at the root (CI's command) and for every process a test starts there.
"""
