"""Run configuration: flat dataclasses that mirror the YAML (at most two levels deep).

The Python constructors are the primary API; YAML files only fill them in
(``streamrl.run.config_file.load_config``), and ``streamrl.run.config_checks.check_values`` checks
what types alone cannot, before any work starts.

Examples:
    >>> cfg = RunConfig(seed=3)
    >>> cfg.data.tasks
    ['copy', 'rev', 'count', 'sort']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.components.training.off_policy import OffPolicyCorrection
from streamrl.components.weights.path import WeightPath
from streamrl.eval.schedule import EvalSchedule
from streamrl.policy.lora import LoRASpec
from streamrl.policy.sft import default_cache_dir
from streamrl.tasks.families import FAMILIES
from streamrl.training.checkpointing import CheckpointSchedule


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
        prompt_column: the column holding the prompt (a string, or chat messages); an episode
            run's rows (``env.name``) may have none: its environment's ``reset`` gives the first
            prompt (rows without ``id_column`` get ids from their whole content).
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
    """The SFT warm start of a built-in tiny policy (see ``streamrl.policy.sft.SFTConfig``).

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
        cache: reuse a warm start made earlier from the same rows, code and settings
            (``streamrl.runtime.cache_keys``); ``false`` (``streamrl fit --no-cache``) trains
            afresh.
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
    cache: bool = True


#: The settings that hold one fixed component's constructor arguments: its import path, and
#: the arguments the run links in (each with where it comes from), which the section may not set.
CONSTRUCTOR_SECTIONS: dict[str, tuple[str, dict[str, str]]] = {
    "generation": (
        "streamrl.components.generation.service.StreamGenerationService",
        {
            "model_dir": "the run's policy",
            "engine": "set rl.engine",
            "scheduler": "set rl.scheduler",
            "dispatcher": "set rl.dispatcher",
            "greedy": "the run samples, at temperature",
            "seed": "set seed",
            "timeouts": "set rl.timeouts",
            "status_path": "<output_dir>/instances.json",
            "cluster": "set rl.cluster",
            "ray": "set rl.cluster: {class_path: ray, init_args: {...}}",
            "weights": "set rl.weights",
            "profile_latency": "measured when a part uses PTL(BS)",
            "stop_token_ids": "the tokenizer's end of turn",
            "stop_strings": "set data.stop_strings",
            "trainer_device": "the trainer's first GPU (trainer.devices)",
        },
    ),
    "reward_pool": (
        "streamrl.rewards.pool.RewardPool",
        {
            "specs": "set rl.reward",
            "status_path": "<output_dir>/reward_workers.json",
            "faults_path": "<output_dir>/reward_faults.jsonl",
        },
    ),
    "timeouts": (
        "streamrl.components.generation.timeouts.Timeouts.for_model",
        {"model_bytes": "the policy's size", "max_tokens": "set rl.rollouts.max_tokens"},
    ),
    "micro_batches": (
        "streamrl.components.training.pipeline.DynamicBatchPipeline",
        {
            "staleness_bound": "it follows the mode (0 in sync mode); set "
            "rl.module.staleness_bound for async mode instead"
        },
    ),
    "rollouts": (
        "streamrl.training.rollout.RolloutStream",
        {
            "service": "the run's generation service (set rl.generation)",
            "prompts": "the run's rows, rl.prompts_per_iteration at a time",
            "tokenizer": "the policy's",
            "algorithm": "set rl.algorithm",
            "reward": "set rl.reward (and rl.reward_pool)",
            "context": "the policy's context length",
            "trace": "the run's timeline",
            "forced_lengths": "streamrl bench pipeline forces lengths; a run does not",
            "ranker": "set rl.length_predictor",
            "system_prompt": "set data.system_prompt",
            "chat_template": "set data.chat_template",
            "stop_strings": "set data.stop_strings",
            "sampler": "the run's kind (env.name: episodes)",
            "episodes": "the run's kind (env.name: episodes)",
        },
    ),
    "module": (
        "streamrl.training.module.StreamRLModule",
        {
            "policy": "the run's policy (model)",
            "algorithm": "set rl.algorithm",
            "rollouts": "the run's stream of samples",
            "iterations": "set rl.iterations",
            "reference": "made for the algorithm's KL penalty (rl.algorithm's kl_coef)",
            "temperature": "set rl.generation.temperature (the trainer scores at the "
            "generators' temperature)",
            "pipeline": "set rl.micro_batches",
            "trace": "the run's timeline",
            "elastic": "set rl.elastic",
            "correction": "set rl.correction",
            "logprob_chunk_tokens": "set trainer.logprob_chunk_tokens",
        },
    ),
}


