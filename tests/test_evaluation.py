"""Held-out evaluation with the run's reward (``streamrl.eval.heldout``) and its periodic
callback."""

from __future__ import annotations

import csv
import functools

import lightning as L
import pytest
import torch

from streamrl.errors import ConfigError, RewardError
from streamrl.eval.heldout import evaluate, pass_at_k
from streamrl.eval.periodic import PeriodicEval
from streamrl.policy.models import build_tiny_model, build_tokenizer

MAX_NEW = 6


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    tok = build_tokenizer()
    return build_tiny_model(tok, size="test"), tok


def _rows() -> list[dict]:
    prompts = ["copy 12=", "rev ab=", "copy 345=", "sort 31=", "rev xyz="]
    tasks = ["copy", "rev", "copy", "sort", "rev"]
    return [
        {"prompt_id": f"p{i}", "prompt": p, "answer": "?", "task": t}
        for i, (p, t) in enumerate(zip(prompts, tasks))
    ]


def _length_reward(completions: list[str], rows: list[dict]) -> list[float]:
    assert all("task" in row and "prompt_id" in row for row in rows)  # the whole row arrives
    return [len(c) / 100 for c in completions]


def test_default_reward_is_exact_match(policy):
    model, tok = policy
    rows = _rows()
    greedy = evaluate(model, tok, rows, max_new_tokens=MAX_NEW).completions
    # Rows 0, 1 and 3 get their own greedy completion as the answer: 3 of 5 match exactly.
    for i in (0, 1, 3):
        rows[i]["answer"] = greedy[i]
    result = evaluate(model, tok, rows, max_new_tokens=MAX_NEW)
    assert result.completions == greedy  # greedy decoding is deterministic
    assert result.accuracy == result.reward == result.pass_at_1 == pytest.approx(3 / 5)
    assert result.rewards == [1.0, 1.0, 0.0, 1.0, 0.0]
    # copy: rows 0 (hit), 2 (miss); rev: 1 (hit), 4 (miss); sort: 3 (hit).
    assert result.accuracy_by_task == {"copy": 0.5, "rev": 0.5, "sort": 1.0}
    assert result.by_task["copy"] == {"reward": 0.5, "pass_at_1": 0.5, "n": 2}
    assert result.by_task["sort"] == {"reward": 1.0, "pass_at_1": 1.0, "n": 1}
    assert result.pass_at_k is None and result.k == 1
    assert "completions" not in result.as_dict() and result.as_dict()["reward"] == 0.6


def _prompt_and_length_reward(completions: list[str], rows: list[dict]) -> list[float]:
    return [(len(c) + len(row["prompt"])) / 100 for c, row in zip(completions, rows)]


def test_custom_scorer_is_used_per_data_source(policy):
    model, tok = policy
    result = evaluate(
        model,
        tok,
        _rows(),
        max_new_tokens=MAX_NEW,
        score=_prompt_and_length_reward,
        pass_threshold=0.14,
    )
    # The untrained policy decodes MAX_NEW tokens for every prompt (prompt lengths 8, 7, 9, 8,
    # 8), so the rewards are 0.14, 0.13, 0.15, 0.14, 0.14 and all but row 1 pass at 0.14.
    assert [len(c) for c in result.completions] == [MAX_NEW] * 5
    assert result.rewards == pytest.approx([0.14, 0.13, 0.15, 0.14, 0.14])
    assert result.reward == pytest.approx(0.70 / 5) and result.pass_at_1 == pytest.approx(0.8)
    assert result.accuracy == 0.0  # exact match against "?" is still reported
    expected = {
        "copy": {"reward": 0.145, "pass_at_1": 1.0, "n": 2},  # rows 0 and 2
        "rev": {"reward": 0.135, "pass_at_1": 0.5, "n": 2},  # rows 1 and 4
        "sort": {"reward": 0.14, "pass_at_1": 1.0, "n": 1},  # row 3
    }
    assert result.by_task == {t: pytest.approx(v) for t, v in expected.items()}
    metrics = result.metrics()
    assert metrics["eval/reward"] == result.reward and metrics["eval/pass@1/rev"] == 0.5
    assert metrics["eval/reward/copy"] == pytest.approx(0.145)


def test_pass_at_k_estimator_hand_values():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == 0.25  # pass@1 is the share of passing samples
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3, 2) / C(5, 2)


def test_pass_at_k_samples_are_seeded_and_bound_pass_at_1(policy):
    model, tok = policy
    kwargs = dict(max_new_tokens=MAX_NEW, score=_length_reward, pass_threshold=0.04, k=4)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = evaluate(model, tok, _rows(), temperature=1.0, seed=7, **kwargs)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG is left as it was
    again = evaluate(model, tok, _rows(), temperature=1.0, seed=7, **kwargs)
    other = evaluate(model, tok, _rows(), temperature=1.0, seed=8, **kwargs)
    assert first.samples == again.samples and first.pass_at_k == again.pass_at_k
    assert first.samples != other.samples
    assert len(first.samples) == 5 and all(len(s) == 4 for s in first.samples)
    passed = [[r >= 0.04 for r in rewards] for rewards in first.sample_rewards]
    assert first.pass_at_k == pytest.approx(sum(any(p) for p in passed) / 5)
    assert first.sampled_pass_at_1 == pytest.approx(sum(map(sum, passed)) / 20)
    assert first.pass_at_k >= first.sampled_pass_at_1
    assert first.sampled_reward == pytest.approx(sum(map(sum, first.sample_rewards)) / 20)
    assert first.rewards == [len(c) / 100 for c in first.completions]  # greedy still there
    assert set(first.by_task["rev"]) == {"reward", "pass_at_1", "n", "pass_at_k", "sampled_reward"}
    assert "eval/pass@k" in first.metrics() and "eval/pass@k/copy" in first.metrics()


