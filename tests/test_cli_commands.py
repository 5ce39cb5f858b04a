"""Every command but ``fit`` on ``jsonargparse`` (``streamrl.cli.parsing``): options from typed
dataclass fields with their docstrings, the argparse-era spellings, ``--config`` and
``--print_config``."""

from __future__ import annotations

import dataclasses
import json

import docstring_parser
import pytest

from streamrl.cli.main import command_tree, main, parse_command
from streamrl.cli.parsing import Command, normalize_argv
from streamrl.cli.tools import COMMANDS as TOOLS
from streamrl.sim.commands import SimulateOptions


def _leaves(tree: dict, prefix: str = "streamrl") -> dict[str, Command]:
    out = {}
    for name, entry in tree.items():
        if isinstance(entry, Command):
            out[f"{prefix} {name}"] = entry
        elif isinstance(entry, dict):
            out.update(_leaves(entry, f"{prefix} {name}"))
    return out


def test_every_option_has_a_type_and_a_description():
    leaves = _leaves(command_tree())
    assert len(leaves) == 19  # all but fit, which has its own parser
    for name, command in leaves.items():
        described = {p.arg_name for p in docstring_parser.parse(command.options.__doc__).params}
        fields = {f.name for f in dataclasses.fields(command.options)}
        assert fields <= described, f"{name}: undocumented {sorted(fields - described)}"


def test_argparse_spellings_still_parse():
    simulate = command_tree()["simulate"]
    argv = ["--gen-gpus", "8", "--no-skew", "--cross_dc=true", "--growth", "-0.5", "--elastic"]
    expected = "--gen_gpus 8 --no_skew true --cross_dc=true --growth -0.5 --elastic true"
    assert normalize_argv(argv, simulate) == expected.split()
    _, run = parse_command(["simulate", "--no-skew", "false", "--gen-gpus", "8", "--elastic"])
    options = run.args[0]
    assert isinstance(options, SimulateOptions)
    assert (options.no_skew, options.gen_gpus, options.elastic) == (False, 8, True)
    timeline = normalize_argv(["-o", "x.png", "run.json"], TOOLS["timeline"])
    assert timeline == ["--output", "x.png", "--trace", "run.json"]


def test_simulate_prints_json_last(capsys):
    argv = ["simulate", "--preset", "paper-7b-5k", "--mode", "sync", "--no-skew"]
    assert main([*argv, "--iterations", "1", "--gen-gpus", "8", "--train-gpus", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["mode"], result["gen_gpus"], result["train_gpus"]) == ("sync", 8, 8)


def test_print_config_writes_a_config_that_reads_back(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--workload", "paper-7b-5k", "--budget", "12", "--print_config"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "budget: 12" in text and "workload: paper-7b-5k" in text and "config" not in text
    config = tmp_path / "plan.yaml"
    config.write_text(text)
    assert main(["plan", "--config", str(config), "--mode", "sync"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["workload"] == "paper-7b-5k" and result["mode"] == "sync"
    assert result["gen_gpus"] + result["train_gpus"] <= 12


def test_bad_options_exit_2_and_bad_values_say_so(capsys):
    for argv in (["plan", "--bogus", "3"], ["simulate", "--mode", "nope"], ["bench"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    capsys.readouterr()
    assert main(["sim", "validate", "--configs", "nope"]) == 2
    assert "streamrl sim: error: --configs: unknown ['nope']" in capsys.readouterr().err
