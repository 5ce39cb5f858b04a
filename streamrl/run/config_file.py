"""YAML files and mappings into a checked ``RunConfig``: unknown keys and wrong types are errors
with a "did you mean" where one fits; values then pass ``streamrl.run.config_checks.check_values``.

Examples:
    >>> cfg = from_dict(RunConfig, {"seed": 3, "rl": {"module": {"lr": 3e-5}}}, where="example")
    >>> cfg.rl.module["lr"]
    3e-05
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from streamrl.components.training.off_policy import OffPolicyCorrection
from streamrl.errors import ConfigError, unknown_name
from streamrl.run.config import RLConfig, RunConfig, TrainerConfig
from streamrl.run.config_checks import check_values
from streamrl.run.swappable import SWAPPABLE

#: Flat ``rl`` keys now one argument of a component's section: key -> (section, argument,
#: whose arguments the section holds; a swappable part's go in its ``init_args``).
#: ``config migrate`` moves them by this table too.
FOLDED_KEYS: dict[str, tuple[str, str, str]] = {
    "reward_workers": ("reward_pool", "workers", "RewardPool"),
    "reward_timeout_s": ("reward_pool", "timeout_s", "RewardPool"),
    "max_reward_restarts": ("reward_pool", "max_restarts", "RewardPool"),
    "start_timeout_s": ("timeouts", "start_s", "Timeouts.for_model"),
    "sample_timeout_s": ("timeouts", "sample_s", "Timeouts.for_model"),
    "heartbeat_timeout_s": ("timeouts", "heartbeat_s", "Timeouts.for_model"),
    "weight_timeout_s": ("timeouts", "weight_s", "Timeouts.for_model"),
    "lora_r": ("lora", "r", "LoRASpec"),
    "lora_alpha": ("lora", "alpha", "LoRASpec"),
    "lora_target_modules": ("lora", "target_modules", "LoRASpec"),
    "is_cap": ("correction", "is_cap", "OffPolicyCorrection"),
    "correct_engine_gap": ("correction", "engine_gap", "OffPolicyCorrection"),
    "weight_transport": ("weights", "transport", "WeightPath"),
    "weight_bucket_mb": ("weights", "bucket_mb", "WeightPath"),
    "weight_fanout": ("weights", "fanout", "WeightPath"),
    "weight_protocol": ("weights", "protocol", "WeightPath"),
    "verify_weights_every": ("weights", "verify_every", "WeightPath"),
    "clip_eps": ("algorithm", "clip_eps", "every Algorithm"),
    "kl_coef": ("algorithm", "kl_coef", "every Algorithm"),
    "max_tokens_per_micro_batch": ("micro_batches", "max_tokens", "DynamicBatchPipeline"),
    "token_budget": ("micro_batches", "max_tokens", "DynamicBatchPipeline"),
    "eval_every": ("eval", "every", "EvalSchedule"),
    "eval_k": ("eval", "k", "EvalSchedule"),
    "eval_max_tokens": ("eval", "max_tokens", "EvalSchedule"),
    "checkpoint_every": ("checkpoints", "every", "CheckpointSchedule"),
    "stop_deadline_s": ("checkpoints", "stop_deadline_s", "CheckpointSchedule"),
    "pack_sequences": ("micro_batches", "packed", "DynamicBatchPipeline"),
    "min_samples": ("micro_batches", "min_samples", "DynamicBatchPipeline"),
    "generators": ("generation", "num_instances", "StreamGenerationService"),
    "gpus": ("generation", "gpus_per_instance", "StreamGenerationService"),
    "max_batch_size": ("generation", "max_batch_size", "StreamGenerationService"),
    "temperature": ("generation", "temperature", "StreamGenerationService"),
    "max_restarts": ("generation", "max_restarts", "StreamGenerationService"),
    "sites": ("generation", "sites", "StreamGenerationService"),
    "trainer_site": ("generation", "trainer_site", "StreamGenerationService"),
    "partial_rollout": ("generation", "partial_rollout", "StreamGenerationService"),
    "mode": ("module", "mode", "StreamRLModule"),
    "lr": ("module", "lr", "StreamRLModule"),
    "staleness_bound": ("module", "staleness_bound", "StreamRLModule"),
    "routing_replay": ("module", "routing_replay", "StreamRLModule"),
    "max_tokens": ("rollouts", "max_tokens", "RolloutStream"),
    "ranker_refresh_every": ("rollouts", "ranker_refresh_every", "RolloutStream"),
    "generator_devices": ("generation", "gpu_ids", "StreamGenerationService"),
}


def section_class(hint: Any) -> type | None:
    """The dataclass a field's type hint holds (``LoRASpec`` of ``LoRASpec | None``), or
    ``None``: a section of the config, or a component's arguments given as one."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _new_place(section: str, name: str, owner: str) -> str:
    """Where a folded key goes: a dataclass's argument is a dotted key (``rl.lora.r``), a
    swappable part's one of its ``init_args``, a mapping's one of its keys."""
    if section in SWAPPABLE:
        return f"rl.{section}'s init_args: {{{name}: ...}} ({owner} takes it)"
    if section_class(typing.get_type_hints(RLConfig)[section]):
        return f"rl.{section}.{name} (rl.{section} holds {owner}'s arguments)"
    return f"rl.{section}: {{{name}: ...}} (rl.{section} holds {owner}'s arguments)"


