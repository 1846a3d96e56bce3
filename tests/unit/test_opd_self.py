"""Self-distillation (opd.teacher = "self"): the policy scores its own completions under the task's
privileged prompt. Pinned here: the config keys and their errors, the tasks' privileged prompts
(addition: the worked answer in context; dataset: task.dataset.solution_field), the launcher's
dispatch of them, and exactness: every self-teacher log-prob equals a fresh forward, one sequence
at a time, of the weights of the version the trajectory records (`teacher_version`), on the
privileged prompt, for each `opd.self_weights`."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from asyncrl.config_sections import OpdConfig, PromptConfig, TaskConfig
from asyncrl.generators.teachers import SelfTeacher
from asyncrl.messages import PromptTask, SamplingParams
from asyncrl.tasks.arithmetic import AdditionTask
from asyncrl.tasks.base import Problem, check_privileged, raw_prompt_ids
from asyncrl.tasks.dataset import dataset_task
from tests.conftest import set_up_generator
from tests.unit.test_dataset_task import char_tokenizer, section, write


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def opd(**keys) -> OpdConfig:
    return msgspec.convert({"enabled": True, "teacher": "self", **keys}, OpdConfig)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("keys", "pattern"),
    [
        ({"teacher": "self", "placement": "service"}, r"set opd\.placement = 'generator'"),
        ({"self_weights": "current"}, r"opd\.self_weights applies with opd\.teacher = 'self' only"),
        ({"teacher": "self", "self_lag": 3}, r"opd\.self_lag applies with opd\.self_weights = 'lagged'"),
        (
            {"teacher": "self", "self_ewma_decay": 0.5},
            r"self_ewma_decay applies with opd\.self_weights = 'ewma'",
        ),
        ({"service_window_ms": 5.0}, r"opd\.service_window_ms applies with opd\.placement = 'service'"),
        ({"teacher": "self", "self_weights": "ewma", "self_ewma_decay": 1.0}, r"self_ewma_decay"),
    ],
)
def test_bad_teacher_keys_are_refused_at_load(keys, pattern):
    with pytest.raises(msgspec.ValidationError, match=pattern):
        msgspec.convert(keys, OpdConfig)


def test_teacher_keys_that_fit_load():
    assert opd(self_weights="lagged", self_lag=3).self_lag == 3
    assert msgspec.convert({"placement": "service", "service_window_ms": 0}, OpdConfig).service_window_ms == 0


# ----------------------------------------------------------------------------- tasks
def addition_task() -> AdditionTask:
    return AdditionTask(seed=1, eval_seed=2, num_eval=10, max_operand=99)


def test_addition_puts_the_worked_answer_in_context(tok):
    task = addition_task()
    problems = [task.train_problem(i) for i in range(4)]
    plain = task.render(problems, tok)
    privileged = task.privileged_render(problems, tok)
    for p, ids, priv in zip(problems, plain, privileged, strict=True):
        assert p.solution == p.answer
        # The completion follows the same prompt text: the privileged prompt ends as the plain one.
        assert priv[-(len(ids) - 1) :] == ids[1:] and priv[0] == ids[0] == tok.bos_token_id
        worked = raw_prompt_ids([Problem(index=0, prompt=p.prompt + p.answer, answer="")], tok)[0]
        assert priv == worked + [tok.eos_token_id] + ids[1:]
        assert tok.decode(priv) == f"<bos>{p.prompt}{p.answer}<eos>{p.prompt}"


def test_a_task_without_privileged_prompts_is_refused_for_self_distillation(tok):
    class Plain:
        eval_problems: list = []

        def train_problem(self, i):
            return Problem(index=i, prompt="1+1=", answer="2")

        def render(self, problems, tokenizer):
            return raw_prompt_ids(problems, tokenizer)

        def score(self, prompt, completion, answer):
            return 0.0

    with pytest.raises(
        ValueError, match=r"opd\.teacher = 'self' needs a task that builds privileged prompts"
    ):
        check_privileged(Plain(), opd(), tok)
    check_privileged(Plain(), OpdConfig(enabled=True), tok)  # a teacher directory: nothing asked
    check_privileged(addition_task(), opd(), tok)


ROWS = [{"prompt": f"q{i}", "answer": str(i), "sol": f"s{i}"} for i in range(6)]


def with_options(task: TaskConfig, **fields) -> TaskConfig:
    """`task.dataset` with the self-distillation fields set."""
    return msgspec.structs.replace(task, dataset=msgspec.structs.replace(task.dataset, **fields))


def test_dataset_task_shows_the_solution_column(tmp_path):
    tokenizer = char_tokenizer()
    path = write(tmp_path / "d.jsonl", ROWS, "jsonl")
    task = dataset_task(with_options(section(path, shuffle=False), solution_field="sol"))
    problems = [task.train_problem(i) for i in range(3)]
    assert [p.solution for p in problems] == ["s0", "s1", "s2"]
    expected = tokenizer([f"Reference solution:\ns{i}\n\nq{i}" for i in range(3)])["input_ids"]
    assert task.privileged_render(problems, tokenizer) == expected
    check_privileged(task, opd(), tokenizer)

    chat = dataset_task(
        with_options(
            section(path, PromptConfig(template="chat", system="S"), shuffle=False),
            solution_field="sol",
            privileged_template="[{solution}] {prompt}",
        )
    )
    (ids,) = chat.privileged_render([chat.train_problem(1)], tokenizer)
    assert tokenizer.decode(ids) == "<system>S\n<user>[s1] q1\n<assistant>"
    assert chat.render([chat.train_problem(1)], tokenizer) != [ids]  # the student never sees it


def test_dataset_task_errors_name_the_key(tmp_path):
    tokenizer = char_tokenizer()
    path = write(tmp_path / "d.jsonl", ROWS, "jsonl")
    with pytest.raises(ValueError, match=r"set task\.dataset\.solution_field"):
        check_privileged(dataset_task(section(path)), opd(), tokenizer)
    with pytest.raises(ValueError, match=r"no field 'nope' \(task\.dataset\.solution_field\)"):
        dataset_task(with_options(section(path), solution_field="nope"))
    holes = write(tmp_path / "h.jsonl", [*ROWS[:2], {"prompt": "q", "answer": "1", "sol": None}], "jsonl")
    with pytest.raises(ValueError, match=r"h\.jsonl line 3: the solution 'sol' .* is null or missing"):
        dataset_task(with_options(section(holes), solution_field="sol"))
    with pytest.raises(ValueError, match=r"privileged_template must .* end"):
        dataset_task(
            with_options(section(path), solution_field="sol", privileged_template="{prompt} {solution}")
        )


def test_dispatch_sends_privileged_prompts_only_for_self_distillation(tok):
    from asyncrl.scheduler.dispatch import Dispatcher
    from asyncrl.scheduler.modes import WindowMode
    from asyncrl.scheduler.tasks import TaskBook

    task = addition_task()
    for privileged in (False, True):
        dispatcher = Dispatcher(
            book=TaskBook(groups_per_step=2, samples_per_group=2),
            mode=WindowMode(groups_per_step=2, max_staleness=0, total_steps=2),
            task=task,
            sampling=SamplingParams(),
            max_staleness=0,
            tokenizer=tok,
            privileged=privileged,
        )
        sent = [t for ts in dispatcher.plan(loaded_version=0, serving=["g"]).by_peer.values() for t in ts]
        assert len(sent) == 2
        for t in sent:
            expected = task.privileged_render([task.train_problem(t.group_id)], tok)[0] if privileged else []
            assert t.privileged_ids == expected


# ----------------------------------------------------------------------------- exactness
def version_state(model, version: int) -> dict[str, torch.Tensor]:
    """Weights of `version`: the model's, moved by seeded noise (fresh CPU tensors, as offered);
    tied tensors (the embedding and the output head) move together."""
    g = torch.Generator().manual_seed(100 + version)
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for n, t in model.state_dict().items():
        if t.data_ptr() not in moved:
            noise = 0.2 * torch.randn(t.shape, generator=g) if t.is_floating_point() else 0
            moved[t.data_ptr()] = (t + noise).contiguous()
        out[n] = moved[t.data_ptr()].clone()
    return out


def fresh_scores(model_dir, state, prompt, ids_TN: torch.Tensor) -> torch.Tensor:
    """log-softmax at temperature 1 of one unpadded forward of `state` over prompt + completion."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(state)
    seq = torch.tensor([list(prompt) + ids_TN[:, 0].tolist()])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start : start + ids_TN.shape[0]], dim=-1).gather(1, ids_TN)


