"""Test support for plugin authors (nothing here runs in a training job).

- `asyncrl.testing.contract`: the contract suite a generator plugin author runs against their own
  generator (`check_generator`, or the pytest mixin `GeneratorContractTests`).
- `asyncrl.testing.verifier`: a stand-in remote verifier (the `remote` reward's HTTP protocol,
  exact match), in-process or `python -m asyncrl.testing.verifier --port N`, for a reward author
  to try the `remote` reward against (docs/tasks.md).

Fakes that only our own suites use live outside the package, in `tests/support/` (the stand-in
SGLang server: `tests.support.sglang`).
"""
