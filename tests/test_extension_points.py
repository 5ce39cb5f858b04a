"""Every extension point takes a user's own part, from YAML (``package.module:Name``) and from
Python, with no edit inside ``streamrl/``: a custom algorithm, dispatcher, reward and engine
(``tests/extension_plugins.py``) run through the real call sites of a real run.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch
import yaml

from streamrl.errors import ConfigError
from streamrl.run.config import RunConfig
from streamrl.run.config_file import from_dict
from streamrl.run.parts import check_parts

TESTS = Path(__file__).resolve().parent
PLUGINS = {  # LightningCLI's form: the import path and the constructor's own arguments
    "algorithm": {"class_path": "extension_plugins.SignGRPO", "init_args": {"margin": 0.1}},
    "reward": "extension_plugins:quarter_or_half",
    "dispatcher": {
        "class_path": "extension_plugins.LastInstanceDispatcher",
        "init_args": {"cap": 3},
    },
    "length_predictor": None,
    "elastic": {
        "class_path": "extension_plugins.ObservingElastic",
        "init_args": {"label": "mine", "max_instances": 2},
    },
}


@pytest.fixture(autouse=True)
def plugins_importable(monkeypatch):
    """As a user's package would be: importable here and in every spawned process."""
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def small_run_values(tmp_path: Path, **rl: object) -> dict:
    return {
        "output_dir": str(tmp_path / "run"),
        "data": {"tasks": ["copy"], "n_train": 32, "n_heldout": 8, "median_len": 3},
        "sft": {"model_size": "test", "steps": 20},
        "rl": {
            "iterations": 2,
            "prompts_per_iteration": 4,
            "group_size": 2,
            "generation": {"num_instances": 2},
            "rollouts": {"max_tokens": 12, "ranker_refresh_every": 1},
            "checkpoints": {"every": 1},
            **rl,
        },
    }


def small_run(tmp_path: Path, **rl: object) -> RunConfig:
    return from_dict(RunConfig, small_run_values(tmp_path, **rl), where="test")


@pytest.mark.timeout(300)
def test_custom_parts_from_yaml_run_in_a_real_fit_and_in_the_simulator(tmp_path, capsys):
    from streamrl.cli.main import main
    from streamrl.run.config_file import load_config
    from streamrl.run.recipe import run_fit
    from streamrl.training.timeline import load_trace

    markers = tmp_path / "markers"
    markers.mkdir()
    engine = {
        "class_path": "extension_plugins.MarkingEngine",
        "init_args": {"marker_dir": str(markers)},
    }
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(yaml.safe_dump(small_run_values(tmp_path, engine=engine, **PLUGINS)))

    # The simulator builds the same dispatcher from the same file: every sample on the last
    # of the colocated preset's two instances.
    trace = tmp_path / "sim.json"
    argv = ["simulate", "--preset", "cpu", "--mode", "colocated", "--run_config", str(yaml_file)]
    assert main([*argv, "--trace", str(trace)]) == 0
    lanes = {s.lane for s in load_trace(trace) if s.name == "generate"}
    assert lanes == {"generator-1"}
    capsys.readouterr()

    config = load_config(yaml_file)
    summary = run_fit(config, show_progress=False)

    assert summary["samples_lost"] == 0
    # The engine was built inside each generator process, from the model directory.
    assert sorted(p.name for p in markers.iterdir()) == ["instance-0", "instance-1"]
    state = torch.load(Path(config.output_dir) / "checkpoints" / "last.ckpt", weights_only=False)[
        "streamrl"
    ]
    # SignGRPO scored every group, with its own argument from init_args.
    assert state["algorithm"] == {"groups_scored": 2 * 4, "margin": 0.1}
    assert state["dispatcher"]["plans"] == 2  # one plan per iteration
    assert state["dispatcher"]["cap"] == 3  # its own argument, from init_args
    assert state["dispatcher"]["observed"] == 4 * 2  # iteration 0's lengths, at the refresh
    # The elastic controller decided after each iteration, its own argument from init_args.
    assert state["elastic"]["label"] == "mine" and state["elastic"]["decisions"] == 2
    metrics = next((Path(config.output_dir) / "logs").rglob("metrics.csv"))
    rewards = [float(r["rollout/reward"]) for r in csv.DictReader(metrics.open())]
    assert rewards and all(0.25 <= r <= 0.5 for r in rewards)  # only quarter_or_half gives these


