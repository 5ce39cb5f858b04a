"""``StreamRLModule``: the LightningModule whose training step consumes the sample stream.

One Lightning step is one RL iteration, read top to bottom: stream scored groups from the
generation service, back-propagate each group the moment it completes (gradients accumulate, so
arrival order does not change the update), take one optimizer step, push the new weights to the
generators (synchronous mode, StreamRL §4.1). Lightning drives the loop, so its callbacks,
loggers and checkpoints keep working.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torch.utils.data import IterableDataset
from transformers import PreTrainedModel

from streamrl.algorithms.base import Algorithm, LossInputs
from streamrl.rollout import RolloutStream, ScoredGroup


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
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy, self.algorithm, self.rollouts = policy, algorithm, rollouts
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.iterations, self.lr, self.max_grad_norm = iterations, lr, max_grad_norm
        self.weight_version, self.temperature = 0, temperature
        self.history: list[dict] = []

    def training_step(self, iteration: int) -> None:
        optimizer = self.optimizers()
        started = time.perf_counter()
        train_s, total = 0.0, self.rollouts.samples_per_iteration
        for group in self.rollouts.iteration():  # groups arrive as they complete
            t0 = time.perf_counter()
            per_sample = self.algorithm.loss(self.loss_inputs(group))  # [group]
            self.manual_backward(per_sample.sum() / total)
            train_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - t0
        self.weight_version += 1
        sync_s = self.rollouts.service.update(self.policy, self.weight_version)
        self.log_iteration(iteration, time.perf_counter() - started, train_s, sync_s, grad_norm)

    def loss_inputs(self, group: ScoredGroup) -> LossInputs:
        """Pad a group into tensors and compute the current (and reference) log-probs."""
        samples = group.samples
        prompt_len = len(samples[0].prompt_ids)
        width = max(s.length for s in samples)
        pad = int(self.policy.config.pad_token_id or 0)
        rows = [s.prompt_ids + s.token_ids + [pad] * (width - s.length) for s in samples]
        input_ids = torch.tensor(rows, device=self.device)  # [group, prompt + width]
        mask = torch.tensor([[1] * s.length + [0] * (width - s.length) for s in samples],
                            device=self.device)  # fmt: skip  # [group, width]
        attention = torch.cat([torch.ones_like(input_ids[:, :prompt_len]), mask], dim=1)
        old = torch.tensor([s.logprobs + [0.0] * (width - s.length) for s in samples],
                           device=self.device)  # fmt: skip
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = completion_logprobs(
                    self.reference, input_ids, attention, prompt_len, self.temperature
                )
        return LossInputs(
            logprobs=completion_logprobs(
                self.policy, input_ids, attention, prompt_len, self.temperature
            ),
            old_logprobs=old,
            advantages=torch.tensor(group.advantages, dtype=old.dtype, device=self.device),
            mask=mask,
            ref_logprobs=ref,
        )

    def log_iteration(
        self, iteration: int, wall_s: float, train_s: float, sync_s: float, grad_norm: torch.Tensor
    ) -> None:
        stats = self.rollouts.stats
        metrics = {
            "rollout/reward": sum(stats.rewards) / max(1, len(stats.rewards)),
            "rollout/tokens": float(stats.tokens),
            "perf/samples_per_s": stats.samples / wall_s,
            "time/iteration_s": wall_s,
            "time/generate_s": stats.generate_s,
            "time/wait_s": stats.wait_s,
            "time/train_s": train_s,
            "time/sync_s": sync_s,
            "train/grad_norm": float(grad_norm),
            "train/weight_version": float(self.weight_version),
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
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr, weight_decay=0.0)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            IterationTicker(self.iterations), batch_size=None, collate_fn=lambda x: x
        )


def completion_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of the completion tokens (positions ``prompt_len:``) under ``logits /
    temperature``, ``[batch, completion]``."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits  # [batch, seq, vocab]
    # The token at position t is predicted by the logits at t - 1.
    logits = logits[:, prompt_len - 1 : -1].float() / temperature
    targets = input_ids[:, prompt_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
