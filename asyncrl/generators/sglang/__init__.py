"""The `sglang` generator backend: SGLang servers over HTTP, and its side of weight sync.

Modules, in data-flow order:
  - `options.py`: the `generators.options.*` this backend reads, checked at load time (pure);
  - `launch.py`: starting and stopping servers when the generator launches them itself;
  - `client.py`: the HTTP client and the fleet of servers (least-loaded pick, quarantine);
  - `generator.py`: `SGLangGenerator`, PromptTasks in, Rollouts out (`generators/rollouts.py`);
  - `group.py`: the generator's HTTP side of a weight update group (broadcast transport);
  - `publisher.py`: the learner's side of that group, a `WeightPublisher` registered under the
    entry-point group `asyncrl.publishers` (so `transport/` never names this backend).

`asyncrl.generators.sglang:SGLangGenerator` is the class the `sglang` entry point names.
"""

from __future__ import annotations

from asyncrl.generators.sglang.generator import SGLangGenerator, segment_seed, verify_shards
from asyncrl.generators.sglang.options import OPTIONS, PAUSE_MODES, parse_options

__all__ = ["OPTIONS", "PAUSE_MODES", "SGLangGenerator", "parse_options", "segment_seed", "verify_shards"]
