"""A stand-in SGLang server for tests: the HTTP contract of SGLANG_API.md over a real torch model.

- `server.py`: the HTTP server (`python -m tests.support.sglang.server`, or `StandInServer`);
- `process.py`: `start_standin_process`, the server as its own process once it listens;
- `serving.py`: its asyncio side (the loop thread, the admission thread, a thread per control call);
- `generate.py`: the /generate request and response bodies (parsing, validation, `meta_info`);
- `engine.py`: continuous batching, pause modes and weight versions, usable without HTTP;
- `params.py`: the strict `sampling_params` contract and the token pick;
- `groups.py`: weight update groups (tensors really arrive over gloo and load into the model).
"""
