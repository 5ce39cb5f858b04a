"""``streamrl fit``'s config edge (jsonargparse): files, dotted overrides, ``--print_config``,
and our own key, type and value checks. No training: ``run_fit`` checks the values and the
resume point, then a recorder stands in for the run (``fit_checked``)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

import streamrl
import streamrl.runtime.references
from streamrl.cli.main import build_parser, main
from streamrl.errors import ConfigError
from streamrl.run.config import RunConfig
from streamrl.run.config_file import load_config
from streamrl.run.parts import check_parts

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


@pytest.fixture
def fit(monkeypatch):
    """Run ``streamrl fit ARGS`` in this process; returns (exit code, the recorded calls)."""
    import streamrl.run.recipe

    calls: list[dict] = []

    def record(config, resume, show_progress, stages):
        calls.append(dict(config=config, show_progress=show_progress, resume=resume))
        return {}

    monkeypatch.setattr(streamrl.run.recipe, "fit_checked", record)  # run_fit's checks run
    # Where `module:Name` imports from (the console script adds to it): this test's own.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(streamrl.runtime.references, "_SEARCH_DIRS", [], raising=False)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))

    def run(*args: str) -> tuple[int, list[dict]]:
        return main(["fit", *args]), calls

    return run


def fitted(fit, *args: str) -> RunConfig:
    """The config ``run_fit`` received for ``streamrl fit ARGS``."""
    code, calls = fit(*args)
    assert code == 0 and len(calls) == 1  # tests pop what they read
    return calls.pop()["config"]


def test_no_config_file_runs_the_defaults(fit, capsys):
    code, calls = fit()
    assert code == 0 and calls[0]["config"] == RunConfig()
    assert calls[0]["show_progress"] and calls[0]["resume"] is None
    assert capsys.readouterr().out.strip() == "{}"  # the summary JSON line, as before


def test_dotted_overrides_reach_the_config(fit):
    config = fitted(
        fit,
        "--rl.module.lr",
        "3e-5",
        "--data.tasks",
        "[copy, rev]",
        "--rl.dispatcher",
        "round_robin",
        "--rl.algorithm",
        "{class_path: grpo, init_args: {clip_eps_high: 0.28}}",
        "--rl.length_predictor",
        "null",
        "--seed",
        "3",
        "--rl.elastic",
        "{class_path: controller, init_args: {max_instances: 3}}",
    )
    assert config.rl.module == {"lr": 3e-5} and isinstance(config.rl.module["lr"], float)
    assert config.data.tasks == ["copy", "rev"]
    # Each swappable part is held as LightningCLI's class_path + init_args, the full path.
    assert config.rl.dispatcher == {
        "class_path": "streamrl.components.skewness.dispatch.RoundRobinDispatcher",
        "init_args": {},
    }
    assert config.rl.algorithm == {
        "class_path": "streamrl.algorithms.grpo.GRPO",
        "init_args": {"clip_eps_high": 0.28},
    }
    assert config.rl.length_predictor is None
    assert config.seed == 3 and config.rl.elastic == {
        "class_path": "streamrl.components.capacity.elastic.ElasticController",
        "init_args": {"max_instances": 3},
    }
    # Everything not overridden keeps its default.
    expected = RunConfig(seed=3)
    expected.data.tasks = ["copy", "rev"]
    expected.rl = dataclasses.replace(
        expected.rl,
        module={"lr": 3e-5},
        dispatcher="round_robin",
        algorithm={"class_path": "grpo", "init_args": {"clip_eps_high": 0.28}},
        length_predictor=None,
        elastic={"class_path": "controller", "init_args": {"max_instances": 3}},
    )
    assert config == expected


def test_a_group_takes_a_yaml_mapping_and_a_list_appends(fit):
    config = fitted(fit, "--rl", "{module: {lr: 2.0e-5}, group_size: 4}", "--data.tasks+", "copy")
    assert config.rl.module == {"lr": 2e-5} and config.rl.group_size == 4
    assert config.data.tasks == [*RunConfig().data.tasks, "copy"]


def test_run_options_and_the_old_aliases(fit, tmp_path):
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"")
    out = str(tmp_path / "out")
    code, calls = fit("--output-dir", out, "--gpus=0", "--no-progress", "--resume", str(ckpt))
    assert code == 0
    assert calls[0]["config"].output_dir == out and calls[0]["config"].rl.generation == {
        "gpus_per_instance": 0
    }
    assert calls[0]["show_progress"] is False and calls.pop()["resume"] == str(ckpt)
    # The aliases are plain aliases: what comes later wins either way.
    assert fitted(fit, "--output-dir", "a", "--output_dir", "b").output_dir == "b"
    assert fitted(fit, "--output_dir", "a", "--output-dir", "b").output_dir == "b"


def test_later_config_file_wins_and_the_command_line_in_its_place(fit, tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(
        "seed: 1\nrl: {module: {lr: 1.0e-5, mode: async}, iterations: 7}\ndata: {n_train: 100}\n"
    )
    second.write_text("seed: 2\nrl: {module: {lr: 2.0e-5}}\n")
    config = fitted(fit, "--config", str(first), "--config", str(second))
    assert config.seed == 2 and config.rl.module["lr"] == 2e-5  # the later file wins
    assert config.rl.iterations == 7 and config.data.n_train == 100  # merged, not replaced
    config = fitted(fit, "--config", str(second), "--config", str(first))
    assert config.seed == 1 and config.rl.module == {"lr": 1e-5, "mode": "async"}
    # The command line after a file wins over it; a file after an option wins over that.
    config = fitted(fit, "--config", str(first), "--rl.module.lr", "3e-5", "--seed", "5")
    assert config.rl.module["lr"] == 3e-5 and config.seed == 5 and config.rl.iterations == 7
    assert config.rl.module["mode"] == "async"  # one key of a section, the others kept
    assert fitted(fit, "--seed", "5", "--config", str(first)).seed == 1


def test_print_config_writes_the_defaults_that_load_back(fit, tmp_path, capsys):
    code, calls = fit("--print_config")
    assert code == 0 and not calls  # nothing ran
    text = capsys.readouterr().out
    assert text.startswith("model: tiny\n") and "{" not in text.splitlines()[-1]  # no JSON line
    path = tmp_path / "my.yaml"
    path.write_text(text)
    assert load_config(path) == RunConfig()
    # Every field is written out, None included.
    assert "cache_dir: null" in text and "prompt_file: null" in text
    # The written file runs the same job as no file.
    assert fitted(fit, "--config", str(path)) == RunConfig()


def test_print_config_resolves_files_and_overrides(fit, tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text(
        "rl: {iterations: 5, dispatcher: {class_path: skew, init_args: {objective: sum}}}\n"
    )
    argv = ["--config", str(base), "--rl.module.lr", "3e-5", "--rl.length_predictor", "null"]
    code, calls = fit(*argv, "--print_config")
    assert code == 0 and not calls
    path = tmp_path / "resolved.yaml"
    path.write_text(text := capsys.readouterr().out)
    resolved = load_config(path)
    assert resolved == fitted(fit, *argv)
    assert resolved.rl.module == {"lr": 3e-5} and resolved.rl.iterations == 5
    assert resolved.rl.dispatcher == {
        "class_path": "streamrl.components.skewness.skew_dispatch.SkewAwareDispatcher",
        "init_args": {"objective": "sum"},
    }
    # Written out as LightningCLI writes a class: its full import path and its arguments.
    assert "dispatcher:\n    class_path: streamrl.components.skewness.skew_dispatch." in text
    assert resolved.rl.length_predictor is None


def test_shipped_demo_config_is_the_defaults_written_out(fit, tmp_path, capsys):
    assert fit("--print_config")[0] == 0
    printed = tmp_path / "defaults.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load_config(DEMO) == load_config(printed) == RunConfig()
    assert fitted(fit, "--config", str(DEMO)) == RunConfig()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("rl:\n  iteratons: 3\n", "rl: Unknown key 'iteratons' (did you mean 'iterations'?)"),
        ("seeed: 3\n", "Unknown key 'seeed' (did you mean 'seed'?)"),
        ("data: {tasks: [copy], n_trian: 3}\n", "Unknown key 'n_trian' (did you mean 'n_train'?)"),
    ],
)
def test_unknown_key_in_a_file_exits_2_naming_it(fit, tmp_path, capsys, content, message):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    code, calls = fit("--config", str(path))
    assert code == 2 and not calls
    err = capsys.readouterr().err
    assert err.startswith("streamrl fit: error: ") and message in err and str(path) in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--rl.iteratons", "3"],
            "Unknown option '--rl.iteratons' (did you mean '--rl.iterations'?)",
        ),
        (["--seeed", "3"], "Unknown option '--seeed' (did you mean '--seed'?)"),
        (["--rll.lr", "3"], "Unknown option '--rll.lr' (did you mean '--rl'?)"),
        (["--no_progress"], "Unknown option '--no_progress' (did you mean '--no-progress'?)"),
        (["--rl.module.lr=1e-5", "--data.task=[copy]"], "'--data.task' (did you mean '--data.tas"),
        (["--rl", "{iteration: 3}"], "--rl: Unknown key 'iteration' (did you mean 'iterations'?)"),
        (["--rl.module.lrr", "1e-5"], "StreamRLModule takes no option(s) ['lrr'] (did you mean"),
        (["--rl.lr", "1e-5"], "--rl.lr has moved: set rl.module: {lr: ...}"),
        (["--config", "{sed: 1}"], "Unknown key 'sed' (did you mean 'seed'?)"),
    ],
)
def test_unknown_key_on_the_command_line_exits_2_naming_it(fit, capsys, args, message):
    code, calls = fit(*args)
    assert code == 2 and not calls
    err = capsys.readouterr().err
    assert err.startswith("streamrl fit: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "content", "message"),
    [
        (["--rl.iterations", "abc"], None, "\"rl.iterations\": Expected a <class 'int'>. Got"),
        (["--data.n_train", "1.5"], None, "data.n_train"),
        (["--data.tasks", "copy"], None, "data.tasks"),
        (["--rl.elastic", "3"], None, "rl: elastic must be a str or dict, got 3."),
        (["--rl.elastic", "true"], None, "elastic: true has become {class_path: controller"),
        ([], "rl:\n  iterations: abc\n", "rl.iterations"),
        ([], "rl: 3\n", "rl must be a mapping of keys to values, got 3."),
    ],
)
def test_wrong_type_exits_2(fit, tmp_path, capsys, args, content, message):
    if content is not None:
        path = tmp_path / "c.yaml"
        path.write_text(content)
        args = ["--config", str(path), *args]
    code, calls = fit(*args)
    assert code == 2 and not calls
    err = capsys.readouterr().err
    assert err.startswith("streamrl fit: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_values_are_checked_by_our_checks(fit, capsys):
    code, calls = fit("--rl.module.mode", "asnyc")
    assert code == 2 and not calls
    assert "Unknown mode 'asnyc' (did you mean 'async'?)" in capsys.readouterr().err
    code, calls = fit("--rl.module.lr", "abc")  # a section's types: its constructor's hints
    assert code == 2 and not calls
    assert "rl.module.lr must be a float, got 'abc'" in capsys.readouterr().err
    code, calls = fit("--data.tasks", "[copy, cnt]")
    assert code == 2 and "Unknown task 'cnt' (did you mean 'count'?)" in capsys.readouterr().err


def test_bad_files_and_checkpoints_exit_2(fit, tmp_path, capsys):
    assert fit("--config", str(tmp_path / "nope.yaml"))[0] == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert fit("--config", str(empty))[0] == 2
    assert "is empty" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("rl: [\n")
    assert fit("--config", str(broken))[0] == 2
    assert "broken.yaml" in capsys.readouterr().err
    code, calls = fit("--resume", str(tmp_path / "nope.ckpt"))
    assert code == 2 and not calls
    assert "--resume: no checkpoint at" in capsys.readouterr().err


def test_a_binary_file_a_pipe_and_a_key_given_twice_get_one_line_errors(fit, tmp_path, capsys):
    """What a new user hits: each a one-line error before any work, naming the fix."""
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    code, calls = fit("--config", str(binary))
    err = capsys.readouterr().err
    assert code == 2 and not calls and "is not a text file" in err and "Traceback" not in err
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # what <(...) gives
    code, calls = fit("--config", str(pipe))
    err = capsys.readouterr().err
    assert code == 2 and not calls
    assert "is not a regular file (a pipe" in err and "write it to a file" in err
    twice = tmp_path / "twice.yaml"
    twice.write_text("rl:\n  iterations: 3\nseed: 1\nrl:\n  group_size: 4\n")
    code, calls = fit("--config", str(twice))
    err = capsys.readouterr().err
    assert code == 2 and not calls
    assert "key 'rl' is given twice (first on line 1)" in err and "merge them" in err
    code, calls = fit("--rl", "{iterations: 2, iterations: 3}")
    assert code == 2 and "key 'iterations' is given twice" in capsys.readouterr().err


def test_an_output_dir_nothing_can_be_written_in_is_refused_before_any_work(fit, capsys):
    code, calls = fit("--output_dir", "/proc/streamrl-run")
    err = capsys.readouterr().err
    assert code == 2 and not calls
    assert "output_dir '/proc/streamrl-run': nothing can be written in '/proc'" in err


def test_a_model_directory_without_weights_is_refused_before_any_work(fit, tmp_path, capsys):
    from transformers import Qwen2Config

    only_config = tmp_path / "model"
    Qwen2Config(num_hidden_layers=1, hidden_size=32).save_pretrained(only_config)
    code, calls = fit("--model", str(only_config))
    err = capsys.readouterr().err
    assert code == 2 and not calls and "has a config.json but no weights" in err
    not_a_config = tmp_path / "other"
    not_a_config.mkdir()
    (not_a_config / "config.json").write_text("{}")
    code, calls = fit("--model", str(not_a_config))
    err = capsys.readouterr().err
    assert code == 2 and not calls and "transformers cannot read its config.json" in err
    code, calls = fit("--model", str(tmp_path / "nowhere"))
    assert code == 2 and "is not a directory" in capsys.readouterr().err
    (only_config / "model.safetensors").write_bytes(b"")  # its weights: the check passes
    fit("--model", str(only_config))
    assert "model:" not in capsys.readouterr().err


def test_a_built_in_reward_whose_package_is_missing_is_refused_before_any_work(
    fit, monkeypatch, capsys
):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "math_verify" else find(name, *a),
    )
    code, calls = fit("--rl.reward", "math")
    err = capsys.readouterr().err
    assert code == 2 and not calls
    assert "rl.reward: 'math' needs the 'math_verify' package" in err and "pip install" in err


def test_load_config_refuses_the_same_files(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("rl:\n  iterations: 3\nrl:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match="key 'rl' is given twice"):
        load_config(twice)
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00rl")
    with pytest.raises(ConfigError, match="is not a text file"):
        load_config(binary)


def test_fit_help_shows_the_dotted_options(capsys):
    for argv in (["fit", "--help"], ["fit", "-h"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "--rl.module" in out and "--print_config" in out and "--data.tasks" in out
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["fit", "--help"])  # the argparse entry shows the same help
    assert exit_info.value.code == 0 and "--rl.module" in capsys.readouterr().out


def test_print_config_comments_describes_each_setting_and_loads_back(fit, tmp_path, capsys):
    code, calls = fit("--print_config=comments")
    assert code == 0 and not calls
    text = capsys.readouterr().out
    lines = text.splitlines()
    # Each setting's description from its docstring, as a comment right above it.
    assert lines[lines.index("seed: 0") - 1] == "# seeds data, initialisation and sampling."
    assert "  # the trainer's LightningModule, StreamRLModule's arguments" in text
    assert max(len(line) for line in lines) <= 100
    path = tmp_path / "commented.yaml"
    path.write_text(text)
    assert load_config(path) == RunConfig()
    code, _ = fit("--rl.module.lr", "3e-5", "--print_config=comments,skip_null")
    text = capsys.readouterr().out
    assert code == 0 and "cache_dir" not in text and "  module: {lr: 3.0e-05}" in text.splitlines()
    assert not [line for line in text.splitlines() if line.endswith(": null")]
    code, calls = fit("--print_config=coments")
    err = capsys.readouterr().err
    assert code == 2 and not calls and len(err.strip().splitlines()) == 1
    assert "Unknown flag 'coments' (did you mean 'comments'?)" in err
    assert "--print_config=comments,skip_null" in err


@pytest.mark.parametrize("argv", [["--version"], ["fit", "--version"]])
def test_version_prints_the_package_version(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"streamrl {streamrl.__version__}"


def test_lightning_trainer_arguments_map_to_the_runs_settings(fit, tmp_path):
    config = fitted(
        fit,
        "--trainer.max_steps",
        "7",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--trainer.precision",
        "32-true",
        "--trainer.num_nodes",
        "1",
    )
    assert config.rl.iterations == 7 and config.output_dir == str(tmp_path / "run")
    assert (config.trainer.accelerator, config.trainer.devices) == ("cpu", 1)
    assert (config.trainer.precision, config.trainer.num_nodes) == ("32-true", 1)


@pytest.mark.parametrize(
    ("args", "content", "message"),
    [
        (
            ["--trainer.max_epochs", "3"],
            None,
            "--trainer.max_epochs is a Lightning Trainer argument that streamrl fit does not "
            "take; set rl.iterations",
        ),
        (["--trainer.log_every_n_steps=5"], None, "every iteration is logged"),
        (["--trainer", "{strategy: ddp}"], None, "strategy is a Lightning Trainer argument"),
        ([], "trainer:\n  max_steps: 4\n", "trainer: max_steps is a Lightning Trainer argument"),
        ([], "trainer: {gradient_clip_val: 0.5}\n", "set rl.module.max_grad_norm (gradients are"),
    ],
)
def test_other_lightning_trainer_arguments_name_the_setting_to_use(
    fit, tmp_path, capsys, args, content, message
):
    if content is not None:
        path = tmp_path / "c.yaml"
        path.write_text(content)
        args = ["--config", str(path), *args]
    code, calls = fit(*args)
    err = capsys.readouterr().err
    assert code == 2 and not calls and message in err
    assert len(err.strip().splitlines()) == 1


def test_zero_iterations_are_refused_naming_the_fix(fit, capsys):
    code, calls = fit("--rl.iterations", "0")
    err = capsys.readouterr().err
    assert code == 2 and not calls and len(err.strip().splitlines()) == 1
    assert "rl.iterations must be >= 1" in err and "set rl.iterations: 1 or more" in err


REWARD = "def score(completion, row):\n    return float(len(completion) % 2)\n"


def test_own_module_beside_the_config_file_resolves(fit, tmp_path, monkeypatch):
    conf, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    conf.mkdir()
    elsewhere.mkdir()
    (conf / "beside_config_rewards.py").write_text(REWARD)
    (conf / "c.yaml").write_text("rl: {reward: beside_config_rewards:score}\n")
    monkeypatch.chdir(elsewhere)  # neither the current directory nor on sys.path
    config = fitted(fit, "--config", "../conf/c.yaml")
    monkeypatch.delitem(sys.modules, "beside_config_rewards", raising=False)
    check_parts(config.rl)  # resolves it, as the run does before any work
    assert sys.modules["beside_config_rewards"].__file__ == str(conf / "beside_config_rewards.py")
    assert os.environ["PYTHONPATH"].split(os.pathsep)[-2:] == [str(elsewhere), str(conf)]


def test_a_module_found_nowhere_names_the_directories_searched(fit, tmp_path, monkeypatch):
    conf, elsewhere = tmp_path / "conf", tmp_path / "elsewhere"
    conf.mkdir()
    elsewhere.mkdir()
    (conf / "c.yaml").write_text("rl: {reward: nowhere_rewards:score}\n")
    monkeypatch.chdir(elsewhere)
    config = fitted(fit, "--config", str(conf / "c.yaml"))
    with pytest.raises(ConfigError) as error:
        check_parts(config.rl)
    message = str(error.value)
    assert message.startswith("rl.reward: cannot import module 'nowhere_rewards'")
    assert f"Searched the installed packages, then {elsewhere}, {conf};" in message
    assert "put nowhere_rewards.py (or the package nowhere_rewards/) in one of" in message


def test_more_cpu_trainer_ranks_than_cores_gets_a_note(fit, monkeypatch, capsys):
    import streamrl.run.config_checks as checks

    monkeypatch.setattr(checks, "usable_cores", lambda: 2)
    fit("--trainer.devices", "3")
    err = capsys.readouterr().err
    assert "warning: trainer.devices asks for 3 CPU trainer ranks on 2 core(s)" in err
    fit("--trainer.devices", "2")
    assert "warning: trainer.devices" not in capsys.readouterr().err


def test_a_config_of_the_old_layout_is_refused_in_one_line_and_migrates(fit, tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text(
        "seed: 3\nrl:\n  engine: {name: hf}\n  dispatcher: {name: skew, alpha: 0.3}\n"
        "  trainer_ranks: 2\n"
    )
    code, calls = fit("--config", str(old))
    assert code == 2 and not calls
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "trainer_ranks has moved: set trainer.devices" in err
    old.write_text(old.read_text().replace("  trainer_ranks: 2\n", ""))
    code, calls = fit("--config", str(old))
    assert code == 2 and not calls
    err = capsys.readouterr().err.strip()
    assert err.startswith("streamrl fit: error: rl.engine: {name: ...} has become {class_path, ")
    assert "write hf (streamrl config migrate" in err  # no arguments: the name alone
    old.write_text(old.read_text().replace("  engine: {name: hf}\n", "  engine: hf\n"))
    code, calls = fit("--config", str(old))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "streamrl fit: error: rl.dispatcher: {name: ...} has become {class_path, init_args}: "
        "write {class_path: skew, init_args: {alpha: 0.3}} (streamrl config migrate OLD.yaml "
        "rewrites a file)."
    )

    old.write_text(old.read_text() + "  token_budget: 512\n")
    assert main(["config", "migrate", str(old)]) == 0
    migrated = tmp_path / "old.migrated.yaml"
    assert "{'written': " not in capsys.readouterr().out
    by_hand = tmp_path / "new.yaml"
    by_hand.write_text(
        "seed: 3\nrl:\n  dispatcher: {class_path: skew, init_args: {alpha: 0.3}}\n"
        "  engine: hf\n  micro_batches: {max_tokens: 512}\n"
    )
    assert fitted(fit, "--config", str(migrated)) == fitted(fit, "--config", str(by_hand))
    assert main(["config", "migrate", str(migrated), "-o", str(tmp_path / "again.yaml")]) == 0
    assert "nothing to change" in capsys.readouterr().err


def test_a_null_flat_key_migrates_to_nothing_not_an_empty_section():
    """A flat key set to ``null`` (its default) is left out, and leaves no ``{}`` behind; a
    section the file already had stays, even empty."""
    from streamrl.run.config_migrate import migrate

    new, changes = migrate({"rl": {"sample_timeout_s": None, "generation": {}}})
    assert new == {"rl": {"generation": {}}}
    assert len(changes) == 1 and changes[0].startswith("rl.sample_timeout_s -> rl.timeouts")
    new, _ = migrate({"rl": {"sample_timeout_s": 30.0}})
    assert new == {"rl": {"timeouts": {"sample_s": 30.0}}}


def test_the_lora_section_is_lora_specs_arguments(fit, tmp_path, capsys):
    """``rl.lora`` holds ``LoRASpec``'s arguments: from a file, dotted options and YAML, checked
    by ``LoRASpec`` itself, printed with its docstring and read back; the flat keys migrate."""
    from streamrl.policy.lora import LoRASpec

    path = tmp_path / "lora.yaml"
    path.write_text("rl:\n  lora: {r: 4, target_modules: [q_proj, v_proj]}\n")
    assert fitted(fit, "--config", str(path)).rl.lora == LoRASpec(
        4, 16.0, 0.0, ("q_proj", "v_proj")
    )
    lora = fitted(fit, "--config", str(path), "--rl.lora.alpha", "8").rl.lora
    assert (lora.r, lora.alpha, lora.target_modules) == (4, 8.0, ("q_proj", "v_proj"))
    assert fitted(fit, "--rl.lora", "{r: 2}").rl.lora == LoRASpec(r=2)
    assert fitted(fit, "--config", str(path), "--rl.lora", "null").rl.lora is None
    for args, error in [
        (["--rl.lora.rank", "4"], "Unknown option '--rl.lora.rank' (did you mean '--rl.lora.r'?)"),
        (["--rl.lora", "{alpah: 4}"], "--rl.lora: Unknown key 'alpah' (did you mean 'alpha'?)"),
        (["--rl.lora", "{r: 0}"], "rl: lora: LoRASpec: need r >= 1"),  # its own check
        (["--rl.lora_r", "4"], "--rl.lora_r has moved: set rl.lora.r"),
    ]:
        code, calls = fit(*args)
        assert code == 2 and not calls and error in capsys.readouterr().err, args
    # --print_config writes the section with LoRASpec's own descriptions, and it reads back.
    code, _ = fit("--config", str(path), "--print_config=comments")
    text = capsys.readouterr().out
    assert "  lora:\n    # rank of each adapter" in text
    path.write_text(text)
    assert fitted(fit, "--config", str(path)).rl.lora == LoRASpec(
        4, 16.0, 0.0, ("q_proj", "v_proj")
    )
    # The flat keys of the earlier layout: refused by name, rewritten by config migrate.
    old = tmp_path / "old.yaml"
    old.write_text("rl:\n  lora_r: 8\n  lora_alpha: 32.0\n")
    assert fit("--config", str(old))[0] == 2
    assert "lora_r has moved: set rl.lora.r" in capsys.readouterr().err
    assert main(["config", "migrate", str(old)]) == 0
    migrated = fitted(fit, "--config", str(tmp_path / "old.migrated.yaml"))
    assert migrated.rl.lora == LoRASpec(r=8, alpha=32.0)
    old.write_text("rl:\n  lora_r: 0\n  lora_alpha: 32.0\n")  # no adapters: no section
    assert main(["config", "migrate", str(old), "-o", str(tmp_path / "full.yaml")]) == 0
    assert fitted(fit, "--config", str(tmp_path / "full.yaml")).rl.lora is None


def test_the_reward_pool_section_is_reward_pools_arguments(fit, tmp_path, capsys):
    """``rl.reward_pool`` holds ``RewardPool``'s own arguments (the rewards and the files are
    linked in): printed with its signature, read back, and the flat keys migrate into it."""
    from streamrl.run.parts import reward_pool, reward_specs

    config = fitted(fit, "--rl.reward_pool", "{workers: 0, max_restarts: 2}")
    pool = reward_pool(config.rl, reward_specs(config.rl), tmp_path)
    assert (pool.workers, pool.max_restarts, pool.timeout_s) == (0, 2, 60.0)  # 60: its default
    assert pool.status_path == tmp_path / "reward_workers.json"
    capsys.readouterr()  # the run's JSON line
    assert (
        fit("--rl.reward_pool", "{workers: 0, max_restarts: 2}", "--print_config=comments")[0] == 0
    )
    text = capsys.readouterr().out
    assert "  # its keys: RewardPool(workers=1, timeout_s=60.0" in text
    assert "  # its keys: Timeouts.for_model(start_s=None" in text
    assert "DynamicBatchPipeline(max_tokens=1024, min_samples=1, packed=None); the run" in text
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert fitted(fit, "--config", str(path)).rl.reward_pool == {"workers": 0, "max_restarts": 2}
    old = tmp_path / "old.yaml"
    old.write_text("rl:\n  reward_workers: 0\n  reward_timeout_s: 5.0\n  max_reward_restarts: 3\n")
    assert main(["config", "migrate", str(old)]) == 0
    migrated = fitted(fit, "--config", str(tmp_path / "old.migrated.yaml")).rl.reward_pool
    assert migrated == {"workers": 0, "timeout_s": 5.0, "max_restarts": 3}


def test_the_generation_section_is_the_services_arguments(fit, tmp_path, capsys):
    """``rl.generation`` holds ``StreamGenerationService``'s own arguments: a dotted option sets
    one and keeps the file's others, ``--gpus`` is one of them, what the run links in (the
    engine, the seed...) is refused naming where it comes from, a misspelled one gets a "did
    you mean", the comments list its keys without the linked ones, and the flat keys of the
    old layout migrate into it."""
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  generation: {num_instances: 3, temperature: 0.9}\n")
    config = fitted(fit, "--config", str(path), "--rl.generation.max_batch_size", "16")
    assert config.rl.generation == {"num_instances": 3, "temperature": 0.9, "max_batch_size": 16}
    assert config.rl.arg("generation", "max_restarts") == 3  # the constructor's default
    assert fitted(fit, "--gpus", "0").rl.generation == {"gpus_per_instance": 0}
    capsys.readouterr()
    refused = {
        "--rl.generation.engine": "engine is linked in by the run, not set here: set rl.engine",
        "--rl.generation.temprature": "(did you mean 'temperature'",
    }
    for option, message in refused.items():
        assert fit(option, "1") == (2, [])
        assert message in capsys.readouterr().err
    assert fit("--rl.generation.temperature", "0.9", "--rl.iteratons", "3") == (2, [])
    assert "(did you mean '--rl.iterations'?)" in capsys.readouterr().err  # the one at fault
    assert fit("--print_config=comments")[0] == 0
    text = capsys.readouterr().out
    comment = text[text.index("its keys: StreamGenerationService(") :].split("\n  generation:")[0]
    assert "num_instances=2" in comment and "max_batch_size=" in comment
    assert "seed=" not in comment and "the run links in model_dir, engine" in " ".join(
        line.strip(" #") for line in comment.splitlines()
    )
    old = tmp_path / "old.yaml"
    old.write_text("rl:\n  generators: 1\n  gpus: 0\n  partial_rollout: keep\n  mode: async\n")
    assert fit("--config", str(old)) == (2, [])
    assert "generators has moved: set rl.generation: {num_instances" in capsys.readouterr().err
    assert main(["config", "migrate", str(old)]) == 0
    migrated = fitted(fit, "--config", str(tmp_path / "old.migrated.yaml")).rl
    assert migrated.generation == {
        "num_instances": 1,
        "gpus_per_instance": 0,
        "partial_rollout": "keep",
    }
    assert migrated.module == {"mode": "async"}  # StreamRLModule's own argument


def test_the_clip_range_and_kl_weight_are_the_algorithms_own_arguments(fit, tmp_path, capsys):
    """``clip_eps`` and ``kl_coef`` live in one place, the algorithm's constructor: given as
    its ``init_args`` they reach the algorithm the run trains with (and a KL weight the memory
    check's reference); the flat keys of the earlier layout are refused naming that place and
    ``config migrate`` moves them there."""
    from streamrl.run.parts import build_run_algorithm
    from streamrl.run.swappable import init_arg

    old = tmp_path / "old.yaml"
    old.write_text("rl:\n  algorithm: dapo\n  kl_coef: 0.1\n  clip_eps: 0.3\n")
    assert fit("--config", str(old))[0] == 2
    err = capsys.readouterr().err
    assert "kl_coef has moved: set rl.algorithm's init_args: {kl_coef: ...}" in err
    assert main(["config", "migrate", str(old)]) == 0
    config = fitted(fit, "--config", str(tmp_path / "old.migrated.yaml"))
    algorithm = build_run_algorithm(config.rl, hidden_size=8)
    assert type(algorithm).__name__ == "DAPO"
    assert (algorithm.kl_coef, algorithm.clip_eps, algorithm.needs_reference) == (0.1, 0.3, True)
    assert init_arg("algorithm", config.rl.algorithm, "kl_coef") == 0.1
    assert init_arg("algorithm", RunConfig().rl.algorithm, "kl_coef") == 0.0  # GRPO's default
    assert not build_run_algorithm(RunConfig().rl, hidden_size=8).needs_reference
