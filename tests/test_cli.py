"""The console script: help, unknown commands, and bad input that fails before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from streamrl.cli.main import build_parser, main, parse_command
from streamrl.records import PIPELINE_COLUMNS
from streamrl.run.fit_args import parse_fit


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamrl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_command_has_help(capsys):
    for argv in (
        ["--help"],
        ["demo", "--help"],
        ["fit", "--help"],
        ["bench", "--help"],
        ["bench", "generate", "--help"],
        ["timeline", "--help"],
        ["bench", "pipeline", "--help"],
        ["bench", "dispatch", "--help"],
        ["bench", "ranker", "--help"],
        ["bench", "episodes", "--help"],
        ["profile", "--help"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 0
    assert "demo" in capsys.readouterr().out


def test_unknown_command_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["trian"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_fit_with_missing_config_fails_before_work(tmp_path, capsys):
    assert main(["fit", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_fit_with_config_typo_subprocess(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rl:\n  iteratons: 3\n")
    result = run_cli("fit", "--config", str(config))
    assert result.returncode == 2
    assert "Unknown key 'iteratons' (did you mean 'iterations'?)" in result.stderr
    assert result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a GPU-less machine")
def test_fit_with_gpus_on_a_cpu_machine_fails_at_once(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("rl:\n  iterations: 1\n")
    assert main(["fit", "--config", str(config), "--gpus", "1", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "gpus_per_instance=1 but this machine has no CUDA GPU" in err and "drop --gpus" in err
    assert not (tmp_path / "instances.json").exists()  # no generator was started


@pytest.mark.parametrize("command", ["fit", "demo"])
def test_an_output_dir_that_is_a_file_fails_before_any_work(tmp_path, capsys, command):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    for output_dir in (taken, taken / "run"):
        started = time.monotonic()
        argv = [command, "--output-dir", str(output_dir), "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{str(taken)!r} is a file, not a directory; choose another output_dir" in err
        assert time.monotonic() - started < 30  # before the warm start and the generators


@pytest.mark.timeout(300)
def test_fit_small_run_prints_json_summary(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "data: {tasks: [copy, count], n_train: 32, n_heldout: 8, median_len: 3, max_len: 6}\n"
        "sft: {model_size: test, steps: 20}\n"
        "rl: {iterations: 2, prompts_per_iteration: 4, group_size: 2,"
        " generation: {num_instances: 1},"
        " rollouts: {max_tokens: 12}}\n"
    )
    # As a user pipes it (`streamrl fit ... | tail -1`), progress on: the headings of the
    # stages and every bar go to stderr, and stdout is the one JSON line.
    command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--config", str(config)]
    env = {**os.environ, "STREAMRL_CACHE": str(tmp_path / "cache")}  # a warm start that runs
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=280, check=True, env=env
    )
    [line] = result.stdout.splitlines()
    summary = json.loads(line)
    headings = [h for h in result.stderr.splitlines() if h.startswith("[")]
    assert [h[:5] for h in headings] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    assert "Warm start: 20 SFT steps" in headings[0] and "RL (GRPO, sync)" in headings[2]
    assert "rl iterations: 100%" in result.stderr and "warm start (SFT): 100%" in result.stderr
    assert "  summary.json " in result.stderr and "  policy " in result.stderr
    assert "GPU available" not in result.stderr  # Lightning's banners: only with --verbose
    for key in (
        "reward_first",
        "reward_last",
        "heldout_acc_before",
        "heldout_acc_after",
        "samples_per_s",
        "iterations",
        "wall_s",
    ):
        assert key in summary
    assert summary["iterations"] == 2 and summary["samples_per_s"] > 0
    assert (tmp_path / "out" / "summary.json").is_file()
    assert list((tmp_path / "out" / "logs").rglob("metrics.csv"))
    assert summary["samples_lost"] == 0 and summary["samples_trained"] == 2 * 4 * 2
    assert (tmp_path / "out" / "instances.json").is_file()
    # Resume from the last checkpoint and go on to 3 iterations: only the third one runs.
    last = tmp_path / "out" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    config.write_text(config.read_text().replace("iterations: 2", "iterations: 3"))
    # Into the same output_dir without --resume: refused (it would start over beside the old
    # run's checkpoints, and last.ckpt would go on naming the old run's).
    assert main(["fit", "--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"holds an earlier run (its checkpoint {last}): go on from it with --resume auto" in err
    assert main(["fit", "--config", str(config), "--no-progress", "--resume", "auto"]) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["samples_trained"] == 3 * 4 * 2 and resumed["samples_lost"] == 0
    assert sorted(p.name for p in last.parent.glob("last*.ckpt")) == ["last.ckpt"]
    assert main(["fit", "--config", str(config), "--resume", str(tmp_path / "nope.ckpt")]) == 2
    capsys.readouterr()
    # Once more on the finished run: nothing to do, its summary kept (it reran both evaluations
    # and wrote a summary of nothing over it).
    written = (tmp_path / "out" / "summary.json").stat().st_mtime_ns
    assert main(["fit", "--config", str(config), "--no-progress", "--resume", "auto"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == resumed
    assert "finished its 3 iterations already; nothing to do" in err
    assert "Held-out evaluation" not in err
    assert (tmp_path / "out" / "summary.json").stat().st_mtime_ns == written


def _children(pid: int) -> list[int]:
    """Spawned worker processes whose parent is ``pid`` (read from /proc; Linux only)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_generator_process(tmp_path):
    import os
    import signal
    import time

    config = tmp_path / "c.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\n"
        "data: {tasks: [copy], n_train: 16, n_heldout: 4, median_len: 3, max_len: 6}\n"
        "sft: {model_size: test, steps: 2}\n"
        "rl: {iterations: 100000, prompts_per_iteration: 2, group_size: 2,"
        " generation: {num_instances: 2}}\n"
    )
    command = [sys.executable, "-m", "streamrl.cli.main", "fit", "--no-progress", "--config"]
    command.append(str(config))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 200
    while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    generators = _children(proc.pid)
    assert len(generators) >= 2, "generator processes never started"
    time.sleep(3)  # let training run
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    time.sleep(1)
    alive = [pid for pid in generators if os.path.exists(f"/proc/{pid}")]
    assert not alive, f"generator processes {alive} outlived Ctrl-C"


