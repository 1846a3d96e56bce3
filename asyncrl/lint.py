"""The settings linter: combinations of settings known to bias or break training, found at load.

Place in the data flow: `config_from_tree` calls `lint(config)` once every section has validated on
its own. A finding at level "error" refuses the config (a `ConfigError` naming the setting and the
fix) unless its rule is listed in `run.allow_unsafe`, which turns it into a warning; warnings are
printed by `asyncrl launch`, recorded as a `lint` event in metrics.jsonl and listed in
summary.json. `asyncrl lint [CONFIG] [--set ...]` prints every finding without starting anything.

Each rule is a function of the config alone (and of the model directories' tokenizer files, for
the distillation rule), pure and cheap, with a test in tests/unit/test_lint.py and a line in
docs/safety.md. A rule names the setting to change first in `key`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from asyncrl.config import Config

# Staleness bounds with no off-policy correction (policy "none": PPO clipped against the behaviour
# policy alone): above WARN the run is warned, above ERROR refused. AReaL and the VCPO paper train
# uncorrected up to a few versions; beyond, the importance ratios of the oldest tokens leave the
# clip range and their gradients are dropped (docs/safety.md).
STALE_UNCORRECTED_WARN = 4
STALE_UNCORRECTED_ERROR = 8

Level = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    rule: str  # stable id, accepted by run.allow_unsafe
    level: Level
    key: str  # the setting to change first
    problem: str
    fix: str

    def line(self) -> str:
        return f"{self.level} [{self.rule}] at {self.key}: {self.problem}; {self.fix}"

    def to_json(self) -> dict[str, str]:
        return {
            "rule": self.rule,
            "level": self.level,
            "key": self.key,
            "problem": self.problem,
            "fix": self.fix,
        }


Rule = Callable[[Any], Iterator[Finding]]
RULES: dict[str, Rule] = {}


def rule(name: str) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        RULES[name] = fn
        return fn

    return register


def _stale_bound(config: Config) -> int:
    return config.effective_max_staleness  # with "auto", its hard cap


@rule("stale-uncorrected")
def _stale_uncorrected(config: Config) -> Iterator[Finding]:
    bound = _stale_bound(config)
    if config.staleness.policy != "none" or config.opd.enabled or bound <= STALE_UNCORRECTED_WARN:
        return
    level: Level = "error" if bound > STALE_UNCORRECTED_ERROR else "warning"
    yield Finding(
        "stale-uncorrected",
        level,
        "staleness.max_staleness",
        f"a staleness bound of {bound} with staleness.policy = 'none': tokens up to {bound} versions old "
        "are trained with PPO's clip against the behaviour policy as the only correction",
        "choose a correction (e.g. --set staleness.policy=decoupled, m2po or vcpo; docs/staleness.md) "
        f"or lower staleness.max_staleness to {STALE_UNCORRECTED_WARN} or less",
    )


@rule("epochs-stale-uncorrected")
def _epochs_stale(config: Config) -> Iterator[Finding]:
    if config.learner.epochs == 1 or _stale_bound(config) == 0 or config.staleness.policy != "none":
        return
    yield Finding(
        "epochs-stale-uncorrected",
        "warning",
        "learner.epochs",
        f"learner.epochs = {config.learner.epochs} over stale batches with staleness.policy = 'none': "
        "every later epoch moves the policy further from the stale behaviour policy, and nothing "
        "accounts for the staleness the batch already had",
        "use learner.epochs = 1, mode = 'sync', or an off-policy correction (staleness.policy = decoupled)",
    )


@rule("decoupled-one-update")
def _decoupled_one_update(config: Config) -> Iterator[Finding]:
    bound = _stale_bound(config)
    lrn = config.learner
    if config.staleness.policy != "decoupled" or bound <= 2 or lrn.minibatches > 1 or lrn.epochs > 1:
        return
    yield Finding(
        "decoupled-one-update",
        "warning",
        "learner.minibatches",
        f"staleness.policy = 'decoupled' with one optimizer update per batch at a staleness bound of {bound}: "
        "the proximal policy is then the current one, the clip never binds, and the objective is "
        "importance-weighted policy gradient with weights up to the cap (unstable at high staleness)",
        "update by minibatches against the same proximal anchor with the learning rate divided by their "
        "count, e.g. --set learner.minibatches=4 and learner.lr at a quarter (minibatches alone still "
        "fell short of no correction at bound 8: docs/staleness.md), or lower staleness.max_staleness to 2",
    )


@rule("greedy-groups")
def _greedy_groups(config: Config) -> Iterator[Finding]:
    if config.sampling.temperature > 0 or config.opd.enabled:
        return
    yield Finding(
        "greedy-groups",
        "error",
        "sampling.temperature",
        "sampling.temperature = 0 samples every member of a group alike, so every group's rewards are "
        "equal, its advantages 0, and nothing is learned",
        "sample at a temperature > 0 (e.g. --set sampling.temperature=1.0); greedy decoding is for evaluation",
    )


@rule("top-p-plugin")
def _top_p_plugin(config: Config) -> Iterator[Finding]:
    if config.sampling.top_p >= 1.0 or config.sampling.temperature == 0:
        return
    if config.generators.kind in ("torch", "sglang"):
        return  # both record log-probs renormalised over the nucleus (docs/generators.md)
    yield Finding(
        "top-p-plugin",
        "warning",
        "sampling.top_p",
        f"sampling.top_p = {config.sampling.top_p} with generator plugin {config.generators.kind!r}: the "
        "learner recomputes log-probs over the nucleus, so the plugin's behaviour log-probs must be "
        "renormalised over it too (SGLang's plain output_token_logprobs are not)",
        "check the plugin returns nucleus log-probs (SGLang: return_sampling_mask), or use top_p = 1",
    )


@rule("opd-top-p")
def _opd_top_p(config: Config) -> Iterator[Finding]:
    if not config.opd.enabled or config.sampling.top_p >= 1.0:
        return
    yield Finding(
        "opd-top-p",
        "warning",
        "sampling.top_p",
        f"distillation with sampling.top_p = {config.sampling.top_p}: the student is pulled toward the "
        "teacher over its nucleus only, and tokens outside it are never corrected",
        "keep sampling.top_p = 1 for distillation (docs/opd.md)",
    )


@rule("opd-temperature")
def _opd_temperature(config: Config) -> Iterator[Finding]:
    temperature = config.sampling.temperature
    if not config.opd.enabled or temperature in (0.0, 1.0):
        return
    yield Finding(
        "opd-temperature",
        "warning",
        "sampling.temperature",
        f"distillation at sampling.temperature = {temperature} minimises KL(pi^(1/{temperature}) || "
        "teacher): the tempered student, not the student, matches the teacher",
        "use sampling.temperature = 1 for plain distillation (docs/opd.md, Temperatures)",
    )


@rule("opd-tokenizer")
def _opd_tokenizer(config: Config) -> Iterator[Finding]:
    if not config.opd.enabled or config.opd.teacher == "self":
        return
    from asyncrl.models.default import DEFAULT_MODEL_DIR, TEACHER_MODEL_DIR

    student = Path(config.model.path) if config.model.path else DEFAULT_MODEL_DIR
    teacher = Path(config.opd.teacher) if config.opd.teacher else TEACHER_MODEL_DIR
    mine, theirs = tokenizer_fingerprint(student), tokenizer_fingerprint(teacher)
    if mine is None or theirs is None or mine == theirs:
        return  # a directory without tokenizer files is checked when the teacher loads
    yield Finding(
        "opd-tokenizer",
        "error",
        "opd.teacher",
        f"the teacher at {teacher} has a different tokenizer from the student at {student}: it would "
        "score token ids that mean other text to it",
        "distil from a teacher of the student's tokenizer family (same tokenizer.json vocabulary)",
    )


@rule("drop-degenerate-window")
def _drop_degenerate_window(config: Config) -> Iterator[Finding]:
    if not config.learner.drop_degenerate_groups or config.buffer.mode != "window":
        return
    yield Finding(
        "drop-degenerate-window",
        "warning",
        "learner.drop_degenerate_groups",
        "dropping degenerate groups with buffer.mode = 'window' trains fewer groups per step as the model "
        "gets better or worse at the task, so the effective batch and learning rate drift",
        "use buffer.mode = 'pool' (dropped groups are replaced) or keep every group",
    )


@rule("length-biased-agg")
def _length_biased_agg(config: Config) -> Iterator[Finding]:
    if config.learner.agg != "seq-mean-token-mean" or config.opd.enabled:
        return
    yield Finding(
        "length-biased-agg",
        "warning",
        "learner.agg",
        "learner.agg = 'seq-mean-token-mean' divides each sequence's loss by its own length: a long "
        "wrong answer is penalised less per token than a short one, so wrong answers drift longer "
        "(Dr. GRPO, arXiv 2503.20783)",
        "use 'token-mean' or 'seq-mean-token-sum-norm' unless you reproduce a recipe that needs it",
    )


@rule("ignore-eos-training")
def _ignore_eos(config: Config) -> Iterator[Finding]:
    if not config.sampling.ignore_eos:
        return
    yield Finding(
        "ignore-eos-training",
        "warning",
        "sampling.ignore_eos",
        "sampling.ignore_eos trains every token sampled past eos with the answer's advantage: the "
        "model learns whatever text followed its answers",
        "leave sampling.ignore_eos = false except in throughput benchmarks",
    )


def tokenizer_fingerprint(model_dir: Path) -> tuple | None:
    """What decides token ids: tokenizer.json's vocabulary and added tokens, else vocab.json;
    None when the directory has neither (or they cannot be read)."""
    for name in ("tokenizer.json", "vocab.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if name == "vocab.json":
            return ("vocab", tuple(sorted(data.items())))
        vocab = (data.get("model") or {}).get("vocab")
        vocab = tuple(sorted(vocab.items())) if isinstance(vocab, dict) else json.dumps(vocab, sort_keys=True)
        added = tuple(sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or ()))
        return ("tokenizer", vocab, added)
    return None


def lint(config: Config) -> list[Finding]:
    """Every finding for `config`, errors listed in `run.allow_unsafe` already turned into warnings."""
    allowed = set(config.run.allow_unsafe)
    found = [f for check in RULES.values() for f in check(config)]
    return [Finding(f.rule, "warning", f.key, f.problem, f.fix) if f.rule in allowed else f for f in found]


def check_allowed(names) -> None:
    """`run.allow_unsafe` names rules that exist (ValueError otherwise)."""
    unknown = sorted(set(names) - set(RULES))
    if unknown:
        raise ValueError(
            f"run.allow_unsafe names unknown rule(s) {', '.join(map(repr, unknown))}; the rules are "
            f"{', '.join(sorted(RULES))} (docs/safety.md)"
        )
