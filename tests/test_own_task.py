"""Your own task end to end: a local dataset with chat-message prompts and extra columns, your
reward module imported by path (run in a reward worker, weighted with a built-in), a byte-level
BPE tokenizer with a chat template trained at run time, and periodic evaluation with the task's
own reward. And each bad input failing before work, naming what was wrong."""

from __future__ import annotations

import contextlib
import csv
import json
import textwrap
from pathlib import Path

import pytest

from streamrl.errors import ConfigError
from streamrl.eval.schedule import EvalSchedule
from streamrl.run.config import RunConfig
from streamrl.run.config_file import from_dict
from streamrl.run.parts import check_parts
from streamrl.run.prepare import prepare_run
from streamrl.runtime.cache_keys import rows_digest

REWARD_MODULE = '''
import json, os

def names_the_unit(completion, row):
    """1 when the completion ends with the row's own unit (a column only this task has)."""
    with open(os.environ["OWN_TASK_REWARD_LOG"], "a") as log:
        log.write(json.dumps({"completion": completion, "columns": sorted(row)}) + "\\n")
    return 1.0 if completion.endswith(row["unit"]) else 0.0
'''


def write_dataset(path: Path, n: int) -> Path:
    """Chat-message prompts, a reference answer under another name, two extra columns."""
    units = ["cm", "kg", "ms"]
    with path.open("w") as f:
        for i in range(n):
            unit = units[i % 3]
            row = {
                "messages": [{"role": "user", "content": f"How far is {i} {unit}? Say it."}],
                "solution": f"{i} {unit}",
                "unit": unit,
                "source": ["geometry", "physics"][i % 2],
            }
            f.write(json.dumps(row) + "\n")
    return path


@contextlib.contextmanager
def patch_dataset(rows: list[dict]):
    """The dataset file holds ``rows`` when it is read inside the block (``own_task`` writes
    its own on every call)."""
    import streamrl.run.prepare

    load = streamrl.run.prepare.load_prompt_dataset

    def edited(file, **kwargs):
        Path(file).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load(file, **kwargs)

    streamrl.run.prepare.load_prompt_dataset = edited
    try:
        yield
    finally:
        streamrl.run.prepare.load_prompt_dataset = load


