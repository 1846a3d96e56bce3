"""Test support for plugin authors and for our own suites (nothing here runs in a training job).

- `asyncrl.testing.sglang.server`: a stand-in SGLang HTTP server backed by a real torch model, for
  exercising the `sglang` generator (or any SGLang client) on CPU.
- `asyncrl.testing.contract`: the contract suite a generator plugin author runs against their own
  generator (`check_generator`, or the pytest mixin `GeneratorContractTests`).
- `asyncrl.testing.sglang.engine`: the engine behind it (continuous batching, pause modes, weight
  versions), usable without HTTP.
- `asyncrl.testing.verifier`: a stand-in remote verifier (the `remote` reward's HTTP protocol,
  exact match), in-process or `python -m asyncrl.testing.verifier --port N`.
"""
