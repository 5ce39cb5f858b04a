"""``streamrl fit`` with ``env:``: a built-in tool task and a user's own environment train end to
end on episodes, with nothing lost; bad ``env`` settings fail before any work."""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml
from extension_plugins import GuessEnv

from streamrl.cli.main import main

RL = {
    "iterations": 2,
    "prompts_per_iteration": 4,
    "group_size": 2,
    "generation": {"num_instances": 1, "max_batch_size": 8},
    "rollouts": {"max_tokens": 24},
}


def fit(tmp_path, capsys, env: dict, **sections) -> tuple[int, dict | str]:
    config = tmp_path / "run.yaml"
    body = {
        "output_dir": str(tmp_path / "out"),
        "env": env,
        "sft": {"model_size": "test", "steps": 10, "tokens_per_batch": 1024},
        "rl": {**RL, "eval": {"every": 1}},
        **sections,
    }
    config.write_text(yaml.safe_dump(body))
    code = main(["fit", "--config", str(config), "--no-progress"])
    out, err = capsys.readouterr()
    return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else err)


def test_the_calculator_trains_on_episodes_and_loses_none(tmp_path, capsys):
    code, summary = fit(
        tmp_path, capsys, {"name": "calculator", "max_turns": 3, "n_train": 64, "n_heldout": 8}
    )
    assert code == 0, summary
    assert summary["samples_trained"] == summary["samples_generated"] == 16
    assert summary["samples_lost"] == 0
    counts = summary["episode_counts"]
    assert counts["episodes_started"] == counts["episodes_finished"] == 16
    assert summary["turns"] >= 16 and 0.0 <= summary["heldout_success_after"] <= 1.0
    assert (tmp_path / "out" / "eval.png").is_file()
    assert (tmp_path / "out" / "policy" / "config.json").is_file()


def test_your_own_environment_from_your_data(tmp_path, capsys):
    rows = tmp_path / "words.jsonl"
    words = ["apple", "river", "stone", "cloud", "green", "light"] * 4
    rows.write_text("".join(json.dumps({"prompt": w[:2], "answer": w}) + "\n" for w in words))
    log = tmp_path / "closed.txt"
    env = {
        "name": "extension_plugins:GuessEnv",
        "options": {"log": str(log)},
        "demonstrations": "extension_plugins:guess_demonstration",
        "max_turns": 3,
    }
    code, summary = fit(tmp_path, capsys, env, data={"path": str(rows), "heldout_fraction": 0.25})
    assert code == 0, summary
    assert summary["samples_lost"] == 0 and summary["samples_trained"] == 16
    assert summary["episode_counts"]["episodes_finished"] == 16
    # Every episode closed its environment: training's 16, and each held-out row twice.
    assert log.read_text().count("closed") >= 16 + 2 * 6


class HintEnv(GuessEnv):
    """``GuessEnv`` on rows without a prompt column (``reset`` reads the row's ``hint``); the
    rows marked ``hang`` hang in each step of the run's episodes (the runner's threads; the
    warm start's demonstrations step on the main thread): the environment's fault."""

    def reset(self, row):
        self.word, self.hang = row["answer"], row["hang"]
        return f"Guess the word. Hint: {row['hint']}"

    def step(self, action: str):
        if self.hang and threading.current_thread().name == "streamrl-env":
            time.sleep(5)
        return super().step(action)


def test_rows_without_prompts_and_the_environments_faults_left_out(tmp_path, capsys):
    """Rows with no prompt column train (``reset`` gives the first prompt); the episodes the
    environment cut (``env_timeout``) are not trained but counted, and none is lost."""
    rows = tmp_path / "hints.jsonl"
    words = ["apple", "river", "stone", "cloud", "green", "light"] * 4
    lines = [{"hint": w[:2], "answer": w, "hang": w in ("river", "stone")} for w in words]
    rows.write_text("".join(json.dumps(row) + "\n" for row in lines))
    env = {
        "name": "test_episode_fit:HintEnv",
        "demonstrations": "extension_plugins:guess_demonstration",
        "max_turns": 3,
        "timeout_s": 0.3,
    }
    code, summary = fit(tmp_path, capsys, env, data={"path": str(rows), "heldout_fraction": 0.25})
    assert code == 0, summary
    faults = summary["samples_env_fault"]
    assert faults > 0 and faults == summary["episode_counts"]["episodes_env_timeout"]
    assert summary["samples_lost"] == 0
    trained, filtered = summary["samples_trained"], summary["samples_filtered"]
    assert trained + filtered + faults == summary["samples_requested"] > 16


@pytest.mark.parametrize(
    "env, sections, message",
    [
        ({"name": "calculater"}, {}, "did you mean 'calculator'"),
        ({"name": "calculator", "options": {"speed": 2}}, {}, "takes no option"),
        ({"name": "extension_plugins:GuessEnv"}, {}, "set data.path"),
        ({"name": "calculator", "n_train": 2}, {}, "rows"),
        ({"name": "calculator"}, {"rl": {**RL, "reward": "math"}}, "rl.reward: 'math' would go"),
    ],
)
def test_bad_env_settings_fail_before_work(tmp_path, capsys, env, sections, message):
    code, err = fit(tmp_path, capsys, env, **sections)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out" / "summary.json").exists()