@pytest.mark.timeout(300)
def test_custom_parts_from_python_through_the_builders(tmp_path, tokenizer):
    import extension_plugins as plugins

    from streamrl import PromptSource, RolloutStream, StreamGenerationService
    from streamrl.policy.models import build_tiny_model, save_policy
    from streamrl.tasks import make_prompt_set
    from streamrl.training.builders import build_module, build_trainer

    policy = build_tiny_model(tokenizer, "test", seed=0)
    model_dir = save_policy(policy, tokenizer, tmp_path / "policy")
    markers = tmp_path / "markers"
    markers.mkdir()
    algorithm = plugins.SignGRPO(group_size=2)
    dispatcher = plugins.LastInstanceDispatcher(max_batch_size=8, cap=3)
    engine = plugins.MarkingEngine(str(markers))
    prompts = PromptSource(make_prompt_set(16, ["copy"], median_len=3, max_len=6), 4)
    with StreamGenerationService(
        model_dir, 2, engine=engine, dispatcher=dispatcher, max_batch_size=8
    ) as service:
        rollouts = RolloutStream(
            service,
            prompts,
            tokenizer,
            algorithm,
            reward=plugins.quarter_or_half,
            max_tokens=8,
            context=256,
        )
        module = build_module(policy, rollouts=rollouts, iterations=2, lr=1e-3)
        assert module.algorithm is algorithm  # given once, to the stream: it scores and trains
        build_trainer(module, show_progress=False).fit(module)
    assert sorted(p.name for p in markers.iterdir()) == ["instance-0", "instance-1"]
    assert algorithm.groups_scored == 2 * 4 and dispatcher.plans == 2
    # Every sample came from the instance the dispatcher chose: the last one.
    lanes = {span.lane for span in rollouts.trace.spans if span.name == "generate"}
    assert lanes == {"generator-1"}
    assert all(0.25 <= h["rollout/reward"] <= 0.5 for h in module.history)


@pytest.mark.parametrize(
    ("rl", "message"),
    [
        ({"reward": "no_such_module:score"}, r"rl.reward: cannot import module 'no_such_module'"),
        (
            {"reward": "extension_plugins:quarter_or_hlf"},
            r"Unknown name 'quarter_or_hlf'.*"
            r"did you mean 'quarter_or_half'",
        ),
        ({"reward": "json:loads"}, r"rl.reward: json:loads has the wrong signature"),
        ({"algorithm": "extension_plugins:quarter_or_half"}, r"is not a subclass of .*Algorithm"),
        (
            {"dispatcher": "extension_plugins:MarkingEngine"},
            r"rl.dispatcher: .*needs \['marker_dir'\]",
        ),
        (
            {"dispatcher": {"name": "extension_plugins:LastInstanceDispatcher", "cap": 3}},
            r"rl.dispatcher: \{name: ...\} has become \{class_path, init_args\}: write "
            r"\{class_path: 'extension_plugins:LastInstanceDispatcher', init_args: \{cap: 3\}\} "
            r"\(streamrl config migrate OLD.yaml rewrites a file\)\.",
        ),
        (  # a misspelled argument of a class given by class_path: named, with a suggestion
            {
                "algorithm": {
                    "class_path": "extension_plugins.LastInstanceDispatcher",
                    "init_args": {"cop": 3},
                }
            },
            r"rl.algorithm: .*takes no option\(s\) \['cop'\] \(did you mean 'cap'\?\)",
        ),
        (
            {"dispatcher": {"class_path": "extension_plugins.LastInstanceDispatcher", "cap": 3}},
            r"rl.dispatcher: Unknown key 'cap'.*A class's arguments go under init_args",
        ),
        (
            {"dispatcher": {"class_path": "skew", "init_arg": {"alpha": 0.3}}},
            r"Unknown key 'init_arg' \(did you mean 'init_args'\?\)",
        ),
        (
            {"dispatcher": {"class_path": "extension_plugins.LastInstanceDispatcherr"}},
            r"Unknown name 'LastInstanceDispatcherr'.*did you mean 'LastInstanceDispatcher'",
        ),
        (
            {"dispatcher": {"class_path": "skew", "init_args": {"alhpa": 0.3}}},
            r"did you mean 'alpha'",
        ),
        ({"dispatcher": {"cap": 3}}, r"rl.dispatcher: a mapping needs a 'class_path'"),
        ({"engine": "extension_plugins:quarter_or_half"}, r"rl.engine: .*needs"),
        ({"scheduler": "extension_plugins:quarter_or_half"}, r"rl.scheduler"),
    ],
)
def test_a_wrong_reference_fails_before_work_with_the_reason(tmp_path, rl, message):
    with pytest.raises(ConfigError, match=message):  # when the config is made, or checked
        check_parts(small_run(tmp_path, **rl).rl)