def own_task(tmp_path: Path, **overrides) -> RunConfig:
    data = {
        "path": str(write_dataset(tmp_path / "units.jsonl", 40)),
        "prompt_column": "messages",
        "answer_column": "solution",
        "task_column": "source",
        "heldout_fraction": 0.2,
        "system_prompt": "Answer with a number and its unit.",
        **overrides.pop("data", {}),
    }
    rl = {
        "iterations": 2,
        "prompts_per_iteration": 4,
        "group_size": 2,
        "generation": {"num_instances": 1},
        "rollouts": {"max_tokens": 16},
        "reward": [
            {"name": "own_rewards:names_the_unit", "weight": 1.0},
            {"name": "exact", "weight": 0.5},
        ],
        "reward_pool": {"workers": 1},
        "eval": {"every": 1},
        **overrides.pop("rl", {}),
    }
    return from_dict(
        RunConfig,
        {
            "output_dir": str(tmp_path / "run"),
            "data": data,
            "sft": {"model_size": "test", "steps": 30},
            "rl": rl,
            **overrides,
        },
        where="test",
    )


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    """The user's reward module, importable here and in spawned reward workers."""
    (tmp_path / "own_rewards.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    log = tmp_path / "reward_log.jsonl"
    monkeypatch.setenv("OWN_TASK_REWARD_LOG", str(log))
    return log


@pytest.mark.timeout(400)
def test_own_dataset_reward_and_chat_format_in_a_real_fit(tmp_path, reward_module):
    from streamrl.run.recipe import run_fit

    config = own_task(tmp_path)
    summary = run_fit(config, show_progress=False)

    assert summary["samples_lost"] == 0
    out = Path(config.output_dir)
    # The reward saw every column of the row, and only the assistant's text.
    calls = [json.loads(line) for line in reward_module.read_text().splitlines()]
    assert calls and all(
        {"prompt_id", "prompt", "answer", "task", "unit"} <= set(c["columns"]) for c in calls
    )
    assert not any("<|im_" in c["completion"] or "assistant" in c["completion"] for c in calls)
    # Each reward logged on its own, next to the weighted total the algorithm trained on.
    rows = list(csv.DictReader(next(out.rglob("metrics.csv")).open()))
    trained = [r for r in rows if r.get("rollout/reward")]
    assert trained and all(r["reward/names_the_unit"] and r["reward/exact"] for r in trained)
    for r in trained:
        total = float(r["reward/names_the_unit"]) + 0.5 * float(r["reward/exact"])
        assert float(r["rollout/reward"]) == pytest.approx(total)
    # Evaluation with the run's reward, per data source, every iteration; logged and plotted.
    assert set(summary["heldout_by_task_after"]) <= {"geometry", "physics"}
    assert 0.0 <= summary["heldout_reward_after"] <= 1.5
    evaluated = sorted({int(r["step"]) for r in rows if r.get("eval/reward")})
    assert evaluated == [1, 2]
    assert (out / "eval.png").stat().st_size > 0


def test_the_tokenizer_is_a_chat_bpe_and_prompts_are_templated(tmp_path, reward_module):
    run = prepare_run(own_task(tmp_path))
    tokenizer = run.tokenizer
    # 3 special and 256 byte tokens, and the merges learned from the 40 rows.
    assert tokenizer.chat_template and len(tokenizer) > 3 + 256
    assert any(len(tokenizer.convert_ids_to_tokens(i)) > 2 for i in range(260, len(tokenizer)))
    from streamrl.policy.chat import render_prompt

    ids = render_prompt(tokenizer, run.train[0]["prompt"], system_prompt="Be brief.")
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert len(run.train) == 32 and len(run.heldout) == 8
    assert not set(run.train["prompt_id"]) & set(run.heldout["prompt_id"])


def test_demo_share_keeps_the_warm_start_rows_apart_from_rl(tmp_path, reward_module):
    from streamrl.run.prepare import ensure_policy

    whole = prepare_run(own_task(tmp_path))
    run = prepare_run(
        own_task(tmp_path, sft={"model_size": "test", "steps": 2, "demo_share": 0.25})
    )
    assert whole.demos is None and len(whole.train) == 32
    # 8 of the 32 training rows teach the warm start; RL gets the other 24; held out unchanged.
    assert len(run.demos) == 8 and len(run.train) == 24
    assert not set(run.demos["prompt_id"]) & set(run.train["prompt_id"])
    assert set(run.demos["prompt_id"]) | set(run.train["prompt_id"]) == set(
        whole.train["prompt_id"]
    )
    assert run.heldout["prompt_id"] == whole.heldout["prompt_id"]
    # The warm start learned from the demo rows (its cached recipe is keyed by them), not RL's.
    config = own_task(tmp_path, sft={"model_size": "test", "steps": 2, "demo_share": 0.25})
    config.cache_dir = str(tmp_path / "cache")
    meta = json.loads(
        (ensure_policy(config, run, show_progress=False) / "sft_meta.json").read_text()
    )
    assert meta["recipe"]["demonstrations"] == rows_digest(run.demos)
    assert meta["recipe"]["demonstrations"] != rows_digest(run.train)


def test_the_warm_start_cache_is_keyed_by_the_rows_contents(tmp_path, reward_module, capsys):
    """Edited rows (same file, same ids) are a new warm start, never the old one reused; the
    same rows reuse it, saying so; sft.cache false trains afresh."""
    from streamrl.run.prepare import ensure_policy

    path = write_dataset(tmp_path / "units.jsonl", 40)
    rows = [{**json.loads(line), "uid": f"u{i}"} for i, line in enumerate(path.open())]
    edited = [{**r, "solution": r["solution"] + " exactly"} for r in rows]  # the same ids

    def warm(data_rows: list[dict], **sft) -> Path:
        config = own_task(
            tmp_path, data={"id_column": "uid"}, sft={"model_size": "test", "steps": 2, **sft}
        )
        config.cache_dir = str(tmp_path / "cache")
        with patch_dataset(data_rows):
            return ensure_policy(config, prepare_run(config), show_progress=False)

    first = warm(rows)
    assert "reusing" not in capsys.readouterr().err
    assert warm(rows) == first
    err = capsys.readouterr().err
    assert f"warm start: reusing {first} (cached for demonstrations " in err
    assert "--no-cache trains it afresh" in err
    stamp = (first / "sft_meta.json").stat().st_mtime_ns
    assert warm(edited) != first
    assert warm(rows, cache=False) == first  # the same recipe, trained again
    assert (first / "sft_meta.json").stat().st_mtime_ns > stamp
    assert "reusing" not in capsys.readouterr().err


@pytest.mark.parametrize("share", [0.0, 1.0, 1.5])
def test_a_demo_share_outside_0_1_fails_before_work(tmp_path, reward_module, share):
    from streamrl.run.config_checks import check_values

    with pytest.raises(ConfigError, match=r"sft\.demo_share"):
        check_values(own_task(tmp_path, sft={"demo_share": share}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"data": {"answer_column": "solutoin"}}, r"solutoin.*did you mean 'solution'"),
        ({"rl": {"prompts_per_iteration": 64}}, r"has 32 rows; one iteration needs 64"),
        ({"data": {"system_prompt": "x " * 400}}, r"needs \d+ prompt tokens \(after the chat"),
    ],
)
def test_bad_data_fails_before_work_naming_it(tmp_path, reward_module, overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepare_run(own_task(tmp_path, **overrides))


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("own_rewardz:names_the_unit", r"cannot import module 'own_rewardz'"),
        ("own_rewards:names_the_units", r"did you mean 'names_the_unit'"),
        ("json:dumps", r"json:dumps has the wrong signature"),
    ],
)
def test_bad_reward_references_fail_before_work(tmp_path, reward_module, reward, message):
    config = own_task(tmp_path, rl={"reward": reward})
    with pytest.raises(ConfigError, match=message):
        check_parts(config.rl)


