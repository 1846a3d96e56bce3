"""Several distillation teachers (opd.teachers, generators/teacher_routing.py): each trajectory is
scored by its domain's teacher and carries that teacher's id, unrouted domains are errors, the
gap per teacher and per domain is the hand-computed mean, and the config refuses what cannot
route."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config_sections import OpdConfig, TeacherSpec
from asyncrl.generators.teacher_routing import GapTally, Router, RoutingError
from tests.conftest import set_up_generator
from tests.unit.test_teacher_cache import PROMPTS, task


@pytest.fixture(scope="module")
def teacher_dirs(tmp_path_factory):
    from asyncrl.models.tiny import create_base

    root = tmp_path_factory.mktemp("teachers")
    return [
        create_base(root / f"t{seed}", hidden_size=32, num_layers=1, num_heads=2, seed=seed)
        for seed in (1, 2)
    ]


def two_teachers(dirs, **fields) -> OpdConfig:
    return OpdConfig(
        enabled=True,
        num_samples=2,
        teachers=[
            TeacherSpec(name="add", path=str(dirs[0]), domains=["addition"]),
            TeacherSpec(name="words", path=str(dirs[1]), domains=["word_problems"]),
        ],
        **fields,
    )


def fresh_scores(model_dir, prompt, ids_TN) -> torch.Tensor:
    """log pi_T of each [T, N] id from one unpadded forward of the teacher at `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([list(prompt) + ids_TN[:, 0].tolist()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    rows = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + ids_TN.shape[0]].float(), dim=-1)
    return rows.gather(1, ids_TN)


def test_each_trajectory_is_scored_by_its_domains_teacher(tiny_model_dir, teacher_dirs):
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.transport.codec import trajectory_frames

    gen = set_up_generator(TorchGenerator, tiny_model_dir, run_seed=5, opd=two_teachers(teacher_dirs))
    batch = [
        task(0, PROMPTS[0], domain="addition"),
        task(1, PROMPTS[1], domain="word_problems"),
        task(2, PROMPTS[1], domain="addition"),
    ]
    rollouts = gen.generate_sync(batch)
    owner = {
        "addition": ("add", teacher_dirs[0], teacher_dirs[1]),
        "word_problems": ("words", *teacher_dirs[::-1]),
    }
    by_task = {t.task_id: t for t in batch}
    for r in rollouts:
        t = by_task[r.task_id]
        name, own, other = owner[t.extras["domain"]]
        assert r.teacher_id == name
        ids_TN = torch.tensor(r.opd_ids)
        scores = torch.tensor(r.teacher_logprobs)
        torch.testing.assert_close(scores, fresh_scores(own, t.prompt_ids, ids_TN), atol=1e-5, rtol=0)
        assert (scores - fresh_scores(other, t.prompt_ids, ids_TN)).abs().max() > 1e-3
        msg, _ = trajectory_frames(t, r, "g0", 0.0, num_opd_samples=2)
        assert msg.teacher_id == name
    # The gap per teacher and domain: mean of log mu - log pi_T at the sampled tokens.
    metrics = gen.opd_metrics()
    for domain, name in (("addition", "add"), ("word_problems", "words")):
        mine = [r for r in rollouts if by_task[r.task_id].extras["domain"] == domain]
        gap = sum(
            float(b[0]) - float(s[0])
            for r in mine
            for b, s in zip(r.opd_behavior_logprobs, r.teacher_logprobs, strict=True)
        )
        tokens = sum(len(r.completion_ids) for r in mine)
        assert metrics[f"opd/kl_tokens/domain/{domain}"] == tokens
        assert metrics[f"opd/kl/domain/{domain}"] == pytest.approx(gap / tokens, abs=1e-6)
        assert metrics[f"opd/kl/teacher/{name}"] == pytest.approx(gap / tokens, abs=1e-6)
    assert "opd/kl/domain/addition" not in gen.opd_metrics()  # taken: since the last report


def test_an_unrouted_domain_is_an_error_naming_it(tiny_model_dir, teacher_dirs):
    from asyncrl.generators.torch_gen import TorchGenerator

    gen = set_up_generator(TorchGenerator, tiny_model_dir, run_seed=5, opd=two_teachers(teacher_dirs))
    with pytest.raises(RoutingError, match=r"domain 'poetry'.*opd.route_field = 'domain'"):
        gen.generate_sync([task(0, PROMPTS[0], domain="poetry")])


def test_router_fallback_and_field():
    opd = OpdConfig(
        enabled=True,
        route_field="kind",
        teachers=[TeacherSpec(name="a", domains=["x", "y"]), TeacherSpec(name="rest")],
    )
    router = Router.from_config(opd)
    assert router.teacher_for(task(0, [1], kind="x")) == "a"
    assert router.teacher_for(task(0, [1], kind="y")) == "a"
    assert router.teacher_for(task(0, [1], kind="z")) == "rest"
    assert router.teacher_for(task(0, [1], domain="x")) == "rest"  # the field is `kind`
    alone = Router.from_config(OpdConfig(enabled=True, teachers=[TeacherSpec(name="a", domains=["x"])]))
    with pytest.raises(RoutingError, match="no field 'domain'"):
        alone.teacher_for(task(0, [1]))


def test_gap_tally_by_hand():
    tally = GapTally()
    tally.add(["teacher/a", "domain/x"], torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
    tally.add(["teacher/a", "domain/y"], torch.tensor([-0.25]), torch.tensor([-1.0]))
    out = tally.take()
    assert out["opd/kl/teacher/a"] == pytest.approx((0.5 - 1.0 + 0.75) / 3)
    assert out["opd/kl/domain/x"] == pytest.approx(-0.25)
    assert out["opd/kl/domain/y"] == pytest.approx(0.75)
    assert out["opd/kl_tokens/teacher/a"] == 3
    assert tally.take() == {}


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"teachers": [TeacherSpec(name="a")]}, r"opd\.teachers needs opd\.enabled"),
        (
            {"enabled": True, "teacher": "x", "teachers": [TeacherSpec(name="a")]},
            r"opd\.teacher and opd\.teachers",
        ),
        ({"enabled": True, "teachers": [TeacherSpec(name="a/b")]}, r"name 'a/b'"),
        (
            {"enabled": True, "teachers": [TeacherSpec(name="a", domains=["x"]), TeacherSpec(name="a")]},
            r"'a' is given twice",
        ),
        (
            {
                "enabled": True,
                "teachers": [TeacherSpec(name="a", domains=["x"]), TeacherSpec(name="b", domains=["x"])],
            },
            r"domain 'x' is routed to both 'a' and 'b'",
        ),
        (
            {"enabled": True, "teachers": [TeacherSpec(name="a"), TeacherSpec(name="b")]},
            r"both have no domains",
        ),
        (
            {
                "enabled": True,
                "teachers": [
                    TeacherSpec(name="a", path="self", domains=["x"]),
                    TeacherSpec(name="b", path="self"),
                ],
            },
            r"'self' is the path of one teacher at most",
        ),
        ({"enabled": True, "route_field": "kind"}, r"opd\.route_field routes between opd\.teachers"),
    ],
)
def test_config_refuses(fields, match):
    with pytest.raises(ValueError, match=match):
        OpdConfig(**fields)


def test_teacher_paths_in_a_file_are_relative_to_it(tmp_path):
    from asyncrl.config_load import load_config

    (tmp_path / "job.toml").write_text(
        '[opd]\nenabled = true\nteachers = [{ name = "a", path = "teachers/a", domains = ["x"] }, '
        '{ name = "b", path = "self" }, { name = "c", path = "/abs/c", domains = ["y"] }]\n'
    )
    paths = [t.path for t in load_config(tmp_path / "job.toml").opd.teachers]
    assert paths == [str(tmp_path / "teachers" / "a"), "self", "/abs/c"]


def test_shared_teacher_processes_and_their_addresses():
    from asyncrl.messages import join_endpoints, service_teachers, split_endpoints

    one = OpdConfig(enabled=True, placement="service")
    assert service_teachers(one, peer="opd-teacher") == {"opd-teacher": ""}
    assert service_teachers(OpdConfig(enabled=True), peer="opd-teacher") == {}
    several = OpdConfig(
        enabled=True,
        placement="service",
        teachers=[TeacherSpec(name="a", domains=["x"]), TeacherSpec(name="me", path="self")],
    )
    assert service_teachers(several, peer="opd-teacher") == {
        "opd-teacher-a": "a"
    }  # "self" scores in the generator
    assert join_endpoints({"": "tcp://h:1"}) == "tcp://h:1"
    joined = join_endpoints({"b": "tcp://h:2", "a": "tcp://h:1"})
    assert joined == "a=tcp://h:1;b=tcp://h:2"
    assert split_endpoints(joined) == {"a": "tcp://h:1", "b": "tcp://h:2"}
    with pytest.raises(ValueError, match="not name=address"):
        split_endpoints("tcp://h:1")
    with pytest.raises(ValueError, match="only 'self'"):
        OpdConfig(enabled=True, placement="service", teachers=[TeacherSpec(name="me", path="self")])


def test_gap_keys_with_one_teacher_and_several():
    from asyncrl.generators.teacher_routing import gap_keys

    one = Router.from_config(OpdConfig(enabled=True))
    assert gap_keys(one, task(0, [1], domain="x"), "") == ["domain/x"]  # one teacher: by domain when known
    assert gap_keys(one, task(0, [1]), "") == []
    several = Router.from_config(OpdConfig(enabled=True, teachers=[TeacherSpec(name="a")]))
    assert gap_keys(several, task(0, [1]), "a") == ["teacher/a", "domain/-"]
