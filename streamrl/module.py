"""``StreamRLModule``: the LightningModule whose training step consumes the sample stream.

One Lightning step is one RL iteration, read top to bottom: stream scored groups from the
generation service, back-propagate each group the moment it completes (gradients accumulate, so
arrival order does not change the update), take one optimizer step, push the new weights to the
generators (synchronous mode, StreamRL §4.1). Lightning drives the loop, so its callbacks,
loggers and checkpoints keep working.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from typing import Literal

import lightning as L
import torch
from torch.utils.data import IterableDataset
from transformers import PreTrainedModel

from streamrl.algorithms.base import Algorithm, LossInputs
from streamrl.components.elastic import ElasticController
from streamrl.components.pipeline import DynamicBatchPipeline, MicroBatch
from streamrl.errors import NonFiniteLossError
from streamrl.rollout import RolloutStream
from streamrl.timeline import TraceRecorder

Mode = Literal["sync", "async", "colocated"]
MODES: tuple[str, ...] = ("sync", "async", "colocated")


@contextlib.contextmanager
def _all_cores(enabled: bool) -> Iterator[None]:
    """In colocated mode the trainer has every core while it trains (generators are idle)."""
    if not enabled:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
        rollouts: the iteration-by-iteration stream of scored groups.
        iterations: optimizer steps to run.
        lr: AdamW learning rate.
        max_grad_norm: gradient clipping.
        reference: frozen reference policy for a KL penalty, or ``None``.
        temperature: the generators' sampling temperature; the trainer scores tokens under the
            same tempered distribution, so behaviour and current log-probs are comparable.
        mode: ``"sync"`` (step k trains on samples of weights k, streamed as they finish),
            ``"async"`` (StreamRL's one-step asynchronous mode: step k+1 is generated while step
            k trains, and the weight transfer overlaps the next step) or ``"colocated"`` (the
            baseline of §7: generation and training time-share the cores, one after the other:
            all samples first, then training with every core).
        pipeline: micro-batching and staleness policy; by default a token budget of 1024 and a
            staleness bound of 0 (sync) or 1 (async).
        trace: records spans for the timeline (bounded); the rollouts' recorder if ``None``.
        elastic: decides after each iteration whether generation needs another instance
            (§4.2); the service adds it while training goes on.
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        algorithm: Algorithm,
        rollouts: RolloutStream,
        iterations: int,
        lr: float = 1e-4,
        max_grad_norm: float = 1.0,
        reference: PreTrainedModel | None = None,
        temperature: float = 1.0,
        mode: Mode = "sync",
        pipeline: DynamicBatchPipeline | None = None,
        trace: TraceRecorder | None = None,
        elastic: ElasticController | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        self.automatic_optimization = False
        self.policy, self.algorithm, self.rollouts = policy, algorithm, rollouts
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.iterations, self.lr, self.max_grad_norm = iterations, lr, max_grad_norm
        self.weight_version, self.temperature, self.mode = 0, temperature, mode
        self.pipeline = pipeline or DynamicBatchPipeline(staleness_bound=int(mode == "async"))
        self.trace = trace if trace is not None else rollouts.trace
        self.history: list[dict] = []
        self.elastic = elastic
        self.samples_trained = 0
        self.sync_transfer_s = 0.0  # seconds spent broadcasting weights, background included
        self._ahead: int | None = None  # async: the iteration generated one step ahead

    def training_step(self, iteration: int) -> None:
        optimizer = self.optimizers()
        started = time.perf_counter()
        train_s, total = 0.0, self.rollouts.samples_per_iteration
        groups = self.rollouts.groups(self._dispatch(iteration))
        if self.mode == "colocated":  # time-sharing: every sample first, then training
            groups = list(groups)
        with _all_cores(self.mode == "colocated"):
            for micro in self.pipeline.micro_batches(groups, self.weight_version):
                t0 = time.perf_counter()
                with self.trace.span("trainer", "train", iteration, samples=len(micro.samples)):
                    per_sample = self.algorithm.loss(self.loss_inputs(micro))  # [micro]
                    _check_finite(per_sample, micro.samples, iteration)
                    self.manual_backward(per_sample.sum() / total)
                self.samples_trained += len(micro.samples)
                train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with self.trace.span("trainer", "step", iteration):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - t0
        self.weight_version += 1
        with self.trace.span("trainer", "sync", iteration, version=self.weight_version):
            if self.mode == "async":  # the transfer overlaps the next step (§4.1)
                sync_s = self.rollouts.service.push_weights(self.policy, self.weight_version)
            else:
                sync_s = self.rollouts.service.update(self.policy, self.weight_version)
        self.log_iteration(iteration, time.perf_counter() - started, train_s, sync_s, grad_norm)
        if self.elastic is not None:
            self._scale(train_s)

    def _scale(self, train_s: float) -> None:
        """Elastic generation (§4.2): one more instance when generation lags training."""
        service, stats = self.rollouts.service, self.rollouts.stats
        running = sum(i.state in ("starting", "joining", "active") for i in service.instances())
        decision = self.elastic.observe(stats.generate_s, train_s, running, stats.lengths)
        if decision.action == "add":
            for _ in range(decision.instances - running):
                service.add_instance()  # joins once it holds the current weights
        elif decision.action == "remove":
            for _ in range(running - decision.instances):
                service.remove_instance()  # finishes what it holds, then stops
        self.history[-1]["elastic/instances"] = float(decision.instances)
        self.history[-1]["elastic/delta_s"] = decision.delta_s
        self.history[-1]["elastic/delta_prime_s"] = decision.delta_prime_s

    def _dispatch(self, iteration: int) -> int:
        """The rollout iteration this step trains on; in async mode also dispatch the next."""
        if self.mode != "async":
            return self.rollouts.dispatch(min_weight_version=self.weight_version)
        if self._ahead is None:
            self._ahead = self.rollouts.dispatch(min_weight_version=self.weight_version)
        current, self._ahead = self._ahead, None
        if iteration + 1 < self.iterations:
            # Generated while this step trains, by weights >= the current version: trained at
            # the next step, it is at most one version stale.
            self._ahead = self.rollouts.dispatch(min_weight_version=self.weight_version)
        return current

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # What a resumed run needs beyond the weights: where the trainer and the ranker are.
        checkpoint["streamrl"] = {
            "weight_version": self.weight_version,
            "elastic": self.elastic.state_dict() if self.elastic else None,
            "algorithm": self.algorithm.state_dict(),
            "prompt_source": self.rollouts.prompts.state_dict(),
            "length_ranker": self.rollouts.ranker.state_dict() if self.rollouts.ranker else None,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("streamrl")
        if state is None:
            return
        self.weight_version = state["weight_version"]
        self.rollouts.prompts.load_state_dict(state["prompt_source"])
        if "algorithm" in state:
            self.algorithm.load_state_dict(state["algorithm"])
        if self.elastic is not None and state.get("elastic") is not None:
            self.elastic.load_state_dict(state["elastic"])
        if self.rollouts.ranker is not None and state["length_ranker"] is not None:
            self.rollouts.ranker.load_state_dict(state["length_ranker"])

    def on_train_end(self) -> None:
        # Leave the generators on the final weights (async pushes may still be in flight).
        service = self.rollouts.service
        if service.weight_sync is not None:
            service.wait_weights(self.weight_version)
            self.sync_transfer_s = service.weight_sync.transfer_s

    def loss_inputs(self, batch: MicroBatch) -> LossInputs:
        """Pad a micro-batch into tensors and compute current (and reference) log-probs.

        Rows are ``prompt + completion``, right-padded; prompts may differ in length.
        """
        samples = batch.samples
        prompt_lens = [len(s.prompt_ids) for s in samples]
        width = max(s.length for s in samples)
        seq = max(p + s.length for p, s in zip(prompt_lens, samples))
        pad = int(self.policy.config.pad_token_id or 0)
        rows = [s.prompt_ids + s.token_ids + [pad] * (seq - p - s.length)
                for p, s in zip(prompt_lens, samples)]  # fmt: skip
        input_ids = torch.tensor(rows, device=self.device)  # [batch, seq]
        lengths = torch.tensor([s.length for s in samples], device=self.device)
        total = torch.tensor(prompt_lens, device=self.device) + lengths
        attention = (torch.arange(seq, device=self.device) < total[:, None]).long()
        mask = (torch.arange(width, device=self.device) < lengths[:, None]).long()  # [batch, width]
        old = torch.tensor([s.logprobs + [0.0] * (width - s.length) for s in samples],
                           device=self.device)  # fmt: skip
        starts = torch.tensor(prompt_lens, device=self.device)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = completion_logprobs(
                    self.reference, input_ids, attention, starts, width, self.temperature
                )
        current = completion_logprobs(
            self.policy, input_ids, attention, starts, width, self.temperature
        )
        # Per-token critic values for algorithms with a critic (PPO); None for the others.
        values = self.algorithm.token_values(self.policy, input_ids, attention, starts, width)
        return LossInputs(
            logprobs=current * mask,
            old_logprobs=old,
            advantages=torch.tensor(batch.advantages, dtype=old.dtype, device=self.device),
            mask=mask,
            ref_logprobs=ref,
            values=values,
        )

    def log_iteration(
        self, iteration: int, wall_s: float, train_s: float, sync_s: float, grad_norm: torch.Tensor
    ) -> None:
        stats, lags = self.rollouts.stats, self.pipeline.staleness
        metrics = {
            "rollout/reward": sum(stats.rewards) / max(1, len(stats.rewards)),
            "rollout/tokens": float(stats.tokens),
            "perf/samples_per_s": stats.samples / wall_s,
            "time/iteration_s": wall_s,
            "time/generate_s": stats.generate_s,
            "time/wait_s": stats.wait_s,
            "time/train_s": train_s,
            "train/grad_norm": float(grad_norm),
            "train/weight_version": float(self.weight_version),
            "train/staleness_mean": sum(lags) / max(1, len(lags)),
            "train/staleness_max": float(max(lags, default=0)),
            "train/dropped_stale": float(self.pipeline.dropped_stale),
            "time/sync_exposed_s": sync_s,
            "time/sync_transfer_total_s": self.rollouts.service.weight_sync.transfer_s,
        }
        self.history.append({"iteration": iteration, **metrics})
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
        # The algorithm's own parameters (PPO's value head) train with the policy.
        params = [*self.policy.parameters(), *self.algorithm.trainable_parameters()]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            IterationTicker(self.iterations), batch_size=None, collate_fn=lambda x: x
        )


def _check_finite(per_sample: torch.Tensor, samples: list, iteration: int) -> None:
    if bool(torch.isfinite(per_sample).all()):
        return
    bad = [s.key for s, v in zip(samples, per_sample.tolist()) if not math.isfinite(v)]
    raise NonFiniteLossError(
        f"Non-finite loss at iteration {iteration} on {len(bad)} sample(s) "
        f"(prompt_id, sample_index, iteration): {bad[:8]}. Stopped before the optimizer step; "
        "lower rl.lr, check the reward function, or enable rl.kl_coef."
    )


def completion_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    starts: torch.Tensor,
    width: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of each row's completion tokens under ``logits / temperature``.

    Args:
        input_ids / attention: ``[batch, seq]``, each row ``prompt + completion + padding``.
        starts: ``[batch]``, where each row's completion starts (its prompt length).
        width: completion positions to return (longer rows are cut, shorter ones padded).

    Returns:
        ``[batch, width]``; positions past a row's completion hold junk, mask them.
    """
    logits = model(input_ids=input_ids, attention_mask=attention).logits  # [batch, seq, vocab]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    # The token at position t is predicted by the logits at t - 1.
    positions = starts[:, None] + torch.arange(width, device=input_ids.device)  # [batch, width]
    positions = positions.clamp(max=input_ids.shape[1] - 1)
    targets = input_ids.gather(1, positions)  # [batch, width]
    predicted_at = logprobs.gather(
        1, (positions - 1)[:, :, None].expand(-1, -1, logprobs.shape[-1])
    )
    return predicted_at.gather(-1, targets[:, :, None]).squeeze(-1)