def prompt_tasks(tok, num_samples: int = 3) -> list[PromptTask]:
    task = addition_task()
    problems = [task.train_problem(i) for i in range(3)]
    return [
        PromptTask(
            task_id=i,
            group_id=20 + i,
            prompt_ids=ids,
            num_samples=num_samples,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
            dataset_index=i,
            window=0,
            answer=p.answer,
            privileged_ids=priv,
        )
        for i, (p, ids, priv) in enumerate(
            zip(problems, task.render(problems, tok), task.privileged_render(problems, tok), strict=True)
        )
    ]


# Versions each mode's generator applies (4 is skipped: a newer offer replaced it), the teacher
# version the samples must record, and the decay / lag.
CASES = {
    "initial": ({}, 0),
    "current": ({}, 5),
    "lagged": ({"self_lag": 2}, 3),
    "ewma": ({"self_ewma_decay": 0.5}, None),  # the floor of the EWMA of version numbers
}


@pytest.mark.parametrize("mode", list(CASES))
def test_self_teacher_equals_a_fresh_forward_of_the_recorded_version(tiny_model_dir, tok, mode):
    from asyncrl.generators.torch_gen import TorchGenerator

    keys, expected_version = CASES[mode]
    gen = set_up_generator(
        TorchGenerator, tiny_model_dir, run_seed=5, opd=opd(self_weights=mode, num_samples=3, **keys)
    )
    initial = {n: t.detach().clone() for n, t in gen.model.state_dict().items()}
    states = {0: initial}
    ewma, centre = {n: t.clone() for n, t in initial.items()}, 0.0
    for version in (1, 2, 3, 5):
        states[version] = version_state(gen.model, version)
        gen.offer_weights(version, states[version])
        assert gen.apply_pending()
        ewma = {n: torch.lerp(ewma[n], states[version][n], 0.5) for n in ewma}
        centre = 0.5 * centre + 0.5 * version
    if mode == "ewma":
        expected_version, states[int(centre)] = int(centre), ewma
    batch = prompt_tasks(tok)
    rollouts = gen.generate_sync(batch)
    assert len(rollouts) == 9
    by_task = {t.task_id: t for t in batch}
    for r in rollouts:
        assert r.teacher_version == expected_version
        assert gen.teacher_version == expected_version
        ids_TN = torch.tensor(r.opd_ids)
        want = fresh_scores(
            tiny_model_dir, states[expected_version], by_task[r.task_id].privileged_ids, ids_TN
        )
        torch.testing.assert_close(torch.tensor(r.teacher_logprobs), want, atol=1e-5, rtol=0)
    # The student's side is untouched: its behavior log-probs are the sampling weights' (version 5).
    r = rollouts[0]
    student = fresh_scores(tiny_model_dir, states[5], by_task[r.task_id].prompt_ids, torch.tensor(r.opd_ids))
    torch.testing.assert_close(torch.tensor(r.opd_behavior_logprobs), student, atol=1e-5, rtol=0)


