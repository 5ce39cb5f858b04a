"""Continuous-batching stream generator on vLLM's engine, with ``HFStreamGenerator``'s contract.

StreamRL §3 (stream generation) emits each sample the moment it finishes instead of waiting for
the whole batch; §5 (continuous batching in an SGS instance) keeps the batch full by admitting a
waiting request as soon as a sequence finishes. vLLM's scheduler does the batching and paged KV
cache; this class decides *what* enters the engine, in the order of our own
``AdmissionScheduler`` (FIFO, or longest-predicted-first for §5.3), keeping at most
``batch_limit`` requests inside it.

Why a synchronous ``LLMEngine`` with its core in this process, not ``AsyncLLM`` or a core
process: the generator worker owns the loop (``worker.py``); between two steps it drains its
inbox, applies received weights and releases held requests. ``LLMEngine.step()`` is then exactly
one scheduler + model step, so a weight load lands between two steps with no pause, abort or
restart, running sequences keep their KV cache (as in ``HFStreamGenerator``), and every token is
tagged with the weights that drew it. A core in a process of its own runs steps ahead of the
loop that reads them, which loses both (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The model itself
may span processes: with ``tensor_parallel_size`` > 1 vLLM starts one worker process per rank,
and the new weights reach them all through the instance's staging in shared files
(``weight_staging``, mapped once by every worker, ``vllm_worker``): ``load_weights`` only tells
them to load it, with one ``collective_rpc``; the same path serves one rank in this process.

vLLM APIs used (0.32): ``EngineArgs`` / ``LLMEngine.from_engine_args``, ``add_request`` with a
``TokensPrompt`` (``skip_tokenizer_init``: token ids in, token ids out), ``SamplingParams``
(``ignore_eos``, ``min_tokens = max_tokens`` for forced lengths, ``logprobs=0``, output kind
``DELTA``: each step's new tokens, tagged with the weight version that drew them),
``worker_extension_cls`` (``vllm_worker.StagingLoader``, called through ``collective_rpc``),
``logprobs_mode="processed_logprobs"`` (log-probs after temperature and the
min-tokens EOS mask, what ``HFStreamGenerator`` reports), ``scheduling_policy="priority"`` with
the admission order as priority (if vLLM must preempt for KV space it evicts the latest admitted),
and the worker's ``reload_weights`` for in-place weight updates
(``abort_request`` and a new ``add_request`` re-prefill a running sequence: ``recompute_running``),
``enable_return_routed_experts`` (each token's experts, ``CompletionOutput.routed_experts``, for
routing replay: Model Runner V2 and prefix caching only), and ``TokensPrompt(cache_salt=...)``:
every request is salted with the weight version it enters under, so a cached prompt is shared
by the requests of one version and never reused across a weight update.

Examples:
    Needs vLLM (``make test-vllm`` builds a virtualenv with it) and a model directory:

    >>> gen = VLLMStreamGenerator("runs/policy", max_batch_size=2, greedy=True)  # doctest: +SKIP
    >>> gen.submit([Request(f"p{i}", [5, 6], 4, forced_length=4) for i in "ab"])  # doctest: +SKIP
    >>> [s.length for s in gen.stream()]  # doctest: +SKIP
    [4, 4]
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from streamrl.components.generation.admission import AdmissionQueue, AdmittingGenerator, budget
from streamrl.components.generation.finished import finished_sample
from streamrl.components.generation.moving import generated_before, leaving
from streamrl.components.generation.routed_experts import from_engine
from streamrl.components.generation.sampling import sampling_temperature
from streamrl.components.generation.vllm_engine_start import (
    engine_args,
    routed_experts_wanted,
    start_engine,
)
from streamrl.components.skewness.schedulers import AdmissionScheduler
from streamrl.components.weights.nccl import DEFAULT_BUCKET_BYTES
from streamrl.components.weights.staging import StagedWeights
from streamrl.policy.routing import is_moe_config
from streamrl.records import Request, Sample


@dataclass
class _Admitted:
    """A request inside the engine, with what it generated so far (streamed step by step)."""

    request: Request
    submitted_s: float
    started_s: float
    weight_version: int
    priority: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per generated token, its weights
    recomputed: int = 0  # tokens prefilled again under newer weights (partial rollout)
    added_at: int = 0  # tokens generated before its current vLLM request (moves, recompute)


class VLLMStreamGenerator(AdmittingGenerator):
    """Generate samples with vLLM and emit each one as soon as it finishes.

    StreamRL §3 / §5; same public API and ``Sample`` fields as ``HFStreamGenerator``. A sample's
    ``weight_version`` is the version loaded when it was admitted; a ``load_weights`` between
    steps also applies to the remaining tokens of running sequences (partial rollout, keeping
    their KV cache), and ``token_versions`` says which weights drew each token (the engine
    streams each step's new tokens). ``recompute_running()`` prefills them again under the new
    weights instead: each is aborted and re-added with its tokens so far as prompt. Which
    requests wait, in what order, and how many may be inside the engine is its ``admission``, an
    ``AdmissionQueue``.

    Args:
        model_dir: a Hugging Face model directory (``save_policy`` writes one). vLLM needs no
            tokenizer: prompts and outputs are token ids.
        max_batch_size: most sequences in the engine at once (vLLM's ``max_num_seqs``).
        scheduler: admission order; FIFO if ``None``.
        instance_id: copied into every sample.
        temperature: softmax temperature when sampling.
        greedy: take the argmax instead of sampling.
        seed: vLLM's engine seed (vLLM also seeds this process's global RNGs with it).
        weight_version: version tag of the weights in ``model_dir``.
        device: ``"cpu"`` or ``"cuda"``; must match the installed vLLM build. A GPU is picked
            with ``CUDA_VISIBLE_DEVICES`` for the process, not by an index here (a
            tensor-parallel engine takes the first ``tensor_parallel_size`` visible ones).
        stop_token_ids: more ids that end a sequence, besides the config's eos.
        stop_strings: vLLM's ``stop`` (finish reason ``"stop"``); they make vLLM load the
            model directory's tokenizer to detokenize.
        routed_experts: return the experts every token was routed to
            (``Sample.routed_experts``, for routing replay: ``streamrl.policy.routing``). vLLM
            computes them only in its Model Runner V2 (CUDA: its CPU build has no Triton) and
            with prefix caching, which this turns on. ``None``: on for a mixture of experts on
            CUDA, off otherwise.
        **engine_kwargs: more ``vllm.EngineArgs`` fields (e.g. ``max_model_len``,
            ``enforce_eager``, ``kv_cache_memory_bytes``, ``dtype``,
            ``tensor_parallel_size``); they override ours.

    Raises:
        ConfigError: vLLM is not installed, ``device`` does not match its build,
            multiprocessing was forced on, tensor parallelism on the CPU has fewer cores than
            ranks, or routed experts were asked of the CPU build or of Model Runner V1.
        FileNotFoundError: ``model_dir`` has no ``config.json``.
    """

    #: What a decode step pays for, as ``LatencyModel.load``: paged attention, so a step pays
    #: for the tokens cached.
    context_load = "total"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_size: int = 32,
        scheduler: AdmissionScheduler | None = None,
        instance_id: int = 0,
        temperature: float = 1.0,
        greedy: bool = False,
        seed: int = 0,
        weight_version: int = 0,
        device: str = "cpu",
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        routed_experts: bool | None = None,
        **engine_kwargs: Any,
    ) -> None:
        #: The requests waiting to enter the engine, and how many may be inside it at once.
        self.admission = AdmissionQueue(max_batch_size=max_batch_size, scheduler=scheduler)
        self.temperature = sampling_temperature(temperature, greedy)
        self.greedy = greedy
        self.max_batch_size = max_batch_size
        self.instance_id = instance_id
        self._weight_version = weight_version
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(
                f"No model directory at {str(model_dir)!r} (no config.json there). Pass a "
                "directory written by save_pretrained / streamrl.policy.models.save_policy."
            )
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.routed_experts = routed_experts_wanted(routed_experts, is_moe_config(config), device)
        self.model_dir = Path(model_dir)
        eos = config.eos_token_id
        self._eos = [] if eos is None else [int(e) for e in np.atleast_1d(eos)]
        self._eos += [int(t) for t in stop_token_ids if int(t) not in self._eos]
        self._stop = [s for s in stop_strings if s]
        args = engine_args(
            model_dir,
            config,
            device=device,
            max_batch_size=max_batch_size,
            seed=seed,
            detokenize=bool(self._stop),  # stop strings need vLLM's detokenizer
            routed_experts=self.routed_experts,
            **engine_kwargs,
        )
        self._engine = start_engine(args, device)
        self.context_length = int(self._engine.model_config.max_model_len)
        self._templates = _parameters_on_meta(config, self._engine.model_config.dtype)
        self._staging: StagedWeights | None = None
        self._running: dict[str, _Admitted] = {}  # vLLM request id -> admission record
        self._admitted = 0  # admissions so far: request ids and vLLM priorities

    # ----------------------------------------------------------------- public API
    @property
    def weight_version(self) -> int:
        """Version of the weights held now."""
        return self._weight_version

    @property
    def num_running(self) -> int:
        """Requests inside the engine."""
        return len(self._running)

    def step(self) -> list[Sample]:
        """Admit into free slots, run one engine step, return the samples finished in it."""
        self._admit()
        if not self._running:
            return []
        finished = []
        for out in self._engine.step():
            row = self._running.get(out.request_id)
            if row is None:  # a request aborted by recompute_running, added back under a new id
                continue
            delta = out.outputs[0]
            tokens = list(delta.token_ids)
            row.token_ids += tokens
            # One {token id: Logprob} dict per new token, holding the sampled token.
            row.logprobs += [step[tok].logprob for tok, step in zip(tokens, delta.logprobs)]
            row.versions += [self._weight_version] * len(tokens)
            if out.finished:
                _engine_versions(row, delta)
                finished.append(out)
        now = time.time()
        return [self._to_sample(out, now) for out in finished]

    def recompute_running(self) -> int:
        """Prefill every running sequence again under the weights loaded now (the re-prefill
        policy of partial rollout): abort it and add it back with its prompt plus the tokens it
        generated, for the rest of its budget. Returns the tokens prefilled."""
        rows = list(self._running.items())
        self._engine.abort_request([request_id for request_id, _ in rows])
        self._running = {}
        columns = 0
        for _, row in rows:
            prefix = list(row.request.prompt_ids) + row.token_ids
            row.recomputed += len(prefix)
            columns += len(prefix)
            self._add(row, prefix, budget(row.request) - len(row.token_ids))
        return columns

    def release(self, keys: Collection[tuple]) -> list[Request]:
        """Take the requests with these keys off this instance (they move to another one):
        waiting ones as they are, running ones aborted in the engine and returned with their
        progress (``moving.leaving``). Keys it does not hold are ignored."""
        keys = set(keys)
        moved = self.admission.withdraw(keys)
        rows = [(rid, row) for rid, row in self._running.items() if row.request.key in keys]
        if rows:
            self._engine.abort_request([rid for rid, _ in rows])
        for rid, row in rows:
            del self._running[rid]
            moved.append(leaving(row))
        return moved

    def reprioritize(self, costs: Mapping[tuple, float]) -> int:
        """New admission costs for waiting requests (``AdmissionQueue.reprioritize``)."""
        return self.admission.reprioritize(costs)

    def running_progress(self) -> list[tuple[tuple, int]]:
        """``(key, tokens generated)`` of every request inside the engine, moves included."""
        return [(row.request.key, len(row.token_ids)) for row in self._running.values()]

    def load_weights(
        self, state_dict: Mapping[str, torch.Tensor | np.ndarray], version: int
    ) -> None:
        """Load new weights into the engine in place and set ``weight_version``.

        Keys are the trainer's (Hugging Face) parameter names, all of them: vLLM fuses some
        (q/k/v, gate/up) and re-packs each layer once all its tensors arrived. Names and shapes
        are checked against ``weight_templates()`` before anything is loaded.

        Raises:
            ValueError: a name is unknown or missing, or a shape differs from the template's.
        """
        staging = self.weight_staging()
        if not staging.holds(state_dict.items()):  # not received into the staging: copy in
            checked = dict(self._checked(state_dict))
            with staging.lock:
                staging.fill([(name, checked[name]) for name in self._templates], version)
        self._engine.collective_rpc("streamrl_load")  # every worker, from its mapped staging
        self._weight_version = int(version)

    def weight_staging(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> StagedWeights:
        """The host staging the engine loads from: shared files that vLLM's workers mapped
        (``vllm_worker``), laid out in buckets of ``bucket_bytes``. A generator instance
        receives each version straight into it, so ``load_weights`` of its views copies
        nothing; made on first use (again if the bucket size changes)."""
        if self._staging is None or self._staging.bucket_bytes != bucket_bytes:
            staging = StagedWeights.like(
                self._templates.items(), bucket_bytes=bucket_bytes, shared=True
            )
            try:
                buckets = [
                    (str(path), str(b.dtype).removeprefix("torch."), b.numel)
                    for path, b in zip(staging.files, staging.buckets)
                ]
                self._engine.collective_rpc("streamrl_attach", args=(buckets, staging.layout()))
            finally:
                staging.unlink()  # every worker mapped it (or failed): no file outlives us
            self._staging = staging
        return self._staging

    # vLLM's weight-transfer protocol on this instance (``vllm_protocol.InstancesClient`` makes
    # the calls on every instance of a run): the engine's own calls, through its workers.
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight group (its rank is ``init_info``'s ``rank_offset`` + the
        worker's rank)."""
        self._engine.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        """Open an update: vLLM's layerwise reload takes the tensors that follow."""
        self._engine.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive a version's tensors (blocks while the trainer broadcasts them) and load them
        between two steps: running sequences keep their KV cache (vLLM's ``keep`` pause)."""
        self._engine.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update; from now on tokens are drawn by ``weight_version`` (vLLM tags
        each output with it, and so does ``Sample.token_versions``)."""
        self._engine.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self._engine.set_weight_version(str(weight_version))
            self._weight_version = int(weight_version)

    def loaded_digests(self) -> list[dict[str, str]]:
        """Per worker rank, the digest of every tensor it loaded in the last update that
        asked for digests (``vllm_protocol.verify_digests``)."""
        return self._engine.collective_rpc("streamrl_loaded_digests")

    def weight_digests(self) -> dict[str, str]:
        """The checksums of what rank 0 loaded last (when the update asked for them) and of
        what its model holds now, by the trainer's names (the read-back wins where both
        are)."""
        return {**self.loaded_digests()[0], **self.applied_digests()[0]}

    def applied_digests(self) -> list[dict[str, str]]:
        """Per worker rank, the digests of the weights its model holds now, by the trainer's
        names (those it can read back: ``vllm_protocol.applied_digests``)."""
        return self._engine.collective_rpc("streamrl_applied_digests")

    def weight_templates(self) -> dict[str, torch.Tensor]:
        """The trainer's parameters as ``meta`` tensors: names, shapes and dtypes, in
        ``named_parameters()`` order (the order weights are broadcast in)."""
        return dict(self._templates)

    def close(self) -> None:
        """Shut the engine down (frees its KV cache and distributed state)."""
        self._engine.engine_core.shutdown()

    # ----------------------------------------------------------------- internals
    def _admit(self) -> None:
        now = time.time()
        for req, submitted in self.admission.admit(len(self._running), now):
            row = _Admitted(req, submitted, now, self._weight_version, priority=self._admitted)
            done = req.progress
            if done is not None and done.token_ids:  # moved here: prefill its tokens too
                row.started_s, row.weight_version = done.started_s, done.weight_version
                row.token_ids, row.logprobs = list(done.token_ids), list(done.logprobs)
                row.versions, row.recomputed = list(done.versions), len(done.token_ids)
            prefix = list(req.prompt_ids) + row.token_ids
            self._add(row, prefix, budget(req) - generated_before(req))

    def _add(self, row: _Admitted, prompt_ids: list[int], tokens: int) -> None:
        """Put ``row`` into the engine: ``prompt_ids`` in, at most ``tokens`` more out (its
        admission order is its priority: if vLLM must preempt, the latest goes first)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        forced = row.request.forced_length is not None
        params = SamplingParams(
            # vLLM: 0 means argmax (a greedy request: a held-out evaluation)
            temperature=0.0 if self.greedy or row.request.greedy else self.temperature,
            max_tokens=tokens,
            # Forced: exactly forced_length tokens; min_tokens also masks EOS meanwhile.
            min_tokens=tokens if forced else 0,
            ignore_eos=forced,
            stop_token_ids=self._eos,  # no tokenizer, so vLLM knows EOS only from here
            stop=None if forced else self._stop or None,
            logprobs=0,  # the sampled token's log-prob only
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens: tagged by version
        )
        row.added_at = len(row.token_ids)
        request_id = f"{self.instance_id}-{self._admitted}"
        # A cached prompt's KV is reused within its weight version only (prefix caching).
        prompt = TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=f"w{self._weight_version}")
        self._engine.add_request(request_id, prompt, params, priority=row.priority)
        self._running[request_id] = row
        self._admitted += 1

    def _to_sample(self, out: Any, now: float) -> Sample:
        row = self._running.pop(out.request_id)
        req, completion = row.request, out.outputs[0]
        reasons = {"stop": "eos", "length": "forced" if req.forced_length is not None else "length"}
        if completion.finish_reason not in reasons:
            raise RuntimeError(
                f"vLLM finished request {req.prompt_id!r} with {completion.finish_reason!r}; "
                "only EOS and length stops are expected (check the engine log)."
            )
        # vLLM's stop_reason is the stop string when one ended the sequence.
        stop = isinstance(completion.stop_reason, str)
        reason = "stop" if stop else reasons[completion.finish_reason]
        experts = completion.routed_experts if self.routed_experts else None
        return finished_sample(
            row,
            instance_id=self.instance_id,
            finished_s=now,
            finish_reason=reason,
            routed_experts=from_engine(experts, len(req.prompt_ids) + len(row.token_ids)),
        )

    def _checked(self, state_dict: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        unknown = sorted(state_dict.keys() - self._templates.keys())
        missing = sorted(self._templates.keys() - state_dict.keys())
        if unknown or missing:
            raise ValueError(
                f"load_weights: unknown names {unknown[:5]}, missing names {missing[:5]}; pass "
                "every name of weight_templates() (the trainer's named_parameters) and no other."
            )
        weights = []
        for name, value in state_dict.items():
            tensor = torch.as_tensor(value)
            expected = tuple(self._templates[name].shape)
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects "
                    f"{expected}."
                )
            weights.append((name, tensor))
        return weights


def _engine_versions(row: _Admitted, completion: Any) -> None:
    """Take each token's weight version from vLLM's ``weight_versions`` spans where the
    engine gives them (versions set by ``finish_weight_update``); they cover the tokens of the
    row's current vLLM request."""
    for span in getattr(completion, "weight_versions", None) or []:
        if not str(span.version).isdigit():  # the checkpoint's own label: ours stand
            continue
        start = row.added_at + span.start
        end = min(row.added_at + span.end, len(row.versions))
        row.versions[start:end] = [int(span.version)] * (end - start)


def _parameters_on_meta(config: PretrainedConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The trainer's parameters without memory, in the engine's dtype (what travels): the HF
    model built on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return {name: p.detach() for name, p in model.named_parameters()}