@dataclass
class RLConfig:
    """The disaggregated RL loop.

    The swappable parts (``algorithm``, ``engine``, ``cluster``, ``dispatcher``, ``scheduler``,
    ``length_predictor``, ``elastic``) take a built-in's short name, your class's import path
    (``package.module.Name``) or ``{class_path: ..., init_args: {...}}`` with its constructor's
    arguments, and are held in that last form (``streamrl.run.swappable``).

    Attributes:
        algorithm: ``"grpo"``, ``"rloo"``, ``"reinforce++"``, ``"reinforce++-baseline"``, ``"ppo"``,
            ``"dapo"`` (docs/algorithms.md) or your ``Algorithm`` subclass
            (``package.module.Name``); ``{class_path: dapo, init_args: {clip_eps_high: 0.3}}``
            passes arguments to its constructor: every algorithm takes ``clip_eps`` (PPO's clip
            range, 0.2) and ``kl_coef`` (the KL penalty to the starting policy; 0, the default,
            disables it and keeps no reference copy); the group size, generation budget and
            the policy's hidden size are linked in (``Algorithm.from_run``).
        module: the trainer's LightningModule, ``StreamRLModule``'s arguments
            (``streamrl.training.module``, whose docstring describes each; ``{}``: its
            defaults): ``mode`` (``"sync"``, the default: each step trains on samples of the
            current weights, as they stream in; ``"async"``: StreamRL's asynchronous mode, the
            next step's samples generated while this step trains; ``"colocated"``: the
            baseline, all samples first, then training on every core), ``staleness_bound``
            (async mode: iterations generated ahead, k >= 1, so no trained token is more than k
            weight versions old; ``null``: 1, the paper's one-step mode), ``lr`` (AdamW),
            ``max_grad_norm`` (the gradient's clip) and ``routing_replay`` (a mixture-of-experts
            policy trains each token on the experts its generator chose; ``null``: on for a
            mixture of experts; either way the share of tokens routed otherwise is logged as
            ``routing_mismatch_frac``). The policy, algorithm, stream, iterations, temperature,
            micro-batches, correction and elastic controller are linked in.
        iterations: optimizer steps (one per iteration), at least 1.
        prompts_per_iteration: prompts dealt per iteration.
        group_size: samples per prompt.
        rollouts: the stream of scored samples the trainer consumes, ``RolloutStream``'s
            arguments (``streamrl.training.rollout``; ``{}``: its defaults): ``max_tokens`` (a
            sample's generation budget, 64; capped by the context; an episode's per turn),
            ``ranker_refresh_every`` (iterations between online refreshes of the length
            predictor, §5.2) and ``max_refills`` (groups an algorithm filters out, e.g. DAPO's
            dynamic sampling, replaced by new prompts per iteration; ``null``: twice the prompts
            per iteration). The service, prompts, tokenizer, algorithm, reward, context,
            length predictor and data's chat settings are linked in.
        generation: the stream generation service (§3), ``StreamGenerationService``'s
            arguments (``streamrl.components.generation.service``, whose docstring describes
            each; ``{}``: its defaults, the demo's): ``num_instances`` (generator processes or
            Ray actors), ``max_batch_size`` (batch slots per instance), ``temperature`` (the
            trainer scores tokens under it too), ``gpus_per_instance`` (0: the CPU; more: vLLM
            tensor-parallel ranks), ``gpu_ids`` (the GPU indices local instances take,
            round-robin; ``null``: every GPU the trainer does not hold, ``trainer.devices``; a
            GPU either trains or generates, an overlap is refused unless
            ``trainer.share_gpus``), ``max_restarts``, ``sites`` and ``trainer_site`` (one
            weight copy per remote site, §6), ``partial_rollout`` (``finish``, or in async mode
            ``keep`` / ``recompute``: docs/partial_rollout.md). The model, engine, dispatcher,
            scheduler, cluster, weight path, timeouts and stop tokens are linked in from the
            rest of the config.
        engine: the generation engine: ``"hf"`` (continuous batching on ``transformers``),
            ``"vllm"`` (vLLM's engine; the ``[vllm]`` extra; ``{class_path: vllm, init_args:
            {options: {...}}}`` passes engine arguments) or your ``GenerationEngine``
            (``package.module.Name``).
        cluster: where generator instances run: ``"local"`` (processes of this machine),
            ``"ray"`` (Ray actors on the cluster ``RAY_ADDRESS`` names, or a local one; the
            ``[ray]`` extra; ``{class_path: ray, init_args: {address: ..., num_cpus: ...}}``
            passes ``RayOptions``), or your ``Cluster`` (``package.module.Name``).
        weights: how each weight version reaches the generators, ``WeightPath``'s arguments
            (``streamrl.components.weights.path``; ``{}``: its defaults): ``transport``
            (``gloo``, host memory; ``nccl``, GPU to GPU through CuPy; or yours),
            ``bucket_mb`` (the largest bucket a version travels in: about the extra device
            memory of a sync), ``fanout`` (instances each instance passes a version on to; 1:
            a chain), ``protocol`` (vLLM instances take each version through vLLM's
            weight-transfer protocol; needs ``engine: vllm`` and ``partial_rollout`` keep or
            recompute), ``verify_every`` (versions every instance checks against the trainer's
            checksums once loaded: ``null`` the first, 0 none, N every N-th;
            docs/weight_transfer.md).
        timeouts: the generator instances' timeouts, ``Timeouts.for_model``'s arguments (the
            policy's size and ``max_tokens`` linked in); each one left out takes a default
            scaled to the policy (``streamrl.components.generation.timeouts``): ``start_s`` (an
            instance starts and loads the model), ``sample_s`` (the longest wait for the next
            sample), ``heartbeat_s`` (an instance silent this long is taken as hung: killed,
            replaced), ``weight_s`` (the longest one weight transfer may take: past it the
            instance is replaced and its requests requeued).
        correction: how the trainer corrects tokens its policy did not sample (stale ones; with
            ``engine_gap``, every token: the generators' numerics are not the trainer's),
            ``OffPolicyCorrection``'s arguments (``{method: icepop, low: 0.5}``, ``{is_cap:
            3.0}``; ``{}``: its defaults, decoupled PPO with truncated IS; docs/algorithms.md).
        reward: the task reward: a built-in (``"exact"``, ``"partial"``, ``"math"`` (math-verify),
            ``"reward_model"`` (``{name: reward_model, path: DIR}``), ``"reasoning_gym"``), or
            your function ``fn(completion, row) -> float`` as ``package.module:function`` (``row``
            is the prompt's whole dataset row; batched and async forms work too); a list of
            ``{name: ..., weight: ...}`` sums several, each logged on its own
            (``streamrl.rewards.spec``). ``null`` (the default): ``exact``; an episode run
            (``env.name``) takes none, its environment's ``step`` rewards each episode, so a
            reward set there is refused rather than silently unused.
        reward_pool: ``RewardPool``'s arguments (``streamrl.rewards.pool``; the rewards and
            the output files are linked in; ``{}``: its defaults): ``workers``, processes that
            compute rewards off the trainer's critical path (0: in the trainer); ``timeout_s``,
            the most one reward call may take (past it the worker is killed and replaced; the
            held-out evaluation, which scores in the trainer, stops the run naming the prompts);
            ``max_restarts``, workers replaced after a death or a timeout before the run stops
            (a completion whose scoring takes down two workers is a reward fault: left out of
            the loss, counted as ``samples_reward_fault``, written to
            ``<output_dir>/reward_faults.jsonl``); ``max_batch``; ``start_timeout_s``.
        eval: the held-out evaluations, ``EvalSchedule``'s arguments
            (``streamrl.eval.schedule``; ``{}``: its defaults): ``every`` (iterations between
            evaluations with the run's reward, logged as ``eval/*`` and plotted to ``eval.png``;
            0: only before and after RL), ``k`` (samples per held-out prompt for pass@k; 1:
            greedy pass@1 only), ``max_tokens`` (a held-out completion's budget, cut to what the
            context leaves; ``null``: ``rollouts.max_tokens``). Evaluations decode on the generator
            instances, with the engine, chat handling and reward of training
            (docs/real-models.md, "Evaluation on the generators").
        micro_batches: how streamed samples become the trainer's micro-batches,
            ``DynamicBatchPipeline``'s arguments (``streamrl.components.training.pipeline``;
            the staleness bound linked in from ``mode``; ``{}``: its defaults): ``max_tokens``,
            the most tokens (prompt + completion) one forward/backward pass takes, a ceiling no
            micro-batch exceeds (a longer sample forms its own; padded tokens count when rows
            are padded); ``min_samples``, samples gathered before an iteration's first backward
            pass; ``packed``: unset or ``true``, a micro-batch's samples go end to end in one
            row, the trainer's attention attending within each sample without a mask
            (``streamrl.policy.varlen_attention``; flash-attention on CUDA when installed): 1.4x
            padded rows' tokens/s on the demo's micro-batches, 12x on a long-tailed one
            (``streamrl bench packing``); ``false``: padded rows.
        dispatcher: which instance gets which prompt: ``"skew"`` (Algorithm 2 on predicted
            lengths, §5.3), ``"adaptive"`` (length distributions, group context, moves
            mid-flight: ``AdaptiveDispatcher``), ``"round_robin"``, ``"random"`` or your
            ``Dispatcher``.
        scheduler: admission order inside an instance: ``"lpt"`` (longest predicted first,
            §5.3), ``"fifo"`` or your ``AdmissionScheduler`` class.
        length_predictor: predicts output lengths for dispatch and LPT, trained online on the
            policy's samples (§5.2): ``"ranker"`` (``LengthRanker``), your ``LengthPredictor``,
            or ``null`` (no predictions: skew dispatch balances prompt counts, LPT is FIFO).
        elastic: add generator instances while training runs when generation lags training
            by more than one more instance would save (§4.2): ``controller``
            (``ElasticController``; ``{class_path: controller, init_args: {max_instances: 4,
            threshold: 1.0}}``: its arguments, the measured ``PTL(BS)`` and the batch slots
            linked in) or your class; ``null`` (the default): a fixed number of instances.
        checkpoints: when checkpoints are written, ``CheckpointSchedule``'s arguments
            (``streamrl.training.checkpointing``; ``{}``: its defaults): ``every`` (iterations
            between checkpoints, ``<output_dir>/checkpoints/last.ckpt``, resumable with
            ``streamrl fit --resume``; 0: only at the end; a run stopped by SIGTERM or Ctrl-C
            saves its finished iterations there too), ``stop_deadline_s`` (the most seconds a
            stopped run spends on that save: keep it under your scheduler's grace period, e.g.
            SLURM's ``KillWait``; past it the save is abandoned and the previous checkpoint
            stays; ``null``: no limit).
        save_rollouts: write what each iteration trained on, one row per trained sample (an
            episode in a multi-turn run: token ids, loss mask, per-token weight versions and
            behaviour log-probs, reward and its parts, advantage, finish reason, instance), to
            ``<output_dir>/rollouts/iteration-000007.parquet`` (``streamrl.training.rollout_files``;
            filtered groups are not trained, so not written; docs/getting-started.md).
        lora: the policy's LoRA adapters, ``LoRASpec``'s arguments (``{r: 8, alpha: 16.0,
            dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj]}``; ``{}``: its
            defaults); only the adapters train, and only they are sent to the generators
            (docs/lora.md). ``null`` (the default): the full model trains.
    """

    algorithm: str | dict[str, Any] = "grpo"
    module: dict[str, Any] = field(default_factory=dict)
    iterations: int = 60
    prompts_per_iteration: int = 32
    group_size: int = 8
    rollouts: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)
    engine: str | dict[str, Any] = "hf"
    cluster: str | dict[str, Any] = "local"
    weights: WeightPath = field(default_factory=WeightPath)
    timeouts: dict[str, Any] = field(default_factory=dict)
    correction: OffPolicyCorrection = field(default_factory=OffPolicyCorrection)
    reward: str | dict[str, Any] | list[Any] | None = None
    reward_pool: dict[str, Any] = field(default_factory=dict)
    eval: EvalSchedule = field(default_factory=EvalSchedule)
    micro_batches: dict[str, Any] = field(default_factory=dict)
    dispatcher: str | dict[str, Any] = "skew"
    scheduler: str | dict[str, Any] = "lpt"
    length_predictor: str | dict[str, Any] | None = "ranker"
    elastic: str | dict[str, Any] | None = None
    checkpoints: CheckpointSchedule = field(default_factory=CheckpointSchedule)
    save_rollouts: bool = False
    lora: LoRASpec | None = None

    def __post_init__(self) -> None:
        """Hold each swappable part in one spelling, ``{class_path, init_args}`` with the full
        import path (``streamrl.run.swappable``): a reference that does not import, or an
        unknown name, fails here, before any work."""
        from streamrl.run.swappable import SWAPPABLE, canonical

        for key in SWAPPABLE:
            setattr(self, key, canonical(key, getattr(self, key)))

    def arg(self, section: str, name: str) -> Any:
        """Argument ``name`` of a constructor's section (``CONSTRUCTOR_SECTIONS``: ``module``,
        ``generation``...) as the component is built with it: the value set, else the
        constructor's default (the one place that default lives)."""
        from streamrl.run.swappable import default_of
        from streamrl.runtime.references import resolve

        options = getattr(self, section)
        if name in options:
            return options[name]
        owner = resolve(CONSTRUCTOR_SECTIONS[section][0], kind="class", builtins={}, where=section)
        return default_of(owner, name)