def test_current_weights_are_those_the_generator_holds_when_it_scores(tiny_model_dir, tok):
    """An update that lands mid-generation: the teacher scores with the newest weights applied,
    and records that version (never older than any token's)."""
    from asyncrl.generators.torch_gen import TorchGenerator

    gen = set_up_generator(TorchGenerator, tiny_model_dir, run_seed=5, opd=opd(self_weights="current"))
    state = version_state(gen.model, 1)
    gen.offer_weights(1, state)  # applied at the first safe point between decode steps
    batch = prompt_tasks(tok)
    rollouts = gen.generate_sync(batch)
    assert any(0 in r.token_versions for r in rollouts), "the update should land after a first token"
    for r in rollouts:
        assert r.teacher_version == 1 >= max(r.token_versions)
        want = fresh_scores(tiny_model_dir, state, batch[r.task_id].privileged_ids, torch.tensor(r.opd_ids))
        torch.testing.assert_close(torch.tensor(r.teacher_logprobs), want, atol=1e-5, rtol=0)


def test_lagged_teacher_takes_the_newest_version_lag_behind():
    """Pure bookkeeping: versions held oldest first; the teacher is the newest held <= v - lag
    (the initial weights, version 0, until there is one), and the older ones are let go."""
    model = torch.nn.Linear(2, 2)
    teacher = SelfTeacher(model, weights="lagged", lag=2, pad_token_id=0)
    seen = []
    for version in (1, 2, 4, 5, 9):
        state = {n: torch.full_like(t, float(version)) for n, t in model.state_dict().items()}
        teacher.on_weights(version, state)
        seen.append((teacher.version, float(teacher.model.weight[0, 0])))
    assert [v for v, _ in seen] == [0, 0, 2, 2, 5]
    assert all(value == v or v == 0 for v, value in seen[2:])
    assert [v for v, _ in teacher._held] == [9]
    assert teacher.model is not model and teacher.model.weight.requires_grad is False


def test_ewma_version_is_the_floor_of_its_centre_of_mass():
    model = torch.nn.Linear(2, 2)
    teacher = SelfTeacher(model, weights="ewma", ewma_decay=0.75, pad_token_id=0)
    centre = 0.0
    for version in range(1, 8):
        teacher.on_weights(version, {n: t.clone() for n, t in model.state_dict().items()})
        centre = 0.75 * centre + 0.25 * version
        assert teacher.version == math.floor(centre)


def test_trajectory_frames_carry_the_teacher_version(tiny_model_dir, tok):
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.transport.codec import decode, encode, trajectory_frames

    gen = set_up_generator(TorchGenerator, tiny_model_dir, run_seed=5, opd=opd(self_weights="current"))
    gen.offer_weights(3, version_state(gen.model, 3))
    gen.apply_pending()
    batch = prompt_tasks(tok, num_samples=1)
    r = gen.generate_sync(batch[:1])[0]
    msg, tensors = trajectory_frames(batch[0], r, "g0", 0.1, num_opd_samples=1)
    got, _ = decode(encode(msg, tensors))
    assert got.teacher_version == msg.teacher_version == 3
    plain, _ = trajectory_frames(batch[0], r, "g0", 0.1)
    assert plain.teacher_version is None


def test_tasks_without_privileged_ids_are_refused(tiny_model_dir, tok):
    from asyncrl.generators.torch_gen import TorchGenerator

    gen = set_up_generator(TorchGenerator, tiny_model_dir, run_seed=5, opd=opd())
    batch = [msgspec.structs.replace(t, privileged_ids=[]) for t in prompt_tasks(tok, num_samples=1)]
    with pytest.raises(ValueError, match=r"came without privileged_ids"):
        gen.generate_sync(batch)
