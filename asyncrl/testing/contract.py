"""Contract tests for `Generator` plugins: run them against your own generator on CPU.

A plugin author gives a factory (a zero-argument callable returning an un-setup generator) and the
`GeneratorContext` the service would hand it, and gets either a pass or one `ContractViolation`
listing every broken rule by name:

    from asyncrl.testing.contract import check_generator, make_context
    check_generator(MyGenerator, make_context("/path/to/model"), weights_dir=tmp_path / "w")

or, in pytest, subclass `GeneratorContractTests` and provide two fixtures:

    class TestMine(GeneratorContractTests):
        @pytest.fixture
        def generator_factory(self): return MyGenerator
        @pytest.fixture
        def generator_context(self, model_dir): return make_context(model_dir)

The rules (names as they appear in failure messages):

  protocol            the object implements `asyncrl.generators.base.Generator`
  version-int         `version` is a non-negative int
  samples-exact       every task gets exactly sample indices 0..num_samples-1, no other task ids
  rollout-type        `generate` returns a list of `Rollout`
  lengths-match       completion_ids, behavior_logprobs, token_versions (and loss_mask) align
  non-empty           every completion has at least one token
  token-ids-int       completion ids are non-negative ints
  logprobs-valid      behavior log-probs are finite floats <= 0 (log-probs of sampled tokens)
  versions-valid      token versions are ints in [0, generator.version], non-decreasing
  loss-mask-bool      loss_mask, when given, holds bools
  reward-finite       the reward is a finite number
  finish-reason       finish_reason is one of stop, length, abort
  yields-to-loop      `generate` gives the event loop back while it works (sampling runs in a
                      thread or awaits I/O), so heartbeats and weight announcements keep flowing
  version-stable      `generate` alone does not change `version`
  load-weights        after `load_weights(v, dir)`, `version == v` and new tokens carry v
  close               `close()` returns, and a second `close()` is harmless (idempotent)

Weights for the load-weights rule are the model's own parameters (read from `ctx.model_path`)
published with the system's shard writer as version `version + 1`, exactly what the learner writes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.generators.base import Generator, GeneratorContext, Rollout
from asyncrl.messages import PromptTask, SamplingParams

FINISH_REASONS = ("stop", "length", "abort")
PROTOCOL_MEMBERS = ("setup", "version", "generate", "load_weights", "close")
# Log-probs are sums of float32 terms: allow the rounding of a log-prob that is mathematically 0.
LOGPROB_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Violation:
    rule: str
    detail: str


class ContractViolation(AssertionError):
    """One or more contract rules broken; the message lists each as `[rule] detail`."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations = list(violations)
        lines = [f"  [{v.rule}] {v.detail}" for v in self.violations]
        super().__init__(f"generator contract broken ({len(lines)} violation(s)):\n" + "\n".join(lines))


@dataclass
class ContractReport:
    """What a passing run observed (useful in a plugin's own tests)."""

    rollouts: list[Rollout] = field(default_factory=list)
    rollouts_after_load: list[Rollout] = field(default_factory=list)
    loaded_version: int | None = None


def make_context(model_path: str | Path, **overrides: Any) -> GeneratorContext:
    """A `GeneratorContext` like the service builds, with the default config's sub-trees
    (short completions, addition task); any field can be overridden."""
    from asyncrl.config_sections import SamplingConfig, TaskConfig

    fields: dict[str, Any] = dict(
        generator_id="contract-0",
        model_path=str(model_path),
        sampling=SamplingConfig(max_new_tokens=6),
        task=TaskConfig(),
        seed=0,
        run_seed=0,
    )
    fields.update(overrides)
    return GeneratorContext(**fields)