#: Keys that moved, by section, and where to: a config that still sets one is told so.
MOVED_KEYS: dict[type, dict[str, str]] = {
    RLConfig: {
        "trainer_ranks": "trainer.devices (trainer processes on the CPU, GPUs on CUDA)",
        "max_generators": "rl.elastic's init_args: {max_instances: N} (ElasticController)",
        "share_trainer_gpus": "trainer.share_gpus (the trainer's GPUs shared with generators)",
        **{key: _new_place(*place) for key, place in FOLDED_KEYS.items()},
    },
    OffPolicyCorrection: {"name": "method (rl.correction holds OffPolicyCorrection's arguments)"},
}


def moved_key(where: str, cls: type, key: str) -> str:
    """The message for ``key`` of section ``cls``, which moved (``MOVED_KEYS``), in a file."""
    return (
        f"{where}: {key} has moved: set {MOVED_KEYS[cls][key]} instead (streamrl config "
        "migrate OLD.yaml rewrites a file)."
    )


#: The Lightning Trainer's arguments that ``trainer`` does not take, and what to set instead
#: (``--trainer.max_steps`` and ``--trainer.default_root_dir`` are command-line aliases).
LIGHTNING_TRAINER_ARGS: dict[str, str] = {
    "max_steps": "set rl.iterations (one RL iteration is one optimizer step)",
    "default_root_dir": "set output_dir",
    "max_epochs": "set rl.iterations (an RL run has no epochs; one iteration is one step)",
    "min_steps": "set rl.iterations (the run trains exactly that many)",
    "limit_train_batches": "set rl.iterations (one iteration is one optimizer step)",
    "fast_dev_run": "set rl.iterations: 1",
    "log_every_n_steps": "leave it out: every iteration is logged",
    "logger": "set logger (top level: csv, tensorboard or wandb)",
    "val_check_interval": "set rl.eval.every (iterations between held-out evaluations)",
    "check_val_every_n_epoch": "set rl.eval.every (iterations between held-out evaluations)",
    "enable_checkpointing": "set rl.checkpoints.every (0: a checkpoint only at the end)",
    "enable_progress_bar": "pass --no-progress to draw no progress bars",
    "accumulate_grad_batches": "set rl.micro_batches' max_tokens (all micro-batches of an "
    "iteration accumulate into its one optimizer step)",
    "strategy": "set trainer.devices (several devices shard the policy with FSDP2)",
    "gradient_clip_val": "set rl.module.max_grad_norm (gradients are clipped at norm 1.0 by "
    "default)",
    "deterministic": "set seed",
}