@pytest.mark.timeout(400)
def test_reasoning_gym_config_runs_at_a_small_size(tmp_path):
    """configs/reasoning_gym.yaml, every stage, on a few rows: the suite's prompts, its verifier as
    the reward (in a reward worker), a character tokenizer learned from the data, the warm start
    on the suite's answers, evaluation per task."""
    from streamrl.run.config_file import load_config
    from streamrl.run.recipe import run_fit

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "reasoning_gym.yaml")
    config.output_dir = str(tmp_path / "run")
    config.data.n_train, config.data.n_heldout, config.sft.steps = 64, 16, 20
    config.rl.iterations, config.rl.prompts_per_iteration = 2, 8
    config.rl.eval = EvalSchedule(every=1)
    summary = run_fit(config, show_progress=False)

    assert summary["samples_lost"] == 0
    assert set(summary["heldout_by_task_after"]) == {"spell_backward", "chain_sum"}
    assert 0.0 <= summary["heldout_reward_after"] <= 1.0
    assert (tmp_path / "run" / "eval.png").stat().st_size > 0


SEARCHED_REWARD = """
import os

def {name}(completion, row):
    with open(os.environ["OWN_TASK_REWARD_LOG"], "a") as log:
        log.write(f"{{__name__}} {{os.getpid()}}\\n")
    return float(completion == row["answer"])
"""

#: What pip writes as the ``streamrl`` console script.
LAUNCHER = """import sys
from streamrl.cli.main import main
if __name__ == "__main__":
    sys.exit(main())
"""


