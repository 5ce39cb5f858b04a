"""Run configuration: flat dataclasses that mirror the YAML (at most two levels deep).

The Python constructors are the primary API; YAML files only fill them in. Unknown keys, wrong
types and impossible values are errors with a "did you mean" where one fits, raised before any
work starts.

Examples:
    >>> cfg = RunConfig(seed=3)
    >>> cfg.data.tasks
    ['copy', 'rev', 'count', 'sort']
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from streamrl.components.weights.nccl import import_nccl
from streamrl.components.weights.transport import TRANSPORTS
from streamrl.errors import ConfigError, unknown_name
from streamrl.sft import default_cache_dir
from streamrl.tasks.families import FAMILIES


@dataclass
class DataConfig:
    """Where prompts come from: the built-in tasks, your own dataset, or reasoning-gym.

    Attributes:
        tasks: built-in task families to draw prompts from (see ``streamrl.tasks.FAMILIES``).
        prompt_file: a JSONL file of ``{"prompt", "answer"}`` rows used instead of generated
            prompts (its rows are split into training and held-out sets).
        path: your dataset, any local file or directory ``datasets`` reads (JSONL, JSON, CSV,
            Parquet, a ``save_to_disk`` directory), used instead of the built-in tasks. Every
            column of a row reaches the reward (``streamrl.tasks.local_data``).
        prompt_column: the column holding the prompt (a string, or chat messages).
        answer_column: the column holding the reference answer; ``null`` if there is none.
        id_column: a column of unique prompt ids; ``null`` derives stable ids from the content.
        task_column: a column naming each row's data source (evaluation reports per source);
            ``null``: the file's name.
        split: the split of a ``DatasetDict`` directory to train on (default ``train``).
        heldout_path: a second file (same columns) to evaluate on.
        heldout_split: another split of ``path`` to evaluate on (e.g. ``test``).
        heldout_fraction: a share of ``path``'s rows held out for evaluation (seeded); the
            default when neither ``heldout_path`` nor ``heldout_split`` is given.
        reasoning_gym: reasoning-gym tasks to draw prompts from, scored by their own
            ``score_answer`` (reward ``reasoning_gym``): a list of names or ``{name: {config}}``
            (``streamrl.tasks.reasoning_gym``); ``n_train`` / ``n_heldout`` rows each.
        system_prompt: a system message put before every prompt (chat-templated tokenizers).
        chat_template: apply the tokenizer's chat template to string prompts: ``null`` does
            when the tokenizer has one; chat-message prompts always use it.
        stop_strings: generation stops after any of these, and the reward sees the text before.
        n_train: prompts in the training set.
        n_heldout: prompts in the held-out evaluation set (no prompt shared with training).
        median_len: median answer length in characters.
        tail: weight of the long tail (log-normal sigma of answer lengths).
        max_len: longest answer in characters.
    """

    tasks: list[str] = field(default_factory=lambda: list(FAMILIES))
    prompt_file: str | None = None
    path: str | None = None
    prompt_column: str = "prompt"
    answer_column: str | None = "answer"
    id_column: str | None = None
    task_column: str | None = None
    split: str | None = None
    heldout_path: str | None = None
    heldout_split: str | None = None
    heldout_fraction: float | None = None
    reasoning_gym: list[str] | dict[str, Any] | None = None
    system_prompt: str | None = None
    chat_template: bool | None = None
    stop_strings: list[str] = field(default_factory=list)
    n_train: int = 2048
    n_heldout: int = 256
    median_len: int = 6
    tail: float = 0.8
    max_len: int = 48


@dataclass
class WarmStartConfig:
    """The SFT warm start of a built-in tiny policy (see ``streamrl.sft.SFTConfig``).

    Attributes:
        model_size: ``"test"`` (~150K parameters) or ``"demo"`` (~1M parameters).
        steps: optimizer steps; 0 skips the warm start (the policy stays random).
        lr: peak learning rate.
        demo_noise: share of demonstrations with one typo.
        early_stop: share of demonstrations (of ``early_stop_tasks``) that stop one item early:
            a systematic flaw of the demonstrator that RL, rewarded by the verifier, can fix.
        early_stop_tasks: the tasks whose demonstrator has that flaw.
        tokens_per_batch: padded tokens per SFT step.
        tokenizer: the tiny policy's tokenizer on your own data (``data.path`` or
            ``data.reasoning_gym``): ``"bpe"`` (byte-level BPE with a ChatML template, trained
            on the training rows) or ``"char"`` (one id per character of the data, no template:
            what character-level tasks such as spelling backwards learn best).
        demo_share: on your own data, the share of the training rows the warm start learns
            from, set apart from the rows RL trains on (a seeded split), as a real pipeline
            keeps its SFT data apart from its RL prompts; ``None``: SFT on every training row,
            RL on the same rows (which the policy then partly knows by heart).
    """

    model_size: str = "demo"
    steps: int = 1800
    lr: float = 1e-3
    tokens_per_batch: int = 1024
    tokenizer: str = "bpe"
    demo_noise: float = 0.3
    early_stop: float = 0.6
    early_stop_tasks: list[str] = field(default_factory=lambda: ["copy", "count", "sort"])
    demo_share: float | None = None


@dataclass
class RLConfig:
    """The disaggregated RL loop.

    Attributes:
        algorithm: ``"grpo"``, ``"rloo"``, ``"reinforce++"``, ``"reinforce++-baseline"``, ``"ppo"``,
            ``"dapo"`` (docs/algorithms.md) or your ``Algorithm`` subclass as
            ``package.module:Name``; a mapping ``{name: ..., option: value}`` passes options to
            it (``streamrl.run_parts``).
        mode: ``"sync"`` (each step trains on samples of the current weights, as they stream
            in), ``"async"`` (StreamRL's one-step asynchronous mode: the next step's samples are
            generated while this step trains; a sample is at most one weight version stale) or
            ``"colocated"`` (the baseline: all samples first, then training on every core).
        iterations: optimizer steps (one per iteration); 0 only warm-starts and evaluates.
        prompts_per_iteration: prompts dealt per iteration.
        group_size: samples per prompt.
        generators: generator instances (one process or Ray actor each).
        engine: the generation engine: ``"hf"`` (continuous batching on ``transformers``),
            ``"vllm"`` (vLLM's engine; the ``[vllm]`` extra; ``{name: vllm, options: {...}}``
            passes engine arguments) or your ``GenerationEngine`` as ``package.module:Name``.
        cluster: where generator instances run: ``"local"`` (processes of this machine) or
            ``"ray"`` (Ray actors on the cluster ``RAY_ADDRESS`` names, or a local one; the
            ``[ray]`` extra).
        gpus: GPUs per generator instance; 0 generates on the CPU.
        sites: the site (datacenter) of each generator instance, in order, e.g. ``[home, cloud,
            cloud]``; an instance at a site other than ``trainer_site`` receives the weights from
            its site's first instance, so one copy per version crosses to each site (§6). Empty:
            every generator beside the trainer.
        trainer_site: the trainer's site.
        trainer_ranks: trainer processes sharing the policy with FSDP2 (``streamrl.fsdp``); rank
            0 runs the generation service and deals each micro-batch to the ranks. 1 trains in
            this process.
        weight_transport: how weights reach each generator: ``"gloo"`` (a broadcast per
            tensor), ``"bucketed"`` (tensors packed into large buffers) or ``"nccl"`` (buckets
            GPU to GPU through CuPy's NCCL; needs CuPy and GPUs).
        max_batch_size: batch slots per generator instance.
        lr: policy learning rate (AdamW).
        clip_eps: PPO clip range.
        kl_coef: KL penalty to the starting policy; 0 disables it.
        is_cap: truncation of the importance ratio that corrects samples from older weights in
            async mode (decoupled PPO with truncated IS, docs/algorithms.md).
        reward: the task reward: a built-in (``"exact"``, ``"partial"``, ``"math"`` (math-verify),
            ``"reward_model"`` (``{name: reward_model, path: DIR}``), ``"reasoning_gym"``), or
            your function ``fn(completion, row) -> float`` as ``package.module:function`` (``row``
            is the prompt's whole dataset row; batched and async forms work too); a list of
            ``{name: ..., weight: ...}`` sums several, each logged on its own
            (``streamrl.rewards.spec``).
        reward_workers: processes that compute rewards off the trainer's critical path; 0
            computes them in the trainer.
        reward_timeout_s: the most one reward call may take; past it the run stops with an
            error naming the prompt.
        eval_every: evaluate on the held-out set every this many iterations with the run's
            reward (logged as ``eval/*`` and plotted to ``eval.png``); 0: only before and after.
        eval_k: samples per held-out prompt for pass@k (1: greedy pass@1 only).
        temperature: sampling temperature of the generators.
        max_tokens: generation budget per sample (capped by the context).
        token_budget: padded tokens per micro-batch of the dynamic-batch pipeline.
        min_samples: samples gathered before an iteration's first backward pass.
        dispatcher: which instance gets which prompt: ``"skew"`` (Algorithm 2 on predicted
            lengths, §5.3), ``"round_robin"``, ``"random"`` or your ``Dispatcher``.
        scheduler: admission order inside an instance: ``"lpt"`` (longest predicted first,
            §5.3), ``"fifo"`` or your ``AdmissionScheduler`` class.
        length_predictor: predicts output lengths for dispatch and LPT, trained online on the
            policy's samples (§5.2): ``"ranker"`` (``LengthRanker``), your ``LengthPredictor``,
            or ``null`` (no predictions: skew dispatch balances prompt counts, LPT is FIFO).
        ranker_refresh_every: iterations between online refreshes of the ranker.
        elastic: add generator instances while training runs when generation lags training
            by more than one more instance would save (§4.2), up to ``max_generators``.
        max_generators: the most generator instances elastic scaling may reach.
        max_restarts: failed generator instances replaced before the run stops.
        lora_r: LoRA rank of the policy's adapters; 0 trains the full model. With LoRA only the
            adapters train and only they are sent to the generators (docs/lora.md).
        lora_alpha: LoRA scaling numerator (scale = alpha / r).
        lora_target_modules: module-name suffixes that get adapters.
        checkpoint_every: iterations between checkpoints (``<output_dir>/checkpoints/last.ckpt``,
            resumable with ``streamrl fit --resume``); 0 saves only at the end.
    """

    algorithm: str | dict[str, Any] = "grpo"
    mode: str = "sync"
    iterations: int = 60
    prompts_per_iteration: int = 32
    group_size: int = 8
    generators: int = 2
    engine: str | dict[str, Any] = "hf"
    cluster: str = "local"
    gpus: int = 0
    weight_transport: str = "gloo"
    sites: list[str] = field(default_factory=list)
    trainer_site: str = "local"
    trainer_ranks: int = 1
    max_batch_size: int = 64
    lr: float = 1e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    is_cap: float = 2.0
    reward: str | dict[str, Any] | list[Any] = "exact"
    reward_workers: int = 1
    reward_timeout_s: float = 60.0
    eval_every: int = 0
    eval_k: int = 1
    temperature: float = 0.7
    max_tokens: int = 64
    token_budget: int = 1024
    min_samples: int = 1
    dispatcher: str | dict[str, Any] = "skew"
    scheduler: str | dict[str, Any] = "lpt"
    length_predictor: str | dict[str, Any] | None = "ranker"
    ranker_refresh_every: int = 10
    elastic: bool = False
    max_generators: int = 4
    max_restarts: int = 3
    checkpoint_every: int = 10
    lora_r: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


#: Lightning loggers a run can write to, and the package each needs.
LOGGERS = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb"}


@dataclass
class RunConfig:
    """Everything ``streamrl fit`` needs.

    Attributes:
        model: ``"tiny"`` builds (and warm-starts) the built-in tiny policy; anything else is a
            local Hugging Face model directory.
        seed: seeds data, initialisation and sampling.
        output_dir: where logs, metrics and checkpoints go.
        logger: ``"csv"`` (default), ``"tensorboard"`` or ``"wandb"`` (the last two need their
            package installed; offline W&B runs are written under ``output_dir``).
        cache_dir: where warm-started policies are cached; ``None`` means ``$STREAMRL_CACHE`` or
            ``~/.cache/streamrl``.
        data: the prompt sets.
        sft: the warm start (used when ``model`` is ``"tiny"``).
        rl: the RL loop.
    """

    model: str = "tiny"
    seed: int = 0
    output_dir: str = "runs/demo"
    logger: str = "csv"
    cache_dir: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    sft: WarmStartConfig = field(default_factory=WarmStartConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        return default_cache_dir()


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML file into a validated ``RunConfig``.

    Raises:
        ConfigError: missing or unreadable file, an unknown key, a wrong type or a bad value;
            the message names the key and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"Config file {str(path)!r} does not exist. Pass --config with a YAML file, e.g. "
            "configs/demo.yaml."
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(path)!r} must hold a mapping of keys to values.")
    config = from_dict(RunConfig, data, where=str(path))
    check_values(config)
    return config


def from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``, checking keys and value types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            raise ConfigError(f"{where}: {unknown_name('key', str(key), names)}")
        kwargs[key] = _convert(hints[key], value, f"{where}: {key}")
    return cls(**kwargs)


def _convert(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping of keys to values, got {value!r}.")
        return from_dict(hint, value, where)
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        args = tuple(a for a in args if a is not type(None))
        hint = args[0] if len(args) == 1 else typing.Union[args]  # noqa: UP007
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # str | dict: a name or options
        for option in typing.get_args(hint):
            if isinstance(value, typing.get_origin(option) or option):
                return value
        names = " or ".join((typing.get_origin(a) or a).__name__ for a in typing.get_args(hint))
        raise ConfigError(f"{where} must be a {names}, got {value!r}.")
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}.")
        return [_convert(typing.get_args(hint)[0], v, where) for v in value]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{where} must be of type {hint.__name__}, got {value!r}.")
    return value


def check_values(config: RunConfig) -> None:
    """Check values that types alone cannot (ranges, names); raises ``ConfigError``."""
    data, sft = config.data, config.sft
    check_data_source(data)
    if not (data.prompt_file or data.path or data.reasoning_gym):
        if not data.tasks:
            raise ConfigError(f"data.tasks is empty; choose from {sorted(FAMILIES)}.")
        for task in data.tasks:
            if task not in FAMILIES:
                raise ConfigError(f"data.tasks: {unknown_name('task', task, FAMILIES)}")
    if data.n_train < 1 or data.n_heldout < 1:
        raise ConfigError(
            f"data.n_train and data.n_heldout must be >= 1 (an empty prompt set has nothing to "
            f"train or evaluate on), got {data.n_train} and {data.n_heldout}."
        )
    if not 1 <= data.median_len <= data.max_len or data.tail < 0:
        raise ConfigError(
            "data: need 1 <= median_len <= max_len and tail >= 0, got "
            f"median_len={data.median_len}, max_len={data.max_len}, tail={data.tail}."
        )
    if sft.tokenizer not in ("bpe", "char"):
        raise ConfigError(
            f"sft.tokenizer: {unknown_name('tokenizer', sft.tokenizer, ['bpe', 'char'])}"
        )
    if sft.model_size not in ("test", "demo"):
        raise ConfigError(
            f"sft.model_size: {unknown_name('size', sft.model_size, ['test', 'demo'])}"
        )
    if config.logger not in LOGGERS:
        raise ConfigError(f"logger: {unknown_name('logger', config.logger, LOGGERS)}")
    needed = LOGGERS[config.logger]
    if needed is not None and importlib.util.find_spec(needed) is None:
        raise ConfigError(f"logger: {config.logger!r} needs {needed!r}: pip install {needed}")
    check_rl(config.rl)
    if sft.steps < 0 or sft.lr <= 0 or not 0 <= sft.demo_noise <= 1 or not 0 <= sft.early_stop <= 1:
        raise ConfigError(
            "sft: need steps >= 0, lr > 0, 0 <= demo_noise <= 1 and 0 <= early_stop <= 1, got "
            f"steps={sft.steps}, lr={sft.lr}, demo_noise={sft.demo_noise}, "
            f"early_stop={sft.early_stop}."
        )
    if sft.demo_share is not None and not 0 < sft.demo_share < 1:
        raise ConfigError(
            f"sft.demo_share: need a share strictly between 0 and 1 (or null), got "
            f"{sft.demo_share}."
        )
    for task in sft.early_stop_tasks:
        if task not in FAMILIES:
            raise ConfigError(f"sft.early_stop_tasks: {unknown_name('task', task, FAMILIES)}")


def check_data_source(data: DataConfig) -> None:
    """One source of prompts, and held-out options only where they apply; ``ConfigError``."""
    sources = [k for k in ("prompt_file", "path", "reasoning_gym") if getattr(data, k)]
    if len(sources) > 1:
        raise ConfigError(
            f"data: {' and '.join(sources)} are both set; choose one source of prompts."
        )
    heldout = [k for k in ("heldout_path", "heldout_split", "heldout_fraction") if getattr(data, k)]
    if heldout and not data.path:
        raise ConfigError(f"data.{heldout[0]} applies to data.path only; set data.path too.")
    if len(heldout) > 1:
        raise ConfigError(f"data: {' and '.join(heldout)} are both set; choose one held-out set.")
    if data.heldout_fraction is not None and not 0 < data.heldout_fraction < 1:
        raise ConfigError(
            f"data.heldout_fraction must be between 0 and 1, got {data.heldout_fraction}."
        )


def check_trainer_ranks(rl: RLConfig) -> None:
    """What a sharded trainer (``rl.trainer_ranks > 1``) does not support yet; ``ConfigError``."""
    if rl.trainer_ranks < 1:
        raise ConfigError(f"rl.trainer_ranks must be >= 1, got {rl.trainer_ranks}.")
    if rl.trainer_ranks == 1:
        return
    if rl.eval_every > 0:  # a sharded policy runs forward on all ranks together
        raise ConfigError(
            f"rl.eval_every={rl.eval_every} evaluates on one trainer rank, but "
            f"rl.trainer_ranks={rl.trainer_ranks} shards the policy; set rl.eval_every: 0 (the "
            "held-out evaluation after training still runs) or train on one rank."
        )
    if rl.lora_r > 0:  # an algorithm that cannot shard says so itself (Algorithm.shardable)
        raise ConfigError(
            f"rl.trainer_ranks={rl.trainer_ranks} (FSDP2) does not support rl.lora_r > 0 yet; "
            "use rl.trainer_ranks: 1 with LoRA."
        )


def check_rl(rl: RLConfig) -> None:
    """Check the RL section; raises ``ConfigError``."""
    if rl.mode not in ("sync", "async", "colocated"):
        raise ConfigError(
            f"rl.mode: {unknown_name('mode', rl.mode, ['sync', 'async', 'colocated'])}"
        )
    positive = dict(
        prompts_per_iteration=rl.prompts_per_iteration,
        generators=rl.generators,
        max_batch_size=rl.max_batch_size,
        max_tokens=rl.max_tokens,
        token_budget=rl.token_budget,
        min_samples=rl.min_samples,
        ranker_refresh_every=rl.ranker_refresh_every,
    )
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"rl.{name} must be >= 1, got {value}.")
    if rl.gpus < 0:
        raise ConfigError(f"rl.gpus must be >= 0 (0 generates on the CPU), got {rl.gpus}.")
    if rl.reward_workers < 0 or rl.reward_timeout_s <= 0 or rl.eval_every < 0 or rl.eval_k < 1:
        raise ConfigError(
            "rl: need reward_workers >= 0 (0 = in the trainer), reward_timeout_s > 0, "
            f"eval_every >= 0 and eval_k >= 1, got reward_workers={rl.reward_workers}, "
            f"reward_timeout_s={rl.reward_timeout_s}, eval_every={rl.eval_every}, "
            f"eval_k={rl.eval_k}."
        )
    if rl.lora_r < 0:
        raise ConfigError(f"rl.lora_r must be >= 0 (0 = full fine-tuning), got {rl.lora_r}.")
    check_trainer_ranks(rl)
    if rl.sites and len(rl.sites) != rl.generators:
        raise ConfigError(
            f"rl.sites names {len(rl.sites)} sites for rl.generators={rl.generators} instances; "
            "give one site per generator, or none."
        )
    if rl.weight_transport not in TRANSPORTS:
        raise ConfigError(
            f"rl.weight_transport: {unknown_name('transport', rl.weight_transport, TRANSPORTS)}"
        )
    if rl.weight_transport == "nccl":
        try:
            import_nccl()
        except ConfigError as err:
            raise ConfigError(f"rl.weight_transport: {err}") from err
    if rl.lora_r > 0:
        from streamrl.lora import LoRASpec

        LoRASpec(rl.lora_r, rl.lora_alpha, 0.0, tuple(rl.lora_target_modules))  # ConfigError
    if rl.checkpoint_every < 0:
        raise ConfigError(f"rl.checkpoint_every must be >= 0, got {rl.checkpoint_every}.")
    if rl.max_generators < rl.generators or rl.max_restarts < 0:
        raise ConfigError(
            f"rl: need max_generators >= generators and max_restarts >= 0, got "
            f"max_generators={rl.max_generators}, generators={rl.generators}, "
            f"max_restarts={rl.max_restarts}."
        )
    if rl.iterations < 0 or rl.group_size < 1:
        raise ConfigError(
            f"rl: need iterations >= 0 and group_size >= 1, got iterations={rl.iterations}, "
            f"group_size={rl.group_size}."
        )
    if rl.is_cap < 1:
        raise ConfigError(f"rl.is_cap must be >= 1 (a truncation of ratios), got {rl.is_cap}.")
    if rl.lr <= 0 or rl.temperature <= 0 or rl.clip_eps <= 0 or rl.kl_coef < 0:
        raise ConfigError(
            "rl: need lr > 0, temperature > 0, clip_eps > 0 and kl_coef >= 0, got "
            f"lr={rl.lr}, temperature={rl.temperature}, clip_eps={rl.clip_eps}, "
            f"kl_coef={rl.kl_coef}."
        )