def lightning_trainer_arg(name: str, key: str) -> str:
    """The message for ``name``, a Lightning Trainer argument ``key`` that ``trainer`` lacks."""
    return (
        f"{name} is a Lightning Trainer argument that streamrl fit does not take; "
        f"{LIGHTNING_TRAINER_ARGS[key]}."
    )


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping (``UniqueKeyLoader``)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last
    silently: a second ``rl:`` section would drop the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in lines:
                raise DuplicateKeyError(
                    None,
                    None,
                    f"key {key!r} is given twice (first on line {lines[key] + 1}); YAML would "
                    "keep the second and drop the first: merge them into one",
                    key_node.start_mark,
                )
            lines[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(text: str) -> Any:
    """Parse YAML ``text`` with ``UniqueKeyLoader``."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # a SafeLoader: no arbitrary objects


def read_config_text(path: Path) -> str:
    """The text of config file ``path``.

    Raises:
        ConfigError: it does not exist, is not a regular file (a pipe such as ``<(...)`` is
            read more than once by ``fit``) or is not text.
    """
    if not path.exists():
        raise ConfigError(
            f"Config file {str(path)!r} does not exist. Pass --config with a YAML file, e.g. "
            "configs/demo.yaml."
        )
    if not path.is_file():
        raise ConfigError(
            f"Config file {str(path)!r} is not a regular file (a pipe, such as <(...), or a "
            "folder): streamrl reads the config more than once; write it to a file and pass "
            "that."
        )
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"Config file {str(path)!r} is not a text file (byte {err.start} is not UTF-8): "
            "pass a YAML file, e.g. configs/demo.yaml."
        ) from None


def load_config(path: str | Path | Mapping[str, Any]) -> RunConfig:
    """Read a YAML file, or a mapping in its layout (a script's or notebook's config, where a
    part's ``class_path`` may be the class itself), into a validated ``RunConfig``.

    Raises:
        ConfigError: missing or unreadable file, an unknown key (or one given twice), a wrong
            type or a bad value; the message names the key and the fix.
    """
    data, where = (dict(path), "config") if isinstance(path, Mapping) else _read_file(Path(path))
    config = from_dict(RunConfig, data, where=where)
    check_values(config)
    return config


def _read_file(path: Path) -> tuple[dict[str, Any], str]:
    """A YAML config file's mapping, and its name for messages."""
    try:
        data = read_yaml(read_config_text(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(path)!r} must hold a mapping of keys to values.")
    return data, str(path)


def from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``, checking keys and value types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    moved = MOVED_KEYS.get(cls, {})
    for key, value in data.items():
        if key in moved:
            raise ConfigError(moved_key(where, cls, key))
        if cls is RLConfig and key == "elastic" and isinstance(value, bool):
            raise ConfigError(
                f"{where}: elastic: {str(value).lower()} has become "
                + ("{class_path: controller, init_args: {max_instances: 4}}" if value else "null")
                + " (streamrl config migrate OLD.yaml rewrites a file)."
            )
        if cls is TrainerConfig and key in LIGHTNING_TRAINER_ARGS:
            raise ConfigError(lightning_trainer_arg(f"{where}: {key}", key))
        if key not in hints:
            raise ConfigError(f"{where}: {unknown_name('key', str(key), names)}")
        kwargs[key] = _convert(hints[key], value, f"{where}: {key}")
    if cls.__module__ == RunConfig.__module__:  # a section of ours: its fields say where
        return cls(**kwargs)
    try:  # a component's own arguments (rl.lora: LoRASpec), checked by its constructor
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def _convert(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            what, hint_text = "keys to values", ""
            if hint.__module__ != RunConfig.__module__:  # a component's arguments (rl.weights)
                keys = ", ".join(f.name for f in dataclasses.fields(hint))
                what = f"{hint.__name__}'s arguments ({keys})"
                hint_text = " (streamrl config migrate OLD.yaml rewrites an earlier layout)"
            raise ConfigError(f"{where} must be a mapping of {what}, got {value!r}{hint_text}.")
        return from_dict(hint, value, where)
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        args = tuple(a for a in args if a is not type(None))
        hint = args[0] if len(args) == 1 else typing.Union[args]  # noqa: UP007
        if dataclasses.is_dataclass(hint) and isinstance(value, hint):  # built in Python
            return value
        return _convert(hint, value, where)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # str | dict: a name or options
        for option in typing.get_args(hint):
            if isinstance(value, typing.get_origin(option) or option):
                return value
        names = " or ".join((typing.get_origin(a) or a).__name__ for a in typing.get_args(hint))
        raise ConfigError(f"{where} must be a {names}, got {value!r}.")
    origin = typing.get_origin(hint)
    if origin in (list, tuple):  # a tuple[X, ...] is written as a list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}.")
        return origin(_convert(typing.get_args(hint)[0], v, where) for v in value)
    if origin is dict:  # options passed through to a constructor, checked by it
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping of keys to values, got {value!r}.")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{where} must be of type {hint.__name__}, got {value!r}.")
    return value
