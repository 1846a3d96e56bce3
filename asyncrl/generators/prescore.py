"""`asyncrl opd prescore CONFIG`: score a task's reference completions with the run's teacher(s)
once, into the teacher-score cache, before training (Lightning OPD's offline setting).

Place in the data flow: reads the config a run will use (opd.cache on, opd.cache_dir naming the
directory the run will read), builds the task and its prompts as the launcher's dispatcher does
(`task.render`, and `privileged_render` for a "self" teacher), and for each of the first P
training prompts takes the reference completion, the problem's worked solution if it has one
(`Problem.solution`: the addition task's sum, `task.dataset.solution_field`) else its answer,
tokenised without special tokens and closed by eos, as a sampled completion would be. Each is
scored by the teacher a generator would route it to (`teacher_routing.build_teacher`, the
teachers loaded here even when the run places them as a service: the same files give the same
identity) behind the same `CachingTeacher`, so the records land under the keys a generator looks
up. A training sample hits them when the student samples the reference exactly. Scoring is
idempotent: prompts already in the cache cost a lookup, not a forward.

With opd.num_samples = N > 1 a generator's key includes the N - 1 extra ids the student draws
at each position, which no pre-score can know: refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

# Samples per teacher call.
PRESCORE_BATCH = 32


@dataclasses.dataclass(frozen=True)
class PrescoreResult:
    prompts: int
    tokens: int
    scored: int  # teacher-scored now
    already_cached: int
    seconds: float
    cache_dir: str


def check_prescore_config(cfg: Any) -> None:
    """ValueError naming the key when the config cannot be pre-scored."""
    opd = cfg.opd
    if not (opd.enabled and opd.cache and opd.cache_dir):
        raise ValueError(
            "asyncrl opd prescore writes the cache a run reads: set opd.enabled = true, opd.cache = true "
            "and opd.cache_dir = DIR (the training run reads the same DIR)"
        )
    if opd.num_samples != 1:
        raise ValueError(
            f"opd.num_samples = {opd.num_samples}: a sample's cache key includes the student's "
            f"{opd.num_samples - 1} extra draws per position, which a pre-score cannot know; "
            "pre-scoring needs opd.num_samples = 1"
        )


def reference_tasks(cfg: Any, task: Any, tokenizer: Any, indices: range) -> list[Any]:
    """PromptTasks of the training prompts at `indices`, as the dispatcher admits them."""
    from asyncrl.messages import PromptTask, SamplingParams

    problems = [task.train_problem(i) for i in indices]
    prompts = task.render(problems, tokenizer)
    privileged = (
        task.privileged_render(problems, tokenizer) if cfg.opd.self_teacher else [[] for _ in problems]
    )
    return [
        PromptTask(
            task_id=i,
            group_id=i,
            prompt_ids=list(ids),
            num_samples=1,
            sampling=SamplingParams(),
            dataset_index=i,
            window=0,
            answer=p.answer,
            extras=dict(p.extras),
            privileged_ids=list(priv),
        )
        for i, p, ids, priv in zip(indices, problems, prompts, privileged, strict=True)
    ]


def reference_ids(problem_text: str, tokenizer: Any) -> list[int]:
    """A reference completion's ids: its text without special tokens, then eos."""
    return [*tokenizer(problem_text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def prescore(cfg: Any, policy_dir: Path, *, num_prompts: int = 0, on_progress=None) -> PrescoreResult:
    """Score the first `num_prompts` training prompts' reference completions (0 = one pass over
    a dataset task's training rows, or the run's learner.steps x learner.groups_per_step prompts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.generators.base import GeneratorContext
    from asyncrl.generators.teacher_routing import build_teacher
    from asyncrl.generators.teachers import ModelTeacher, SelfTeacher
    from asyncrl.generators.torch_gen import load_teacher
    from asyncrl.tasks.base import make_task, prepare_task

    check_prescore_config(cfg)
    opd = cfg.opd
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    task = make_task(cfg.task)
    prepare_task(task, tokenizer, groups_per_step=cfg.learner.groups_per_step)
    if num_prompts <= 0:
        num_prompts = getattr(task, "num_train", None) or cfg.learner.steps * cfg.learner.groups_per_step
    tasks = reference_tasks(cfg, task, tokenizer, range(num_prompts))
    dtype = cfg.learner.publish_dtype
    extra = (
        {"top_k": opd.teacher_top_k} if getattr(opd, "teacher_top_k", 0) else {}
    )  # what a generator passes
    pad = tokenizer.pad_token_id

    def make_one(path: str, name: str):
        if path == "self":
            policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=getattr(torch, dtype)).eval()
            return SelfTeacher(policy, weights=opd.self_weights, pad_token_id=pad, **extra)
        return ModelTeacher(load_teacher(path, tokenizer, dtype=dtype), pad_token_id=pad, **extra)

    ctx = GeneratorContext(
        generator_id="prescore",
        model_path=str(policy_dir),
        sampling=cfg.sampling,
        task=cfg.task,
        seed=0,
        opd=opd,
        dtype=dtype,
    )
    teacher = build_teacher(ctx, make_one)
    solutions = [task.train_problem(t.dataset_index) for t in tasks]
    ids = [
        torch.tensor(reference_ids(p.solution or p.answer, tokenizer), dtype=torch.int64)[:, None]
        for p in solutions
    ]
    for start in range(0, len(tasks), PRESCORE_BATCH):
        teacher.score(tasks[start : start + PRESCORE_BATCH], ids[start : start + PRESCORE_BATCH])
        if on_progress is not None:
            on_progress(min(start + PRESCORE_BATCH, len(tasks)), len(tasks))
    counts = _counters(teacher)
    return PrescoreResult(
        prompts=len(tasks),
        tokens=sum(int(x.shape[0]) for x in ids),
        scored=counts.misses,
        already_cached=counts.hits,
        seconds=time.perf_counter() - started,
        cache_dir=str(Path(opd.cache_dir)),
    )


def _counters(teacher: Any):
    from asyncrl.generators.teacher_cache import CacheCounters
    from asyncrl.generators.teacher_routing import RoutedTeacher

    total = CacheCounters()
    for t in teacher.teachers.values() if isinstance(teacher, RoutedTeacher) else [teacher]:
        total.add(t.counters)
    return total