def test_print_config_writes_your_parts_as_class_paths_that_run_unchanged(tmp_path, capsys):
    """``fit --print_config > a.yaml; fit --config a.yaml`` is the same run, your own parts
    written out with their full import path and arguments (and any spelling of a part is one
    config: a short name, ``module:Name``, ``module.Name`` or class_path + init_args)."""
    import streamrl.run.recipe
    from streamrl.cli.main import main
    from streamrl.run.config_file import load_config

    spelled = small_run_values(tmp_path, **PLUGINS)
    spelled["rl"]["dispatcher"] = {  # module:Name in class_path, as resolve also reads
        "class_path": "extension_plugins:LastInstanceDispatcher",
        "init_args": {"cap": 3},
    }
    spelled["rl"]["scheduler"] = "fifo"
    original = tmp_path / "run.yaml"
    original.write_text(yaml.safe_dump(spelled))
    assert main(["fit", "--config", str(original), "--print_config=comments"]) == 0
    printed = capsys.readouterr().out
    assert "  dispatcher:\n    class_path: extension_plugins.LastInstanceDispatcher\n" in printed
    assert "    init_args: {cap: 3}\n" in printed
    assert "# init_args: LastInstanceDispatcher(max_batch_size, cap=4) (from_run" in printed
    assert "class_path: streamrl.components.skewness.schedulers.FIFOScheduler" in printed
    written = tmp_path / "printed.yaml"
    written.write_text(printed)
    assert load_config(written) == load_config(original)

    runs = []
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(streamrl.run.recipe, "fit_checked", lambda c, *_: runs.append(c) or {})
    try:
        assert main(["fit", "--config", str(written)]) == 0
        assert main(["fit", "--config", str(original)]) == 0
    finally:
        monkeypatch.undo()
    assert runs[0] == runs[1] and runs[0].rl.dispatcher["init_args"] == {"cap": 3}


def test_a_class_of_your_notebook_is_a_part_only_the_recipes_process_builds(tmp_path, monkeypatch):
    """A notebook's (or script's) own class is given as ``class_path`` itself, ``__main__.Name``
    in the config: the algorithm and the dispatcher, which the recipe's process builds; never
    the scheduler, built in the generator processes, nor a notebook's algorithm on trainer ranks
    the recipe spawns (they cannot import a notebook)."""
    from extension_plugins import SignGRPO

    from streamrl.components.skewness.schedulers import FIFOScheduler
    from streamrl.run.config_file import load_config
    from streamrl.run.parts import build_run_algorithm

    main_module = sys.modules["__main__"]

    def in_main(cls: type) -> type:  # as a notebook cell defines it
        cls.__module__, cls.__qualname__ = "__main__", cls.__name__
        monkeypatch.setattr(main_module, cls.__name__, cls, raising=False)
        return cls

    NotebookGRPO = in_main(type("NotebookGRPO", (SignGRPO,), {}))
    values = small_run_values(tmp_path)
    values["rl"]["algorithm"] = {"class_path": NotebookGRPO, "init_args": {"margin": 0.2}}
    config = load_config(values)
    assert config.rl.algorithm == {
        "class_path": "__main__.NotebookGRPO",
        "init_args": {"margin": 0.2},
    }
    algorithm = build_run_algorithm(config.rl, hidden_size=16)
    assert type(algorithm) is NotebookGRPO and algorithm.margin == 0.2
    assert algorithm.group_size == 2  # linked in from rl.group_size

    values["rl"]["scheduler"] = {"class_path": in_main(type("NotebookFIFO", (FIFOScheduler,), {}))}
    with pytest.raises(ConfigError, match=r"rl.scheduler: __main__.NotebookFIFO cannot be imp"):
        load_config(values)
    del values["rl"]["scheduler"]

    values["trainer"] = {"accelerator": "cpu", "devices": 2}
    assert load_config(values).trainer.devices == 2  # a script: spawned ranks import it
    monkeypatch.delattr(main_module, "__file__", raising=False)  # a notebook's kernel
    with pytest.raises(ConfigError, match=r"defined in this notebook.*trainer.devices: 1"):
        load_config(values)