@dataclass
class TrainerConfig:
    """Where and how the trainer runs: its devices, precision and memory savers (docs/fsdp.md,
    docs/memory.md).

    Attributes:
        accelerator: ``"auto"`` (CUDA when a GPU is visible, else the CPU), ``"cpu"`` or
            ``"cuda"``.
        devices: on the CPU, trainer processes; on CUDA, a number of GPUs (``0..n-1``) or a
            list of GPU indices (``[0, 1, 2, 3]``); the generators take the GPUs the trainer
            does not (``rl.generation.gpu_ids``). Several ranks shard the policy with FSDP2:
            rank 0 runs the generation service and deals each micro-batch to the ranks.
            ``null``: one.
        num_nodes: machines the trainer ranks run on (under ``torchrun`` or SLURM).
        precision: ``"bf16-mixed"`` (bf16 compute over fp32 FSDP2 shards, fp32 gradient
            reduction and optimizer; the default on CUDA) or ``"32-true"`` (the default on the
            CPU); ``null``: by accelerator.
        activation_checkpointing: keep only each decoder layer's input in the forward pass and
            recompute the layer in the backward pass (less memory, about a third more compute);
            ``null``: on CUDA, off on the CPU.
        share_gpus: let generator instances run on the trainer's GPUs too (a one-GPU machine
            or a check; both then share the GPU's memory): ``rl.generation.gpu_ids`` may then
            overlap ``devices``, and by default the generators take every GPU.
        reference_offload: keep the KL reference policy's shards in host memory, copied to the
            device layer by layer (the algorithm's ``kl_coef > 0`` only; a LoRA run needs no
            reference copy).
        logprob_chunk_tokens: completion tokens per chunk of the LM head when the trainer
            computes log-probs (``streamrl.policy.logprobs``); ``null``: 64M logits per chunk.
        sharded_checkpoints: several ranks write a checkpoint as a folder of their own shards
            (``torch.distributed.checkpoint``), so no rank gathers the full weights and
            optimizer state (``false``: one file written by rank 0, whose host memory then
            holds them whole: 16 bytes per parameter with AdamW, refused before training when
            that would not fit it); ``null``: sharded with more than one rank.
        save_dtype: the dtype of the trained policy written to ``<output_dir>/policy``:
            ``auto`` (the model directory's: bfloat16 for a released model), ``bfloat16``,
            ``float16`` or ``float32``. It is written tensor by tensor from the shards.
        collective_timeout_s: how long a collective of the trainer ranks (FSDP2's gathers,
            checkpoint writes) waits for the others before the run fails; ``null``: 300 s plus
            30 s per GB of the policy's weights.
        prepare_timeout_s: how long launched ranks (torchrun, SLURM) wait for rank 0 to prepare
            the policy, start the generators and evaluate; ``null``: 1800 s plus 120 s per GB.
        share_timeout_s: how long a trainer rank > 0 waits for its next share of samples (rank
            0 waits for the generators, and evaluates every ``rl.eval.every``); ``null``: 900 s
            plus 0.2 s per token of ``rl.rollouts.max_tokens`` per GB.
    """

    accelerator: str = "auto"
    devices: int | list[int] | None = None
    num_nodes: int = 1
    precision: str | None = None
    activation_checkpointing: bool | None = None
    reference_offload: bool = False
    share_gpus: bool = False
    logprob_chunk_tokens: int | None = None
    sharded_checkpoints: bool | None = None
    save_dtype: str = "auto"
    collective_timeout_s: float | None = None
    prepare_timeout_s: float | None = None
    share_timeout_s: float | None = None