def test_token_id_prompts_through_encode(policy):
    model, tok = policy
    rows = _rows()
    plain = evaluate(model, tok, rows, max_new_tokens=MAX_NEW)
    # Chat-shaped rows rendered by a custom encode: same ids, so the same completions.
    chat = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    rendered = evaluate(
        model,
        tok,
        chat,
        max_new_tokens=MAX_NEW,
        encode=lambda row: tok(row["prompt"][0]["content"])["input_ids"],
        decode=lambda ids: tok.decode(ids).upper(),
    )
    assert rendered.completions == [c.upper() for c in plain.completions]
    with pytest.raises(ConfigError, match=r"p0.*encode="):
        evaluate(model, tok, chat, max_new_tokens=MAX_NEW)  # no chat template to render it


def test_stop_ids_and_default_budget_without_answers(policy):
    model, tok = policy
    rows = [{**r, "answer": ""} for r in _rows()]
    result = evaluate(model, tok, rows)  # no reference answer: the default budget (64)
    assert 0 <= result.length_max <= 64
    first = tok.convert_tokens_to_ids(result.completions[0][0]) if result.completions[0] else None
    if first is not None:  # stopping at the first generated token leaves that row empty
        stopped = evaluate(model, tok, rows[:1], max_new_tokens=MAX_NEW, eos_token_ids=[first])
        assert stopped.completions == [""]


def test_positional_use_still_works(policy):
    model, tok = policy
    result = evaluate(model, tok, _rows(), 2, MAX_NEW)  # batch_size, max_new_tokens
    assert result.n == 5 and result.length_max <= MAX_NEW


@pytest.mark.parametrize(
    ("score", "match"),
    [
        (lambda c, rows: [0.0] * (len(c) - 1), "4 rewards for 5 greedy.*'p0'"),
        (lambda c, rows: [float("nan") if r["prompt_id"] == "p3" else 0.0 for r in rows], "'p3'"),
        (lambda c, rows: ["1.0"] * len(c), "'1.0' for prompt_id 'p0'"),
    ],
)
def test_bad_scorer_output_names_the_prompt(policy, score, match):
    model, tok = policy
    with pytest.raises(RewardError, match=match):
        evaluate(model, tok, _rows(), max_new_tokens=2, score=score)


class _TinyPolicyModule(L.LightningModule):
    """A BoringModel with a ``policy`` and a ``weight_version``, as ``StreamRLModule`` has."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy, self.weight_version = policy, 0
        self.ids = torch.tensor([[5, 6, 7, 8, 9]])
        self.train_modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.train_modes.append(self.policy.training)
        self.weight_version += 1
        return self.policy(input_ids=self.ids, labels=self.ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(range(4), batch_size=None)


def test_periodic_eval_logs_records_and_plots(tmp_path):
    torch.manual_seed(0)
    tok = build_tokenizer()
    module = _TinyPolicyModule(build_tiny_model(tok, size="test"))
    on_policy = functools.partial(evaluate, tokenizer=tok, dataset=_rows(), max_new_tokens=4, k=2)

    def evaluator(pl_module):  # the module at its version: here its policy, in this process
        return on_policy(pl_module.policy)

    callback = PeriodicEval(evaluator, every=2, output_dir=tmp_path, at_start=True)
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="logs"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module)
    assert [h["iteration"] for h in callback.history] == [0, 2, 4]
    assert module.train_modes == [True] * 4  # evaluation put the policy back in train mode
    first = callback.history[0]
    assert {"eval/reward", "eval/pass@1", "eval/pass@k", "eval/reward/copy"} <= set(first)
    assert (tmp_path / "eval.png").stat().st_size > 0
    with open(next(tmp_path.glob("logs/version_*/metrics.csv"))) as f:
        logged = [r for r in csv.DictReader(f) if r.get("eval/reward")]
    assert [int(r["step"]) for r in logged] == [0, 2, 4]
    restored = PeriodicEval(evaluator, every=2)
    restored.load_state_dict(callback.state_dict())
    assert restored.history == callback.history
    # The run's own evaluation after training joins the history (and the plot) in order.
    restored.record(5, evaluate(module.policy, tok, _rows(), max_new_tokens=4))
    assert [h["iteration"] for h in restored.history] == [0, 2, 4, 5]


def test_periodic_eval_checks_its_arguments():
    with pytest.raises(ConfigError, match="every must be >= 1"):
        PeriodicEval(functools.partial(evaluate, tokenizer=build_tokenizer()), every=0)
