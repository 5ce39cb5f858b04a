"""``StreamRLModule``: the LightningModule whose training step consumes the sample stream.

One Lightning step is one RL iteration, read top to bottom: stream scored groups from the
generation service, back-propagate each group the moment it completes (gradients accumulate, so
arrival order does not change the update), take one optimizer step, push the new weights to the
generators (synchronous mode, StreamRL §4.1). Lightning drives the loop, so its callbacks,
loggers and checkpoints keep working.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Literal

import lightning as L
import torch
from torch.utils.data import IterableDataset
from transformers import PreTrainedModel

from streamrl.algorithms.base import Algorithm, LossInputs
from streamrl.components.capacity.elastic import ElasticController
from streamrl.components.training.layout import Layout, layout_batch, layout_for
from streamrl.components.training.off_policy import (
    Correction,
    OffPolicyCorrection,
    correction_metrics,
    token_lag_metrics,
    token_lags,
)
from streamrl.components.training.pipeline import DynamicBatchPipeline, MicroBatch
from streamrl.components.training.reference import FrozenCopy, ReferencePolicy
from streamrl.components.training.staleness import AheadWindow, staleness_bound_of
from streamrl.components.weights.staging import StagedWeights
from streamrl.components.weights.sync import stage
from streamrl.errors import NonFiniteLossError, unknown_name
from streamrl.policy.logprobs import completion_logprobs
from streamrl.policy.lora import synced_weights
from streamrl.policy.model_dir import is_empty, materialize, source_dir
from streamrl.policy.routing import RoutingReplay, is_moe, routing_metrics
from streamrl.records import Sample
from streamrl.runtime.cores import free_cores
from streamrl.runtime.peak_memory import peak_memory_bytes
from streamrl.runtime.stopping import reclaim_signals, shielded
from streamrl.training.reward_signal import RewardSpreadCheck
from streamrl.training.rollout import RolloutStream
from streamrl.training.run_state import load_run_state, save_run_state
from streamrl.training.timeline import TraceRecorder

Mode = Literal["sync", "async", "colocated"]
MODES: tuple[str, ...] = ("sync", "async", "colocated")


class IterationTicker(IterableDataset):
    """Yields iteration numbers; the real data arrives through the module's ``RolloutStream``.

    Lightning prefetches a batch ahead; prefetching a number is harmless, whereas prefetching
    samples would generate the next iteration with stale weights.
    """

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    def __iter__(self):
        return iter(range(self.iterations))


class StreamRLModule(L.LightningModule):
    """Trains ``policy`` with ``algorithm`` on samples streamed by ``rollouts``.

    Args:
        policy: the causal LM being trained (its weights are pushed to the generators).
        algorithm: scoring and loss hooks (e.g. ``GRPO``).
        rollouts: the iteration-by-iteration stream of scored groups (``None`` only on the
            FSDP trainer ranks that receive their share from rank 0, see
            ``streamrl.training.fsdp``).
        iterations: optimizer steps to run.
        lr: AdamW learning rate.
        max_grad_norm: gradient clipping.
        reference: the frozen reference policy of a KL penalty (``streamrl.components.
            training.reference``; a plain model is held as a ``FrozenCopy``), or ``None``
            when the algorithm needs none (``needs_reference``; else ``ValueError``).
        temperature: the generators' sampling temperature; the trainer scores tokens under the
            same tempered distribution, so behaviour and current log-probs are comparable.
        mode: ``"sync"`` (step k trains on samples of weights k, streamed as they finish),
            ``"async"`` (StreamRL's one-step asynchronous mode: step k+1 is generated while step
            k trains, and the weight transfer overlaps the next step) or ``"colocated"`` (the
            baseline of §7: generation and training time-share the cores, one after the other:
            all samples first, then training with every core).
        pipeline: micro-batching and staleness policy (``DynamicBatchPipeline``; ``None``: its
            defaults, a ceiling of 1024 tokens); what it leaves unset is linked in here: the
            staleness bound of ``mode`` and the layout the policy's attention trains fastest:
            ``"packed"`` (samples end to end in one row, no padding) under a variable-length
            attention, else ``"padded"`` (``streamrl.components.training.layout.layout_for``);
            the module trains with that linked copy (``DynamicBatchPipeline.linked``), as
            ``self.pipeline``.
        trace: records spans for the timeline (bounded); the rollouts' recorder if ``None``.
        elastic: decides after each iteration whether generation needs another instance
            (§4.2); the service adds it while training goes on.
        staleness_bound: async only: k >= 1 iterations generated ahead, so no trained token is
            more than k versions old (``staleness.AheadWindow``; ``None``: 1, the paper's).
        correction: how tokens the policy did not sample are corrected: stale ones, and with
            its ``engine_gap`` (by default on unless the generators and the trainer both
            compute in float32, decided when training starts) every token
            (``streamrl.components.training.off_policy.OffPolicyCorrection``; ``None``: its
            defaults, decoupled PPO with the ratio truncated at 2).
        logprob_chunk_tokens: completion tokens per chunk of the LM head
            (``streamrl.policy.logprobs``); ``None``: 64M logits per chunk.
        routing_replay: a mixture-of-experts policy computes each token on the experts its
            generator chose (``Sample.routed_experts``; ``streamrl.policy.routing``), with gate
            weights from the current router; ``None``: on for a mixture of experts. Either way
            the share of tokens whose experts the trainer would choose otherwise is logged
            (``train/routing_mismatch_frac``).
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        algorithm: Algorithm,
        rollouts: RolloutStream | None,
        iterations: int,
        *,
        lr: float = 1e-4,
        max_grad_norm: float = 1.0,
        reference: ReferencePolicy | torch.nn.Module | None = None,
        temperature: float = 1.0,
        mode: Mode = "sync",
        pipeline: DynamicBatchPipeline | None = None,
        trace: TraceRecorder | None = None,
        elastic: ElasticController | None = None,
        staleness_bound: int | None = None,
        correction: OffPolicyCorrection | None = None,
        logprob_chunk_tokens: int | None = None,
        routing_replay: bool | None = None,
    ) -> None:
        super().__init__()
        bound = self.check_settings(
            lr=lr, max_grad_norm=max_grad_norm, mode=mode, staleness_bound=staleness_bound
        )
        self.automatic_optimization = False
        scoring = getattr(rollouts, "algorithm", algorithm)
        if scoring is not algorithm:  # it scores the samples and this takes the loss: one object
            raise ValueError(
                f"The rollout stream scores with {type(scoring).__name__}, the module would "
                f"train with {type(algorithm).__name__}: a run's advantages and loss come from "
                "one algorithm; pass the same object to RolloutStream and build_module."
            )
        self.policy, self.algorithm, self.rollouts = policy, algorithm, rollouts
        if isinstance(reference, torch.nn.Module):
            reference = FrozenCopy(reference)
        if reference is None and algorithm.needs_reference:
            raise ValueError(
                f"{type(algorithm).__name__} needs a frozen reference policy (its KL penalty: "
                "needs_reference), and none was given: build the module with "
                "streamrl.build_module(policy, rollouts=rollouts, iterations=...), which makes it, "
                "or pass reference=streamrl.components.training.reference.reference_policy("
                "policy, True). Without it the KL term would be silently left out."
            )
        # Not a submodule: Lightning neither moves it (it may be sharded, or offloaded) nor
        # checkpoints it (it is the starting policy, rebuilt on resume).
        self.reference: ReferencePolicy | None = reference
        pipeline = pipeline or DynamicBatchPipeline()
        self.pipeline = pipeline.linked(bound, packed=layout_for(policy) == "packed")
        #: How a micro-batch goes through the forward pass; the pipeline's ceiling counts the
        #: same tokens.
        self.layout: Layout = "padded" if self.pipeline.padded else "packed"
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.iterations, self.lr, self.max_grad_norm = iterations, lr, max_grad_norm
        self.weight_version, self.temperature, self.mode = 0, temperature, mode
        self.staleness_bound = bound
        self.correction = correction or OffPolicyCorrection()
        moe = is_moe(policy)
        self.routing_replay = moe if routing_replay is None else routing_replay
        if self.routing_replay and not moe:
            raise ValueError(
                f"routing_replay=True, but {type(policy).__name__} routes no token to experts "
                "(not a mixture of experts); leave it unset."
            )
        #: Replays (or, off, measures) the generators' expert choices; ``None`` if dense.
        self.routing = RoutingReplay(policy, check=self.routing_replay) if moe else None
        if trace is None:
            trace = rollouts.trace if rollouts is not None else TraceRecorder()
        self.trace = trace
        self.history: list[dict] = []
        self.reward_spread = RewardSpreadCheck()  # warns when the first iterations cannot learn
        self.elastic = elastic
        self.off_policy: list[Correction] = []  # this iteration's corrections, for the log
        self.samples_trained = 0
        #: Of those, the ones back-propagated in the iteration under way (its optimizer step
        #: not done yet): a checkpoint written now counts them as not trained (``run_state``).
        self.samples_in_step = 0
        #: ``pipeline.dropped_stale`` once the last optimizer step was done (for checkpoints).
        self.dropped_stale_settled = 0
        #: This iteration's micro-batches as trained (rank 0 with FSDP: every rank's), kept only
        #: once a list is set here (``streamrl.training.rollout_files.RolloutRecorder`` does).
        self.trained_batches: list[MicroBatch] | None = None
        #: The last iteration's ``trained_batches`` once its optimizer step is done, until the
        #: recorder takes them: (iteration, micro-batches). Settled with the step, so that a
        #: stop landing after the step (whose checkpoint counts the iteration) still has them.
        self.settled_batches: tuple[int, list[MicroBatch]] | None = None
        #: This iteration's loss so far: the sum of its micro-batches' scaled losses (detached).
        self.iteration_loss = torch.zeros(())
        self.sync_transfer_s = 0.0  # seconds spent broadcasting weights, background included
        self._window = AheadWindow(bound, iterations)  # async: iterations dispatched ahead
        self.token_lags: dict[int, int] = {}  # this iteration's trained tokens by staleness
        self.grad_norm = torch.zeros(())  # of the last optimizer step, before clipping
        #: This iteration's summed entropy of the trained tokens' distributions, and their count.
        self.entropy_sum, self.entropy_tokens = torch.zeros(()), torch.zeros(())
        #: This iteration's (sum |trainer - generator| log-prob, trained tokens, tokens routed
        #: otherwise than recorded, tokens recorded), and the run's (``routing_metrics``).
        self.gap_stats, self.gap_totals = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
        #: Each trainer rank's peak memory over the run (``streamrl.runtime.peak_memory``), at its
        # end.
        self.peak_memory_bytes: list[int] = []
        self.trained_on = "cpu"

    @staticmethod
    def check_settings(
        *, lr: float, max_grad_norm: float, mode: str, staleness_bound: int | None
    ) -> int:
        """The module's own settings checked (its constructor calls this, and so does a
        config's check, before any work): returns the staleness bound ``mode`` trains under.

        Raises:
            ValueError: an unknown mode, a bound the mode cannot keep, a step size <= 0.
        """
        if mode not in MODES:
            raise ValueError(unknown_name("mode", mode, MODES))
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}.")
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 (the gradient clip), got {max_grad_norm}.")
        return staleness_bound_of(mode, staleness_bound)

    def training_step(self, batch: int) -> None:
        """One RL iteration, stage by stage: dispatch, stream and score, micro-batch backward
        (``train_on_stream``), optimizer step, weight sync."""
        del batch  # the ticker's number; the iteration is the weight version (survives resume)
        iteration = self.weight_version
        started = time.perf_counter()
        self.iteration_loss = torch.zeros((), device=self.device)
        self.entropy_sum = torch.zeros((), device=self.device)
        self.entropy_tokens = torch.zeros((), device=self.device)
        self.gap_stats = torch.zeros(4, device=self.device)
        self.samples_in_step = 0
        train_s = self.train_on_stream(iteration)
        with shielded():  # a stop (SIGTERM, Ctrl-C) waits: weights and version change together
            train_s += self.optimizer_step(iteration)
            self.weight_version += 1
            self.samples_in_step = 0
            self.dropped_stale_settled = self.pipeline.dropped_stale
            if self.rollouts is not None:
                self.rollouts.trained(iteration)
            if self.trained_batches is not None:
                self.settled_batches, self.trained_batches = (iteration, self.trained_batches), []
        if self.rollouts is None:  # a trainer rank without the service (FSDP ranks > 0)
            self.stage_weights()  # joins the sending rank's gathers
            return
        sync_s = self.sync_weights(iteration)
        self.log_iteration(iteration, time.perf_counter() - started, train_s, sync_s)
        if self.elastic is not None:
            self._scale(train_s)

    def train_on_stream(self, iteration: int) -> float:
        """Dispatch the iteration, then back-propagate its samples micro-batch by micro-batch as
        they stream in, scored on arrival (dynamic-batch pipelining, §4.1); returns the seconds
        spent training."""
        train_s, total = 0.0, self.rollouts.samples_per_iteration
        groups = self.rollouts.groups(self.dispatch(iteration))
        if self.mode == "colocated":  # time-sharing: every sample first, then training
            groups = list(groups)
        threads = torch.get_num_threads()
        try:
            for micro in self.pipeline.micro_batches(groups, self.weight_version):
                if self.mode == "colocated":  # the generators are idle: every free core
                    torch.set_num_threads(free_cores())
                train_s += self.backward_micro(micro, iteration, 1.0 / total)
                self.samples_trained += len(micro.samples)
                self.samples_in_step += len(micro.samples)
                if self.trained_batches is not None:
                    self.trained_batches.append(micro)
        finally:
            torch.set_num_threads(threads)
        if (factor := self.left_out_factor()) != 1.0:
            self.rescale_gradients(factor)
        return train_s

    def left_out_factor(self) -> float:
        """What the iteration's loss is scaled by once its stream is over, so that it is the
        mean over the samples the groups have: ``total / (total - left out)`` when the sampler
        left samples out (episodes the environment cut, ``Sampler.left_out``), else 1."""
        total, left_out = self.rollouts.samples_per_iteration, self.rollouts.stats.left_out
        return total / (total - left_out) if 0 < left_out < total else 1.0

    def rescale_gradients(self, factor: float) -> None:
        """Multiply the accumulated gradients (and this iteration's loss) by ``factor``: the
        micro-batches were scaled by ``1 / samples_per_iteration`` before the stream knew
        that some samples would be left out of their groups."""
        params = [*self.policy.parameters(), *self.algorithm.trainable_parameters()]
        for param in params:
            if param.grad is not None:
                param.grad.mul_(factor)
        self.iteration_loss *= factor

    def dispatch(self, iteration: int) -> int:
        """Send the prompts of the rollout iteration this step trains on; returns its number.

        Async (§4.1) looks ahead, here and nowhere else: iterations up to ``iteration + k``
        (k = ``staleness_bound``) are sent now, iteration ``j`` admitted at weights >= ``j - k``
        (``AheadWindow``), so the generators work on them while this step trains.
        """
        if self.mode != "async":
            return self.rollouts.dispatch(min_weight_version=self.weight_version)
        return self._window.next(iteration, lambda v: self.rollouts.dispatch(min_weight_version=v))

    def optimizer_step(self, iteration: int) -> float:
        """Clip the accumulated gradients and step; returns the seconds it took."""
        started = time.perf_counter()
        optimizer = self.optimizers()
        with self.trace.span("trainer", "step", iteration):
            params = self.policy.parameters()
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    def sync_weights(self, iteration: int) -> float:
        """Stage the new weights and send them to the generators; returns the seconds the
        trainer was blocked.

        Sync mode waits until every instance holds them; async only starts the transfer, which
        overlaps the next step (§4.1).
        """
        service, started = self.rollouts.service, time.perf_counter()
        with self.trace.span("trainer", "sync", iteration, version=self.weight_version):
            staged = self.stage_weights()
            if self.mode == "async":
                service.push_weights(staged, self.weight_version)
            else:
                service.update(staged, self.weight_version)
        return time.perf_counter() - started

    def stage_weights(self) -> StagedWeights | None:
        """Stage this version for the generators, tensor by tensor, into the weight sync's
        host copy in the wire dtype (``stage``; a collective when the policy is sharded:
        every rank calls it); ``None`` on a rank without the service."""
        sync = self.rollouts.service.weight_sync if self.rollouts is not None else None
        named, version = self.weights_to_sync(), self.weight_version
        return stage(named, sync, version, self.wire_dtype(), self.weights_root())

    def weights_root(self) -> int | None:
        """The trainer rank that sends the weights (``None``: each rank sends its own)."""
        return 0

    def wire_dtype(self) -> torch.dtype | None:
        """The dtype weights travel in: the generators' engine dtype (``None``: the policy's)."""
        sync = self.rollouts.service.weight_sync if self.rollouts is not None else None
        return sync.dtype if sync is not None else None

    def backward_micro(self, micro: MicroBatch, iteration: int, scale: float) -> float:
        """One forward/backward of ``micro`` with its summed loss times ``scale`` (gradients
        accumulate until the iteration's optimizer step); returns the seconds it took.

        An empty ``micro`` (an FSDP rank with nothing left this round) runs a two-token pass
        whose loss counts nothing: the ranks' collectives must match.
        """
        started = time.perf_counter()
        if not micro.samples:
            micro, scale = MicroBatch([_idle_sample(self.weight_version)], [0.0]), 0.0
        with self.trace.span("trainer", "train", iteration, samples=len(micro.samples)):
            per_sample = self.algorithm.loss(self.loss_inputs(micro))  # [micro]
            _check_finite(per_sample, micro.samples, iteration)
            loss = per_sample.sum() * scale
            self.manual_backward(loss)
            self.iteration_loss += loss.detach()
        return time.perf_counter() - started

    def weights_to_sync(self) -> list[tuple[str, torch.Tensor]]:
        """What the generators receive, ``(name, tensor)`` in order: the policy's parameters,
        or only its adapters (LoRA); a sharded policy's are ``DTensor`` s, gathered one by one
        when staged."""
        weights = synced_weights(self.policy)
        named = weights.named_parameters() if isinstance(weights, torch.nn.Module) else weights
        return list(named.items() if isinstance(named, dict) else named)

    def _scale(self, train_s: float) -> None:
        """Elastic generation (§4.2): one more instance when generation lags training."""
        service, stats = self.rollouts.service, self.rollouts.stats
        running = sum(i.state in ("starting", "joining", "active") for i in service.instances())
        prompts = stats.prompt_tokens
        prompt_tokens = sum(prompts) / len(prompts) if prompts else 0.0
        decision = self.elastic.observe(
            stats.generate_s, train_s, running, stats.lengths, prompt_tokens
        )
        if decision.action == "add":
            for _ in range(decision.instances - running):
                service.add_instance()  # joins once it holds the current weights
        elif decision.action == "remove":
            for _ in range(running - decision.instances):
                service.remove_instance()  # finishes what it holds, then stops
        self.history[-1]["elastic/instances"] = float(decision.instances)
        self.history[-1]["elastic/delta_s"] = decision.delta_s
        self.history[-1]["elastic/delta_prime_s"] = decision.delta_prime_s

    def configure_model(self) -> None:
        self.place_weights()

    def place_weights(self) -> None:
        """Put the policy and its reference on the trainer's device: a policy still on the meta
        device (``streamrl.policy.model_dir.empty_model``) is filled from its directory, each
        rank reading only its own shards (a collective when sharded); so is the reference."""
        device = self.trainer.strategy.root_device
        if is_empty(self.policy):
            materialize(self.policy, source_dir(self.policy), device)
        if isinstance(self.reference, FrozenCopy):
            self.reference.place(device)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_run_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        load_run_state(self, checkpoint)

    def on_train_start(self) -> None:
        reclaim_signals()  # a stop is this run's to handle, not Lightning's (``stopping``)
        with shielded():  # collectives when sharded: a stop waits until every rank is done
            if self.correction.engine_gap is None:  # both in float32: the same numbers
                wire, compute = self.wire_dtype(), getattr(self, "precision", "32-true")
                gap = wire not in (None, torch.float32) or compute != "32-true"
                self.correction = dataclasses.replace(self.correction, engine_gap=gap)
            # A resumed run starts new generator processes from the model directory: give them
            # the checkpoint's weights before any prompt is dispatched.
            if self.weight_version > 0:
                staged = self.stage_weights()  # a collective when sharded: every rank calls it
                if self.rollouts is not None:
                    self.rollouts.service.update(staged, self.weight_version)

    def on_train_end(self) -> None:
        self.peak_memory_bytes = [peak_memory_bytes(self.device)]
        self.trained_on = self.device.type  # Lightning may move the module back to the CPU after
        # Leave the generators on the final weights (async pushes may still be in flight).
        if self.rollouts is None:
            return
        service = self.rollouts.service
        if service.weight_sync is not None:
            service.wait_weights(self.weight_version)
            self.sync_transfer_s = service.weight_sync.transfer_s

    def loss_inputs(self, batch: MicroBatch) -> LossInputs:
        """Lay a micro-batch out for the forward pass (``self.layout``) and compute current (and
        reference) log-probs, chunk by chunk (``streamrl.policy.logprobs``), the critic's values (if
        the algorithm has one) and the correction of stale tokens."""
        pad = int(self.policy.config.pad_token_id or 0)
        b = layout_batch(batch.samples, self.layout, pad, self.device)
        if self.routing is not None:  # armed until the next micro-batch: a backward pass's
            self.routing.arm(b.experts, apply=self.routing_replay)  # recomputation replays too
        chunk = self.logprob_chunk_tokens
        scored = completion_logprobs(
            self.policy, b.tokens, self.temperature, chunk_tokens=chunk, entropy=True
        )
        ref = None
        if self.reference is not None:  # after the policy: FSDP2 first sees it train (LoRA)
            ref = b.per_sample(self.reference.logprobs(b.tokens, self.temperature, chunk))
        current = b.per_sample(scored.logprobs)  # [batch, width]
        mismatched, compared = self.routing.take_mismatch() if self.routing else (0, 0)
        gap = ((current.detach() - b.behaviour).abs() * b.mask).sum()
        self.gap_stats += torch.stack(
            [gap, b.mask.sum().to(gap.dtype), *gap.new_tensor([mismatched, compared])]
        )
        self.entropy_sum += (b.per_sample(scored.entropy) * b.mask).sum()
        self.entropy_tokens += b.mask.sum()
        values = None
        if self.algorithm.has_critic:  # its own forward pass, over padded rows
            rows = b.padded(pad)
            values = self.algorithm.token_values(
                self.policy, rows.input_ids, rows.attention, rows.starts, b.width
            )
        # Per token: a partial rollout's or an episode's tokens may come from several versions.
        stale = b.versions < self.weight_version
        if self.correction.every_token:  # the generators' numerics are not ours
            stale = torch.ones_like(stale)
        token_lags(b.versions, b.mask, self.weight_version, into=self.token_lags)
        advantages = torch.tensor(batch.advantages, dtype=current.dtype, device=self.device)
        fix = self.correction.correct(current, b.behaviour, b.mask, stale, advantages)
        if fix.stale_samples:
            self.off_policy.append(fix)
        return LossInputs(
            logprobs=current * b.mask,
            old_logprobs=fix.old_logprobs,
            advantages=advantages,
            mask=b.mask,
            ref_logprobs=ref,
            values=values,
            token_weights=fix.weights,
        )

    def log_iteration(self, iteration: int, wall_s: float, train_s: float, sync_s: float) -> None:
        stats, lags = self.rollouts.stats, self.pipeline.staleness
        metrics = {
            "rollout/reward": sum(stats.rewards) / max(1, len(stats.rewards)),
            # each of the run's rewards on its own, unweighted (the line above is their sum)
            **{f"reward/{k}": sum(v) / len(v) for k, v in stats.reward_parts.items() if v},
            "rollout/tokens": float(stats.tokens),
            "perf/samples_per_s": stats.samples / wall_s,
            "time/iteration_s": wall_s,
            "time/generate_s": stats.generate_s,
            "time/wait_s": stats.wait_s,
            "time/train_s": train_s,
            "train/loss": float(self.iteration_loss),
            "train/grad_norm": float(self.grad_norm),
            "train/entropy": float(self.entropy_sum / self.entropy_tokens.clamp(min=1)),
            "train/weight_version": float(self.weight_version),
            "train/staleness_mean": sum(lags) / max(1, len(lags)),
            "train/staleness_max": float(max(lags, default=0)),
            **correction_metrics(self.off_policy),
            **routing_metrics(self.gap_stats, moe=self.routing is not None),
            **token_lag_metrics(self.token_lags),
            "train/dropped_stale": float(self.pipeline.dropped_stale),
            "time/sync_exposed_s": sync_s,
            "time/sync_transfer_total_s": self.rollouts.service.weight_sync.transfer_s,
        }
        self.off_policy, self.token_lags = [], {}  # logged: the next iteration starts afresh
        self.gap_totals += self.gap_stats.detach().cpu().double()
        self.history.append({"iteration": iteration, **metrics})
        self.reward_spread.observe(stats.rewards)
        self.log_dict(metrics, on_step=True, prog_bar=False)
        progress = {
            "reward": metrics["rollout/reward"],
            "samples/s": metrics["perf/samples_per_s"],
            "wait_s": stats.wait_s,
            "train_s": train_s,
            "sync_s": sync_s,
        }
        self.log_dict(progress, prog_bar=True, on_step=True, logger=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The algorithm's own parameters (PPO's value head) train with the policy. Only the
        # trainable ones: a LoRA base or a frozen part has no state. Fused: one kernel per
        # step, without foreach's temporaries the size of every trained parameter (on a 0.5B
        # trainer rank those were 1 GiB of its peak).
        params = [p for p in self.policy.parameters() if p.requires_grad]
        params += list(self.algorithm.trainable_parameters())
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0, fused=fused or None)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            IterationTicker(self.iterations), batch_size=None, collate_fn=lambda x: x
        )


def _idle_sample(version: int) -> Sample:
    """Two tokens, trained on by nothing (loss mask 0): an FSDP rank's pass without a sample."""
    return Sample("idle", 0, [0], [0], [0.0], version, -1, loss_mask=[0])


def _check_finite(per_sample: torch.Tensor, samples: list, iteration: int) -> None:
    if bool(torch.isfinite(per_sample).all()):
        return
    bad = [s.key for s, v in zip(samples, per_sample.tolist()) if not math.isfinite(v)]
    raise NonFiniteLossError(
        f"Non-finite loss at iteration {iteration} on {len(bad)} sample(s) "
        f"(prompt_id, sample_index, iteration): {bad[:8]}. Stopped before the optimizer step; "
        "lower rl.module.lr, check the reward function, or give the algorithm a kl_coef "
        "(rl.algorithm's init_args)."
    )