@dataclass
class EnvConfig:
    """Multi-turn episodes (``streamrl.envs``): each sample is an episode of an environment.

    Attributes:
        name: ``null`` for single completions (the default); a built-in environment
            (``calculator``: a multiplication tool; ``blackjack``: gymnasium's game as text), or
            ``package.module:Name`` for yours (a class or factory of ``Environment`` s).
        options: keyword arguments of your environment's constructor.
        max_turns: model turns per episode (the episode is cut, flagged ``max_turns``).
        timeout_s: the longest one environment ``reset`` or ``step`` may take (a step past it
            ends its episode, flagged ``env_timeout``; a ``reset`` past it stops the run).
        on_fault: what training does with an episode the environment cut (``env_timeout``):
            ``drop`` (default) leaves it out of the loss, its group scored over its other
            episodes (refilled, like a filtered group, when fewer than the algorithm's minimum
            are left), counted as ``samples_env_fault`` in the summary; ``train`` trains it
            with the reward it had (usually 0). Cuts the policy causes (``max_turns``,
            ``context``) are always trained.
        rebalance_requests: move an episode's next turn off its instance when it has this many
            more requests open than the least loaded one (``null``: never).
        workers: processes the environments run in (``streamrl.envs.workers``): one that dies
            or hangs is replaced and its episodes start again from their prompts; 0: threads
            of the trainer. ``null`` (default): 2 for your environment, 0 for the built-in
            (pure-Python) ones. Their pids are in ``<output_dir>/env_workers.json``.
        max_restarts: env workers replaced before the run stops.
        demonstrations: ``package.module:fn``, ``fn(row) -> [turn text, ...]``: the good
            episodes the tiny policy warm-starts on (the built-in environments bring theirs).
        n_train / n_heldout: the rows a built-in environment makes (yours come from
            ``data.path``).
    """

    name: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    timeout_s: float = 30.0
    on_fault: str = "drop"
    rebalance_requests: int | None = None
    workers: int | None = None
    max_restarts: int = 10
    demonstrations: str | None = None
    n_train: int = 2000
    n_heldout: int = 200


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
        trainer: where and how the trainer runs (devices, precision, memory).
        env: multi-turn episodes instead of single completions (``env.name``).
    """

    model: str = "tiny"
    seed: int = 0
    output_dir: str = "runs/demo"
    logger: str = "csv"
    cache_dir: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    sft: WarmStartConfig = field(default_factory=WarmStartConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        return default_cache_dir()