def test_bench_generate_reports_both_decoders(capsys):
    # 300 tokens: past the tiny model's default context of 256, so it is built with more.
    argv = ["bench", "generate", "--batch-sizes", "2,4", "--prompts", "4", "--max-tokens", "300"]
    assert main([*argv, "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rates = result["tokens_per_s"]
    for decoder in ("stream", "hf_generate"):
        assert set(rates[decoder]) == {"2", "4"}
        assert all(v > 0 for v in rates[decoder].values())
    for batch, ratio in result["ratio"].items():  # the ratio of the two reported rates
        assert ratio == pytest.approx(rates["stream"][batch] / rates["hf_generate"][batch], 1e-2)


@pytest.mark.timeout(300)
def test_bench_episodes_plays_every_policy_on_the_same_episodes(capsys):
    argv = ["bench", "episodes", "--episodes", "16", "--history", "24", "--repeats", "1"]
    argv += ["--model-size", "test"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    policies = {"round_robin", "round_robin_affinity", "episode_aware"}
    assert set(result["episodes_per_s"]) == policies
    turns = {run["turns"] for run in result["runs"]}
    assert len(turns) == 1  # the same episodes (each as many turns as its rounds) every time
    assert all(run["truncated"] == 0 for run in result["runs"])  # every episode fits
    saved = result["prefill_saved"]
    # Turns kept on their instance reuse the prefix; dealt turn by turn, only by chance.
    assert saved["round_robin_affinity"] > saved["round_robin"]
    assert result["speedup_vs_round_robin"] == pytest.approx(
        result["episodes_per_s"]["episode_aware"] / result["episodes_per_s"]["round_robin"]
    )


@pytest.mark.timeout(300)
def test_bench_pipeline_runs_every_mode_and_reports_speedups(tmp_path, capsys):
    lengths = tmp_path / "lengths.jsonl"
    lengths.write_text("\n".join(json.dumps({"length": n}) for n in (3, 9, 4, 20)))
    argv = [
        "bench",
        "pipeline",
        "--lengths",
        str(lengths),
        "--batch",
        "2",
        "--group-size",
        "2",
        "--iterations",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--model",
        "tiny",
        "--timeline-dir",
        str(tmp_path / "tl"),
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    modes = result["modes"]
    every = {"colocated", "sync", "async", "async-k2", "partial-keep", "partial-recompute"}
    assert set(modes) == every  # the default --modes
    for row in modes.values():
        assert set(row) == {*PIPELINE_COLUMNS, "slot_use"}
        assert 0 <= row["slot_use"] <= 1  # mean running sequences over the slots
        # One repeat: every iteration trains exactly the 2 x 2 samples requested.
        assert row["samples_per_s"] * row["iteration_s"] == pytest.approx(4, rel=1e-2)
        assert 0 <= row["trainer_idle_frac"] <= 1 and 0 <= row["generator_idle_frac"] <= 1
        assert 0 <= row["exposed_sync_s"] <= row["iteration_s"]
        assert row["gen_s"] > 0 and row["train_s"] > 0
    # Staleness of the trained tokens: none in sync; in one-step async one version, or none
    # for a sample its generator started only after the next weights had arrived (a loaded
    # machine: seen once in the whole suite, 0.5 over the 2 measured iterations); at most k
    # otherwise.
    assert modes["sync"]["token_lag_mean"] == modes["colocated"]["token_lag_mean"] == 0
    assert modes["sync"]["slot_use"] > 0  # sync generates inside its measured iterations
    assert 0 < modes["async"]["token_lag_mean"] <= 1
    assert 1 <= modes["async-k2"]["token_lag_mean"] <= 2
    assert 0 < modes["partial-keep"]["token_lag_mean"] <= 1
    # The speedups are the ratios of the reported rates.
    assert set(result["speedup"]) == every - {"colocated"}
    for mode, speedup in result["speedup"].items():
        rate = modes[mode]["samples_per_s"] / modes["colocated"]["samples_per_s"]
        assert speedup == pytest.approx(rate, abs=2e-3)
    assert set(result["over_async"]) == {"async-k2", "partial-keep", "partial-recompute"}
    for mode, speedup in result["over_async"].items():
        rate = modes[mode]["samples_per_s"] / modes["async"]["samples_per_s"]
        assert speedup == pytest.approx(rate, abs=2e-3)
    for mode in every:
        assert (tmp_path / "tl" / f"pipeline-{mode}.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no lengths file"),
        ('{"a": 3}', "non-empty JSON list"),
        ("[]", "non-empty JSON list"),
        ("[3, 0]", "entry 1 is 0"),
        ("[3, 2.5]", "entry 1 is 2.5"),
        ('["12"]', "entry 0 is '12'"),
        ("not json", "nor JSONL rows"),
    ],
)
@pytest.mark.parametrize("bench", ["pipeline", "dispatch"])
def test_bench_rejects_a_bad_lengths_file_before_any_work(
    tmp_path, capsys, bench, content, message
):
    path = tmp_path / "lengths.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench", bench, "--lengths", str(path)]) == 2
    assert message in capsys.readouterr().err


