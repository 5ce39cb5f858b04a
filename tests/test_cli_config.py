"""``streamrl fit``'s config edge (jsonargparse): files, dotted overrides, ``--print_config``,
and our own key, type and value checks. No training: ``run_fit`` is replaced by a recorder."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from streamrl.cli import build_parser, main
from streamrl.config import RunConfig
from streamrl.config_file import load_config

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


@pytest.fixture
def fit(monkeypatch):
    """Run ``streamrl fit ARGS`` in this process; returns (exit code, the recorded calls)."""
    import streamrl.jobs

    calls: list[dict] = []

    def record(config, show_progress=True, resume=None):
        calls.append(dict(config=config, show_progress=show_progress, resume=resume))
        return {}

    monkeypatch.setattr(streamrl.jobs, "run_fit", record)

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
        "--rl.lr",
        "3e-5",
        "--data.tasks",
        "[copy, rev]",
        "--rl.dispatcher",
        "round_robin",
        "--rl.algorithm",
        "{name: grpo, clip_eps_high: 0.28}",
        "--rl.length_predictor",
        "null",
        "--seed",
        "3",
        "--rl.elastic",
        "true",
    )
    assert config.rl.lr == 3e-5 and isinstance(config.rl.lr, float)
    assert config.data.tasks == ["copy", "rev"]
    assert config.rl.dispatcher == "round_robin"
    assert config.rl.algorithm == {"name": "grpo", "clip_eps_high": 0.28}
    assert config.rl.length_predictor is None
    assert config.seed == 3 and config.rl.elastic is True
    # Everything not overridden keeps its default.
    expected = RunConfig(seed=3)
    expected.data.tasks = ["copy", "rev"]
    expected.rl = dataclasses.replace(
        expected.rl,
        lr=3e-5,
        dispatcher="round_robin",
        algorithm={"name": "grpo", "clip_eps_high": 0.28},
        length_predictor=None,
        elastic=True,
    )
    assert config == expected


def test_a_group_takes_a_yaml_mapping_and_a_list_appends(fit):
    config = fitted(fit, "--rl", "{lr: 2.0e-5, group_size: 4}", "--data.tasks+", "copy")
    assert config.rl.lr == 2e-5 and config.rl.group_size == 4
    assert config.data.tasks == [*RunConfig().data.tasks, "copy"]


def test_run_options_and_the_old_aliases(fit, tmp_path):
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_bytes(b"")
    out = str(tmp_path / "out")
    code, calls = fit("--output-dir", out, "--gpus=0", "--no-progress", "--resume", str(ckpt))
    assert code == 0
    assert calls[0]["config"].output_dir == out and calls[0]["config"].rl.gpus == 0
    assert calls[0]["show_progress"] is False and calls.pop()["resume"] == str(ckpt)
    # The aliases are plain aliases: what comes later wins either way.
    assert fitted(fit, "--output-dir", "a", "--output_dir", "b").output_dir == "b"
    assert fitted(fit, "--output_dir", "a", "--output-dir", "b").output_dir == "b"


def test_later_config_file_wins_and_the_command_line_in_its_place(fit, tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("seed: 1\nrl: {lr: 1.0e-5, iterations: 7}\ndata: {n_train: 100}\n")
    second.write_text("seed: 2\nrl: {lr: 2.0e-5}\n")
    config = fitted(fit, "--config", str(first), "--config", str(second))
    assert config.seed == 2 and config.rl.lr == 2e-5  # the later file wins
    assert config.rl.iterations == 7 and config.data.n_train == 100  # merged, not replaced
    config = fitted(fit, "--config", str(second), "--config", str(first))
    assert config.seed == 1 and config.rl.lr == 1e-5
    # The command line after a file wins over it; a file after an option wins over that.
    config = fitted(fit, "--config", str(first), "--rl.lr", "3e-5", "--seed", "5")
    assert config.rl.lr == 3e-5 and config.seed == 5 and config.rl.iterations == 7
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
    base.write_text("rl: {iterations: 5, dispatcher: {name: skew, objective: sum}}\n")
    argv = ["--config", str(base), "--rl.lr", "3e-5", "--rl.length_predictor", "null"]
    code, calls = fit(*argv, "--print_config")
    assert code == 0 and not calls
    path = tmp_path / "resolved.yaml"
    path.write_text(capsys.readouterr().out)
    resolved = load_config(path)
    assert resolved == fitted(fit, *argv)
    assert resolved.rl.lr == 3e-5 and resolved.rl.iterations == 5
    assert resolved.rl.dispatcher == {"name": "skew", "objective": "sum"}
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
        (["--rl.lr=1e-5", "--data.task=[copy]"], "'--data.task' (did you mean '--data.tasks'?)"),
        (["--rl", "{lrr: 1.0e-5}"], "--rl: Unknown key 'lrr' (did you mean 'lr'?)"),
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
        (["--rl.lr", "abc"], None, "\"rl.lr\": Expected a <class 'float'>. Got value: abc"),
        (["--data.n_train", "1.5"], None, "data.n_train"),
        (["--data.tasks", "copy"], None, "data.tasks"),
        (["--rl.elastic", "3"], None, "rl.elastic"),
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
    code, calls = fit("--rl.mode", "asnyc")
    assert code == 2 and not calls
    assert "Unknown mode 'asnyc' (did you mean 'async'?)" in capsys.readouterr().err
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


def test_fit_help_shows_the_dotted_options(capsys):
    for argv in (["fit", "--help"], ["fit", "-h"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "--rl.lr" in out and "--print_config" in out and "--data.tasks" in out
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["fit", "--help"])  # the argparse entry shows the same help
    assert exit_info.value.code == 0 and "--rl.lr" in capsys.readouterr().out