def default_tasks(ctx: GeneratorContext, *, first_task_id: int = 0) -> list[PromptTask]:
    """Two addition tasks of different group sizes, tokenised with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ctx.model_path)
    s = ctx.sampling
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
    specs = [("12+34=", "46", 3), ("7+8=", "15", 2)]
    return [
        PromptTask(
            task_id=first_task_id + i,
            group_id=first_task_id + i,
            prompt_ids=list(tok(text)["input_ids"]),
            num_samples=n,
            sampling=sampling,
            dataset_index=first_task_id + i,
            window=0,
            answer=answer,
        )
        for i, (text, answer, n) in enumerate(specs)
    ]


def check_rollouts(rollouts: Any, tasks: Sequence[PromptTask], *, version: int) -> list[Violation]:
    """Every per-rollout and per-task rule on the output of one `generate(tasks)` call, made while
    the generator held `version`."""
    out: list[Violation] = []
    if not isinstance(rollouts, list):
        return [Violation("rollout-type", f"generate() returned {type(rollouts).__name__}, not a list")]
    bad = [type(r).__name__ for r in rollouts if not isinstance(r, Rollout)]
    if bad:
        return [Violation("rollout-type", f"generate() returned non-Rollout items: {sorted(set(bad))}")]
    wanted = {t.task_id: t for t in tasks}
    seen: dict[int, list[int]] = {t.task_id: [] for t in tasks}
    for r in rollouts:
        if r.task_id not in wanted:
            out.append(Violation("samples-exact", f"rollout for task {r.task_id}, which was not asked for"))
            continue
        seen[r.task_id].append(r.sample_index)
    for task_id, got in seen.items():
        expected = list(range(wanted[task_id].num_samples))
        if sorted(got) != expected:
            out.append(
                Violation(
                    "samples-exact",
                    f"task {task_id}: sample indices {sorted(got)}, expected {expected} exactly once each",
                )
            )
    for r in rollouts:
        out += _check_one(r, version=version)
    return out


def _check_one(r: Rollout, *, version: int) -> list[Violation]:
    where = f"task {r.task_id} sample {r.sample_index}"
    out: list[Violation] = []
    n = len(r.completion_ids)
    lengths = {
        "completion_ids": n,
        "behavior_logprobs": len(r.behavior_logprobs),
        "token_versions": len(r.token_versions),
    }
    if r.loss_mask is not None:
        lengths["loss_mask"] = len(r.loss_mask)
    if len(set(lengths.values())) > 1:
        out.append(Violation("lengths-match", f"{where}: lengths differ: {lengths}"))
    if n == 0:
        out.append(Violation("non-empty", f"{where}: empty completion (a sampled episode has >= 1 token)"))
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in r.completion_ids):
        out.append(Violation("token-ids-int", f"{where}: completion_ids must be non-negative ints"))
    bad_lp = [
        (i, lp)
        for i, lp in enumerate(r.behavior_logprobs)
        if not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > LOGPROB_TOLERANCE
    ]
    if bad_lp:
        out.append(
            Violation(
                "logprobs-valid",
                f"{where}: behavior log-probs must be finite and <= 0; first bad (index, value): {bad_lp[0]}",
            )
        )
    vs = list(r.token_versions)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vs):
        out.append(Violation("versions-valid", f"{where}: token_versions must be ints, got {vs[:8]}"))
    else:
        if any(v < 0 or v > version for v in vs):
            out.append(
                Violation(
                    "versions-valid", f"{where}: token versions {sorted(set(vs))} outside [0, {version}]"
                )
            )
        if any(b < a for a, b in zip(vs, vs[1:], strict=False)):
            out.append(
                Violation("versions-valid", f"{where}: token versions decrease along the completion: {vs}")
            )
    if r.loss_mask is not None and not all(isinstance(m, bool) for m in r.loss_mask):
        out.append(Violation("loss-mask-bool", f"{where}: loss_mask entries must be bool"))
    if not isinstance(r.reward, (int, float)) or isinstance(r.reward, bool) or not math.isfinite(r.reward):
        out.append(Violation("reward-finite", f"{where}: reward {r.reward!r} is not a finite number"))
    if r.finish_reason not in FINISH_REASONS:
        out.append(
            Violation("finish-reason", f"{where}: finish_reason {r.finish_reason!r} not in {FINISH_REASONS}")
        )
    return out


async def generate_yielding(gen: Generator, tasks: Sequence[PromptTask]) -> tuple[list[Rollout], bool]:
    """Run `gen.generate(tasks)` as a task and report whether the event loop got control back while
    it was still working (structural, no timing: a generate that computes everything without
    awaiting finishes before the loop runs anything else)."""
    job = asyncio.create_task(gen.generate(tasks), name="contract-generate")
    await asyncio.sleep(0)  # lets the job run up to its first real suspension
    yielded = not job.done()
    return await job, yielded


def publish_model_weights(model_path: str, root: Path, version: int) -> Path:
    """The model's own parameters as shards of `version` under `root` (what the learner writes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.transport.shards import collect_config_files, write_shards

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_shards(
        state,
        root,
        version,
        max_shard_bytes=1 << 20,
        extra_files=collect_config_files(Path(model_path)),
        fsync=False,
    )
    return root