@pytest.mark.timeout(400)
def test_own_modules_in_the_current_and_the_config_directory_in_a_real_fit(tmp_path):
    """The console script (a launcher script elsewhere, as the installed one) finds a reward
    module in the current directory and one beside the config file, in its reward worker too."""
    import os
    import subprocess
    import sys

    import streamrl

    work, conf, bin_dir = tmp_path / "work", tmp_path / "conf", tmp_path / "bin"
    for directory in (work, conf, bin_dir):
        directory.mkdir()
    (work / "cwd_rewards.py").write_text(SEARCHED_REWARD.format(name="cwd_score"))
    (conf / "beside_rewards.py").write_text(SEARCHED_REWARD.format(name="beside_score"))
    (bin_dir / "streamrl").write_text(LAUNCHER)
    (conf / "c.yaml").write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "data: {tasks: [copy], n_train: 16, n_heldout: 4, median_len: 3, max_len: 4}\n"
        "sft: {model_size: test, steps: 2}\n"
        "rl: {iterations: 1, prompts_per_iteration: 2, group_size: 2,"
        " generation: {num_instances: 1},"
        " rollouts: {max_tokens: 6}, reward_pool: {workers: 1},"
        " reward: [{name: cwd_rewards:cwd_score}, {name: beside_rewards:beside_score}]}\n"
    )
    log = tmp_path / "reward_log.txt"
    repo = str(Path(streamrl.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo, "OWN_TASK_REWARD_LOG": str(log)}
    command = [sys.executable, str(bin_dir / "streamrl"), "fit", "--config", "../conf/c.yaml"]
    run = subprocess.Popen(
        [*command, "--no-progress"], cwd=work, env=env, stdout=subprocess.PIPE, text=True
    )
    out, _ = run.communicate(timeout=360)
    assert run.returncode == 0
    assert json.loads(out.splitlines()[-1])["iterations"] == 1
    calls = [line.split() for line in log.read_text().splitlines()]
    # Both modules scored samples in the reward worker (another process than the run's).
    workers = {name for name, pid in calls if int(pid) != run.pid}
    assert workers == {"cwd_rewards", "beside_rewards"}


def test_a_saved_policy_tokenizer_loads_with_autotokenizer_to_the_same_ids(tmp_path):
    """A saved policy's tokenizer, loaded with ``AutoTokenizer`` (which picks ``Qwen2Tokenizer``
    for the Qwen2 architecture and rebuilds its pre-tokenizer) or ``PreTrainedTokenizerFast``,
    gives the ids training used: the own-data char and BPE tokenizers and the built-in tasks'
    alphabet, on text with digits, runs of spaces, new lines and characters the data lacks."""
    import datasets
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from streamrl.policy.models import build_tiny_model, build_tokenizer, save_policy
    from streamrl.run.prepare import data_tokenizer

    rows = [{"prompt": f"reverse: héllo world {i}", "answer": "dlrow olléh"} for i in range(90)]
    own = "reverse: ab cd 1234\nxy  z é→Ω it's"
    for kind in ("char", "bpe"):
        tok = data_tokenizer(datasets.Dataset.from_list(rows), kind=kind, vocab_size=300)
        path = save_policy(build_tiny_model(tok, "test"), tok, tmp_path / kind)
        for loader in (AutoTokenizer, PreTrainedTokenizerFast):
            loaded = loader.from_pretrained(path)
            for text in (own, *rows[0].values()):
                assert loaded(text)["input_ids"] == tok(text)["input_ids"], (kind, loader, text)
                assert loaded.decode(loaded(text)["input_ids"]) == text
    demo = build_tokenizer()
    path = save_policy(build_tiny_model(demo, "test"), demo, tmp_path / "demo")
    text = "rev 12 ab => ba, 3*(4+5)"
    assert AutoTokenizer.from_pretrained(path)(text)["input_ids"] == demo(text)["input_ids"]


@pytest.mark.timeout(400)
def test_the_own_task_example_runs_as_docs_own_task_shows(tmp_path):
    """examples/own_task, as docs/own-task.md runs it, at a small size: its data script, its
    config from the repository root (its reward found beside the config), every stage, nothing
    lost. (What it learns at full size is measured in the docs, not here.)"""
    import os
    import subprocess
    import sys

    import streamrl

    repo = Path(streamrl.__file__).resolve().parents[1]
    data = tmp_path / "reverse.jsonl"
    subprocess.run(
        [sys.executable, "examples/own_task/make_data.py", "--rows", "120", "--out", str(data)],
        cwd=repo,
        check=True,
        timeout=60,
    )
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(rows) == 120 and all(r["solution"] == r["question"][17:][::-1] for r in rows)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "streamrl").write_text(LAUNCHER)
    small = ["--sft.steps", "20", "--sft.model_size", "test", "--rl.iterations", "2"]
    small += [
        "--rl.prompts_per_iteration",
        "8",
        "--rl.group_size",
        "2",
        "--rl.generation.num_instances",
        "1",
    ]
    command = [sys.executable, str(tmp_path / "bin" / "streamrl"), "fit", "--no-progress"]
    command += ["--config", "examples/own_task/config.yaml", "--data.path", str(data), *small]
    command += ["--output_dir", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    run = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.splitlines()[-1])
    assert summary["iterations"] == 2 and summary["samples_lost"] == 0
    assert 0.0 <= summary["heldout_reward_after"] <= 1.0
    assert "Result: held-out reward" in run.stderr
