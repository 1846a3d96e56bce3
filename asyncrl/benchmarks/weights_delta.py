"""Bytes per delta update of a really trained model, for `asyncrl bench weights --trained-delta-steps N`.

Place in the data flow: measures what `weights.delta` ships (transport/delta.py) when the learner
publishes after real optimizer steps: a Llama-shaped causal LM of about `num_params` parameters,
initialised as transformers does, trained `steps` AdamW steps at learning rate `lr` on random
token sequences (the loss and data do not matter for the size of an update, Adam's step size does),
each version published through `write_shards` with a `DeltaBase`, in each serving dtype asked for.
Deltas are checked here too: each version is read back by applying its delta to the previous one.

The timed delta row of the bench (`weights_run.adam_like_states`) models the same update without
training; this measures it.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from asyncrl.transport.delta import DeltaBase, HeldVersion
from asyncrl.transport.shard_read import read_manifest, read_shards
from asyncrl.transport.shards import write_shards

_VOCAB = 32000
_SEQ_LEN = 64
_BATCH = 2


def llama_config(num_params: int):
    """A Llama config of about `num_params` parameters: hidden 768, untied embeddings, layers added
    until the count is reached."""
    from transformers import LlamaConfig

    hidden, intermediate = 768, 2048
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    num_layers = max(1, round((num_params - 2 * _VOCAB * hidden) / per_layer))
    return LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=_SEQ_LEN,
        tie_word_embeddings=False,
    )


def measure_trained_deltas(
    *,
    num_params: int = 100_000_000,
    steps: int = 3,
    lr: float = 1e-6,
    dtypes: tuple[str, ...] = ("bfloat16", "float32"),
    root: Path | None = None,
    seed: int = 0,
) -> dict:
    """Train `steps` steps and publish each version in every dtype of `dtypes`; returns, per dtype,
    the full bytes of a version and the delta bytes of each update."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(num_params))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    base = Path(tempfile.mkdtemp(prefix="asyncrl-trained-delta-", dir=root))
    result: dict = {
        "num_params": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "lr": lr,
        "optimizer": "AdamW",
        "dtypes": {},
    }
    bases = {d: DeltaBase() for d in dtypes}
    held: dict[str, HeldVersion | None] = dict.fromkeys(dtypes)
    rows = {d: {"full_bytes": 0, "delta_bytes": [], "publish_s": [], "apply_s": []} for d in dtypes}
    try:
        for version in range(steps + 1):
            if version > 0:
                ids = torch.randint(0, _VOCAB, (_BATCH, _SEQ_LEN), generator=g)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for name in dtypes:
                dtype = getattr(torch, name)
                state = {n: t.detach().to(dtype) for n, t in model.state_dict().items()}
                out = base / name
                t0 = time.perf_counter()
                manifest = write_shards(
                    state, out, version, max_shard_bytes=512 << 20, fsync=False, delta_base=bases[name]
                )
                t1 = time.perf_counter()
                got = read_shards(out, version, held=held[name])
                rows[name]["full_bytes"] = sum(f.size_bytes for f in manifest.files)
                if manifest.delta is not None:
                    rows[name]["delta_bytes"].append(sum(d.size_bytes for d in manifest.delta.files))
                    rows[name]["publish_s"].append(t1 - t0)
                    rows[name]["apply_s"].append(time.perf_counter() - t1)
                assert all(torch.equal(got[n].view(torch.uint8), state[n].view(torch.uint8)) for n in state)
                held[name] = HeldVersion.of(read_manifest(out, version), got)
                if version > 1:  # the directory of the version before the held one is no longer needed
                    shutil.rmtree(out / f"v{version - 2:08d}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name, row in rows.items():
        row["delta_fraction"] = [b / row["full_bytes"] for b in row["delta_bytes"]]
        result["dtypes"][name] = row
    return result