async def run_contract(
    factory: Callable[[], Any],
    ctx: GeneratorContext,
    *,
    tasks: Sequence[PromptTask] | None = None,
    weights_dir: Path | None = None,
) -> ContractReport:
    """Set up a generator from `factory`, exercise it, close it; raise `ContractViolation` naming
    every broken rule. `weights_dir` (an empty directory) enables the load-weights rule."""
    tasks = list(tasks) if tasks is not None else default_tasks(ctx)
    report = ContractReport()
    gen = factory()
    # On the class: an instance's `version` property may only work after setup().
    missing = [m for m in PROTOCOL_MEMBERS if not hasattr(type(gen), m)]
    if missing:
        raise ContractViolation([Violation("protocol", f"{type(gen).__name__} lacks {missing}")])
    gen.setup(ctx)
    if not isinstance(gen, Generator):
        raise ContractViolation(
            [Violation("protocol", f"{type(gen).__name__} is not a Generator after setup()")]
        )
    violations: list[Violation] = []
    try:
        v0 = gen.version
        if not isinstance(v0, int) or isinstance(v0, bool) or v0 < 0:
            raise ContractViolation([Violation("version-int", f"version is {v0!r}, not a non-negative int")])
        rollouts, yielded = await generate_yielding(gen, tasks)
        if not yielded:
            violations.append(
                Violation(
                    "yields-to-loop",
                    "generate() ran to completion without giving the event loop back; run the sampling "
                    "off the loop (asyncio.to_thread) or await your I/O, so heartbeats keep flowing",
                )
            )
        if gen.version != v0:
            violations.append(
                Violation("version-stable", f"version went {v0} -> {gen.version} during generate()")
            )
        violations += check_rollouts(rollouts, tasks, version=gen.version)
        report.rollouts = list(rollouts) if isinstance(rollouts, list) else []
        if weights_dir is not None and not violations:
            new_version = v0 + 1
            await asyncio.to_thread(publish_model_weights, ctx.model_path, Path(weights_dir), new_version)
            await gen.load_weights(new_version, str(weights_dir))
            if gen.version != new_version:
                violations.append(
                    Violation(
                        "load-weights", f"after load_weights({new_version}, ...) version is {gen.version}"
                    )
                )
            else:
                later = await gen.generate(tasks)
                violations += check_rollouts(later, tasks, version=new_version)
                stale = sorted({v for r in later for v in r.token_versions if v != new_version})
                if stale:
                    violations.append(
                        Violation(
                            "load-weights",
                            f"tokens sampled after load_weights({new_version}) carry versions {stale}",
                        )
                    )
                report.rollouts_after_load = list(later)
                report.loaded_version = new_version
    finally:
        try:
            await gen.close()
            await gen.close()
        except Exception as exc:  # noqa: BLE001 - any failure of close() is the violation to report
            violations.append(Violation("close", f"close() raised {type(exc).__name__}: {exc}"))
    if violations:
        raise ContractViolation(violations)
    return report


def check_generator(
    factory: Callable[[], Any],
    ctx: GeneratorContext,
    *,
    tasks: Sequence[PromptTask] | None = None,
    weights_dir: Path | None = None,
) -> ContractReport:
    """Synchronous `run_contract` (its own event loop), for scripts and plain test functions."""
    return asyncio.run(run_contract(factory, ctx, tasks=tasks, weights_dir=weights_dir))


class GeneratorContractTests:
    """Mixin for pytest: subclass it (name the class `Test...`) and define the fixtures
    `generator_factory` (a zero-argument callable) and `generator_context` (a GeneratorContext).
    Override `contract_tasks` to use prompts of your own task."""

    def contract_tasks(self, ctx: GeneratorContext) -> list[PromptTask] | None:
        return None

    def test_generate_contract(self, generator_factory, generator_context):
        check_generator(generator_factory, generator_context, tasks=self.contract_tasks(generator_context))

    def test_load_weights_contract(self, generator_factory, generator_context, tmp_path):
        report = check_generator(
            generator_factory,
            generator_context,
            tasks=self.contract_tasks(generator_context),
            weights_dir=tmp_path / "contract-weights",
        )
        assert report.loaded_version is not None