def _short_context_model(tmp_path, tokenizer):
    from streamrl.policy.models import build_tiny_model, save_policy

    model = build_tiny_model(tokenizer, "test", max_positions=64)
    return str(save_policy(model, tokenizer, tmp_path / "short"))


@pytest.mark.parametrize("bench", ["pipeline", "dispatch", "generate"])
def test_bench_refuses_a_model_too_short_for_the_lengths_before_any_work(
    tmp_path, capsys, monkeypatch, tokenizer, bench
):
    import streamrl.components.generation.service as service

    def no_generators(*args, **kwargs):
        raise AssertionError("a generator service was started")

    monkeypatch.setattr(service.StreamGenerationService, "__init__", no_generators)
    (tmp_path / "long.json").write_text("[300, 5, 9]")
    model = _short_context_model(tmp_path, tokenizer)
    size = (
        ["--max-tokens", "300"]
        if bench == "generate"
        else ["--lengths", str(tmp_path / "long.json")]
    )
    assert main(["bench", bench, "--model", model, *size]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings=64" in err and "built-in model ('tiny')" in err


def test_built_in_bench_model_gets_the_context_its_inputs_need(tmp_path):
    from streamrl.bench.inputs import model_dir_for
    from streamrl.policy.models import load_policy

    policy, _ = load_policy(model_dir_for("tiny", tmp_path, context=700))
    assert policy.config.max_position_embeddings == 700
    policy, _ = load_policy(model_dir_for("tiny", tmp_path / "small", context=10))
    assert policy.config.max_position_embeddings == 256  # the default when inputs fit


def test_bench_pipeline_rejects_unknown_mode(capsys):
    assert main(["bench", "pipeline", "--modes", "sync,coloc"]) == 2
    assert "unknown ['coloc']" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_readme_python_snippet_runs(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "snippet.py"
    trained = tmp_path / "trained"
    script.write_text(snippet.replace("/tmp/trained-policy", str(trained)))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rewards = result.stdout.split("reward per iteration:")[1]
    assert rewards.count(",") == 4  # five iterations
    from streamrl.policy.models import load_policy
    from streamrl.policy.sft import SFTConfig, warm_start

    start = load_policy(warm_start(SFTConfig(model_size="test", steps=200)))[0].state_dict()
    after = load_policy(trained)[0].state_dict()
    assert any(not torch.equal(start[k], after[k]) for k in start)  # the snippet trained it


def test_same_seed_same_weights(tmp_path, capsys):
    # seed_everything + seeded generators + one generator instance in sync mode: a CPU run is
    # reproducible bit for bit (checked on the final checkpoint's weights).
    import torch

    config = tmp_path / "c.yaml"
    config.write_text(
        "data: {tasks: [copy], n_train: 32, n_heldout: 8, median_len: 3, max_len: 6}\n"
        "sft: {model_size: test, steps: 20}\n"
        "rl: {iterations: 2, prompts_per_iteration: 4, group_size: 2,"
        " generation: {num_instances: 1, temperature: 1.5}, rollouts: {max_tokens: 12}}\n"
    )
    states = []
    for run in ("a", "b"):
        out = tmp_path / run
        args = ["fit", "--config", str(config), "--output-dir", str(out), "--no-progress"]
        assert main(args) == 0
        ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
        states.append(ckpt["state_dict"])
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_demo_sizes_are_valid_runs_and_small_is_smaller(tmp_path):
    from streamrl.run.config_checks import check_values
    from streamrl.run.demo import DEMO_SIZES
    from streamrl.run.stages import RunStages

    full, small = (DEMO_SIZES[s].config(str(tmp_path / s)) for s in ("full", "small"))
    for config in (full, small):
        check_values(config)
    assert full.sft.steps > small.sft.steps and full.rl.iterations > small.rl.iterations
    assert small.rl.generation == full.rl.generation  # the same job, shrunk
    for size in DEMO_SIZES.values():  # every stage that takes a while says how long
        assert set(size.expected) == set(RunStages.NAMES) - {"files"}
    assert parse_command(["demo", "--size", "small"])[1].args[0].size == "small"


def test_verbose_keeps_lightnings_information_lines():
    import logging

    from streamrl.runtime.quiet import quiet_lightning

    logger = logging.getLogger("lightning.pytorch")
    quiet_lightning()
    assert not logger.isEnabledFor(logging.INFO)
    quiet_lightning(verbose=True)
    assert logger.isEnabledFor(logging.INFO)
    quiet_lightning()
    assert parse_fit(["--verbose"]).verbose and not parse_fit([]).verbose
    assert parse_command(["demo", "--verbose"])[1].args[0].verbose


def test_bench_pipeline_runs_the_long_tail_modes_on_prompts_built_for_their_lengths(
    tmp_path, capsys
):
    """``async-all``: the distributional ranker, the adaptive planner with LPT and speculative
    decoding in the tail; ``--prompt_set by_length``: each prompt asks for its forced length."""
    from streamrl.bench.pipeline import BENCH_MODES, _long_tail_parts, _prompt_set
    from streamrl.bench.settings import PipelineBench
    from streamrl.components.skewness.adaptive import AdaptiveDispatcher
    from streamrl.components.skewness.schedulers import LPTScheduler

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([3, 9, 4, 20]))
    argv = ["bench", "pipeline", "--lengths", str(lengths), "--modes", "async,async-all"]
    argv += ["--prompt_set", "by_length", "--batch", "2", "--group-size", "2"]
    argv += ["--iterations", "3", "--warmup", "1", "--repeats", "1", "--generators", "2"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["modes"]) == {"async", "async-all"} and set(result["over_async"]) == {
        "async-all"
    }
    for row in result["modes"].values():  # every iteration trains the 2 x 2 samples asked for
        assert row["samples_per_s"] * row["iteration_s"] == pytest.approx(4, rel=1e-2)
    parts = _long_tail_parts(BENCH_MODES["async-all"], PipelineBench())
    assert isinstance(parts["dispatcher"], AdaptiveDispatcher)
    assert parts["scheduler"] is LPTScheduler and parts["engine"].speculative is not None
    assert _long_tail_parts(BENCH_MODES["async"], PipelineBench()) == {}
    rows = _prompt_set(PipelineBench(prompt_set="by_length"), [3, 9, 4, 20])
    assert [row["length"] for row in rows[:5]] == [3, 9, 4, 20, 3]


def test_the_run_ends_with_one_line_a_person_reads():
    from streamrl.run.stages import result_line

    summary = {
        "heldout_reward_before": 0.25,
        "heldout_reward_after": 0.5,
        "heldout_pass1_before": 0.25,
        "heldout_pass1_after": 0.5,
        "samples_trained": 16,
        "samples_per_s": 32.08,
        "output_dir": "runs/x",
    }
    assert result_line(summary) == (
        "Result: held-out reward 0.250 -> 0.500 (pass@1 25% -> 50%), 16 samples trained at "
        "32.1 samples/s, files in runs/x"
    )
    episodes = {"heldout_reward_before": 0.1, "heldout_reward_after": 0.2}
    episodes |= {"heldout_success_before": 0.0, "heldout_success_after": 0.5}
    assert "(success 0% -> 50%)" in result_line(episodes)
    assert result_line({}) == "Result: no figures (see the JSON line)"


def test_a_run_without_a_warm_start_says_what_that_means(capsys):
    from streamrl.run.config import RunConfig
    from streamrl.run.config_checks import check_values

    config = RunConfig()
    config.sft.steps = 0
    check_values(config)
    assert "warning: sft.steps: 0 starts RL from the tiny policy's random weights" in (
        capsys.readouterr().err
    )
    config.sft.steps = 20
    check_values(config)
    assert "warning" not in capsys.readouterr().err


def test_a_policy_earning_nothing_before_rl_is_told_what_to_change(capsys):
    from types import SimpleNamespace

    from streamrl.run.config import RunConfig
    from streamrl.run.prepare import zero_reward_hint
    from streamrl.run.reports import HeldoutEvals

    config = RunConfig()
    config.data.path = "rows.jsonl"
    hint = zero_reward_hint(config)
    assert "sft.tokenizer: char" in hint
    for reward, warned in ((0.0, True), (0.25, False)):
        result = SimpleNamespace(reward=reward)
        evals = HeldoutEvals(lambda service, version, r=result: r, zero_hint=hint)
        evals.run("before", service=None, version=0)
        err = capsys.readouterr().err
        assert ("warning: the policy earns no reward" in err and hint in err) is warned
    evals.run("after", service=None, version=1)  # after RL: the summary says it
    assert "warning" not in capsys.readouterr().err


def test_bench_contention_refuses_nothing_to_time(capsys):
    assert main(["bench", "contention", "--steps", "0"]) == 2
    assert "bench contention: need --steps >= 1" in capsys.readouterr().err
