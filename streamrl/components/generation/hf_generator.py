"""Continuous-batching stream generator on a Hugging Face causal LM (no inference server needed).

StreamRL §3 (stream generation) emits each sample the moment it finishes instead of waiting for
the whole batch; §5 (continuous batching in an SGS instance) keeps a fixed number of batch slots
busy by admitting a waiting request into a slot as soon as its sequence finishes. This module does
both on plain ``transformers`` (>= 5) with a real KV cache, on CPU or GPU.

Layout: every running sequence (``SlotSequence``) owns one row of a preallocated KV buffer
(``SlotCache``), its tokens left-aligned at columns ``[0, length)``. Rows of different lengths
decode together in one forward pass (``SlotForwards``: per-row masks and positions). Finished rows
are dropped by moving the last rows into their place, so the running rows always form the prefix
``[0, n)`` of the buffer and no step re-pads or re-allocates. The generator's
``FinishingRules`` say when a row ends. A sample's road through the HF engine is this module,
``slot_cache`` (the cache, its forwards, an episode's kept prefix), ``slot_sequence`` (a row's
sequence and when it ends), and three the vLLM generator shares: ``admission``, ``sampling`` and
``finished``.

Examples:
    >>> from streamrl.policy.models import build_tokenizer, build_tiny_model
    >>> from streamrl.records import Request
    >>> model = build_tiny_model(build_tokenizer(), size="test")
    >>> gen = HFStreamGenerator(model, max_batch_size=2, greedy=True)
    >>> gen.submit([Request(f"p{i}", [5, 6, 7], max_tokens=4, forced_length=4) for i in range(3)])
    >>> [s.length for s in gen.stream()]
    [4, 4, 4]
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.components.generation.admission import AdmissionQueue, AdmittingGenerator, budget
from streamrl.components.generation.finished import finished_sample
from streamrl.components.generation.hf_weights import WeightMap, copy_into, fingerprint
from streamrl.components.generation.moving import leaving
from streamrl.components.generation.routed_experts import RoutedExperts
from streamrl.components.generation.sampling import (
    draw_tokens,
    sampling_temperature,
    token_log_probs,
    version_seed,
)
from streamrl.components.generation.slot_cache import PrefixStash, SlotCache, SlotForwards
from streamrl.components.generation.slot_sequence import (
    FinishingRules,
    SlotSequence,
    admitted_sequence,
)
from streamrl.components.generation.speculative import SpeculativeDecoding, Speculator
from streamrl.components.weights.checksums import tensor_digest
from streamrl.protocols import AdmissionScheduler
from streamrl.records import Request, Sample


class HFStreamGenerator(AdmittingGenerator):
    """Generate samples with continuous batching and emit each one as soon as it finishes.

    StreamRL §3 (stream generation) / §5 (continuous batching in an SGS instance). At most
    ``max_batch_size`` sequences run at once; each ``step()`` admits waiting requests into free
    slots (in the scheduler's order), prefills them, decodes one token for every running sequence
    in one batched forward, and returns the sequences that finished, freeing their slots at once.
    Which requests wait, in what order, and how many may run is its ``admission``, an
    ``AdmissionQueue``.

    A sample's ``weight_version`` is the version loaded when it was admitted. A ``load_weights``
    between steps also applies to sequences already running (partial rollout): their remaining
    tokens (and ``logprobs``) come from the new weights, and ``token_versions`` says which
    weights drew each token. Their KV cache, computed by the old weights, is kept;
    ``recompute_running()`` recomputes it under the new ones (``streamrl.components.generation.
    partial``).
    ``logprobs`` are under the distribution each token was drawn from: ``logits / temperature``
    (temperature 1 when greedy), with EOS masked out for ``forced_length`` requests.

    Args:
        model: a causal LM, switched to eval mode. Needs SDPA or eager attention (the
            generator passes its own 4D attention masks).
        max_batch_size: number of batch slots.
        scheduler: admission order; FIFO if ``None``.
        instance_id: copied into every sample.
        temperature: softmax temperature when sampling.
        greedy: take the argmax instead of sampling.
        eos_token_id: stop token(s); defaults to ``model.config.eos_token_id``.
        stop_strings: a sequence also stops (finish reason ``"stop"``) once the text of its last
            few tokens contains one of these; the tokens are kept whole, so the sample may end
            with text past the stop string (``streamrl.policy.chat.completion_text`` cuts it).
        tokenizer: decodes those tokens; needed with ``stop_strings`` only.
        pad_token_id: filler id for padded prefill positions; defaults to the config's or 0.
        seed: seed of the sampling ``torch.Generator``; it is reseeded from ``(seed, version)``
            whenever weights of a new version load, so what a version samples does not depend
            on what earlier versions sampled (a resumed run samples as the uninterrupted one).
        weight_version: version tag of the weights the model holds now.
        prefix_entries: finished sequences of ``keep_prefix`` requests whose KV cache is kept
            for their episode's next turn (``PrefixStash``; cleared when weights load); four per
            batch slot by default (each holds a sequence's whole KV cache: mind a GPU's memory).
            Such a turn is admitted before the scheduler's requests.
        speculative: speculative decoding in the tail (``SpeculativeDecoding``): while at most
            its ``max_running`` sequences run, each step drafts tokens from text already seen
            and verifies them in the one forward, with the outputs (and log-probs) of plain
            decoding; its counters are ``speculator``'s. ``None``: plain decoding only.
    """

    #: What a decode step pays for, as ``LatencyModel.load``: a rectangular slot cache, so
    #: every row pays for the widest.
    context_load = "widest"

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = 32,
        scheduler: AdmissionScheduler | None = None,
        instance_id: int = 0,
        temperature: float = 1.0,
        greedy: bool = False,
        eos_token_id: int | list[int] | None = None,
        stop_strings: Sequence[str] = (),
        tokenizer: PreTrainedTokenizerBase | None = None,
        pad_token_id: int | None = None,
        seed: int = 0,
        weight_version: int = 0,
        prefix_entries: int | None = None,
        speculative: SpeculativeDecoding | None = None,
    ) -> None:
        #: The requests waiting for a batch slot, and how many may run at once.
        self.admission = AdmissionQueue(
            max_batch_size=max_batch_size, scheduler=scheduler, resumable=self._resumable
        )
        self.temperature = sampling_temperature(temperature, greedy)
        self.greedy = greedy
        self.max_batch_size = max_batch_size
        self.instance_id = instance_id
        self._weight_version = weight_version
        config = model.config
        self.model = model.eval()
        self.context_length = int(config.max_position_embeddings)
        #: When a sequence ends: EOS ids, forced lengths, ``max_tokens``, stop strings.
        self.finishing = FinishingRules(
            config.eos_token_id if eos_token_id is None else eos_token_id, stop_strings, tokenizer
        )
        pad = config.pad_token_id if pad_token_id is None else pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        self._seed = seed
        self._rng = torch.Generator(device=model.device)
        self._rng.manual_seed(version_seed(seed, weight_version))
        self._cache = SlotCache(config.num_hidden_layers, max_batch_size)
        self._forwards = SlotForwards(self.model, self._cache, self.pad_token_id)
        self._rows: list[SlotSequence] = []
        #: Episodes' kept prefixes (``hits``: turns that reused one).
        self.prefixes = PrefixStash(prefix_entries or 4 * max_batch_size)
        #: Speculative decoding's drafter and counters (``None`` without ``speculative``).
        self.speculator = None if speculative is None else Speculator(speculative)
        #: A mixture of experts' choices per sequence (``None`` for a dense model): each
        #: sample carries them for the trainer to replay (``streamrl.policy.routing``).
        self._routed = RoutedExperts.of(self.model)

    # ----------------------------------------------------------------- public API
    @property
    def weight_version(self) -> int:
        """Version of the weights held now."""
        return self._weight_version

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings (``finishing``'s)."""
        return self.finishing.stop_strings

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer that decodes for the stop strings (``finishing``'s)."""
        return self.finishing.tokenizer

    @property
    def num_running(self) -> int:
        """Sequences occupying a batch slot."""
        return len(self._rows)

    def step(self) -> list[Sample]:
        """Admit, prefill, decode one token per running sequence; return the finished samples."""
        with torch.inference_mode():
            start = len(self._rows)
            self._admit()
            if len(self._rows) > start:
                self._prefill(start)
            if not self._rows:
                return []
            drafts = None
            if self.speculator is not None and not self._greedy_requests():
                drafts = self.speculator.drafts(self._rows)
            tokens, logprobs = self._decode() if drafts is None else self._verify(drafts)
            return self._advance(tokens, logprobs)

    def load_weights(self, state_dict: WeightMap, version: int) -> None:
        """Copy ``state_dict`` into the model's tensors in place and set ``weight_version``.

        Keys are the model's ``state_dict`` names; a subset is allowed. Shapes are checked for
        every entry before anything is copied, so a bad entry leaves the model untouched.
        """
        copy_into(self.model, state_dict)
        self._weight_version = int(version)
        self.prefixes.clear()
        # A resumed run's new process loads the checkpoint's version first: reseeding here
        # gives it the random stream the uninterrupted process had for that version.
        self._rng.manual_seed(version_seed(self._seed, self._weight_version))

    def recompute_running(self) -> int:
        """Prefill every running sequence again, prompt and tokens so far, under the weights
        loaded now (the re-prefill policy of partial rollout); returns the columns computed."""
        if not self._rows:
            return 0
        with torch.inference_mode():
            self._forwards.prefill(0, [r.columns() for r in self._rows])
        self._file_prefill(self._rows)
        for row in self._rows:
            row.recomputed += row.length
        return sum(r.length for r in self._rows)

    def release(self, keys: Collection[tuple]) -> list[Request]:
        """Take the requests with these keys off this instance (they move to another one):
        waiting ones as they are, running ones with their progress (``moving.leaving``), their
        slots freed at once. Keys it does not hold (finished already) are ignored."""
        keys = set(keys)
        moved = self.admission.withdraw(keys)
        running = [i for i, row in enumerate(self._rows) if row.request.key in keys]
        moved += [leaving(self._rows[i]) for i in running]
        if self._routed is not None:
            for i in running:
                self._routed.forget(self._rows[i])
        if running:
            with torch.inference_mode():  # the cache is an inference tensor
                self._release(running)
        return moved

    def reprioritize(self, costs: Mapping[tuple, float]) -> int:
        """New admission costs for waiting requests (``AdmissionQueue.reprioritize``)."""
        return self.admission.reprioritize(costs)

    def running_progress(self) -> list[tuple[tuple, int]]:
        """``(key, tokens generated)`` of every running sequence, moves included."""
        return [(row.request.key, len(row.token_ids)) for row in self._rows]

    def weight_templates(self) -> dict[str, torch.Tensor]:
        """The tensors a weight update fills: the model's parameters (live, not copies), in
        ``named_parameters()`` order, as the trainer's policy sends them."""
        return dict(self.model.named_parameters())

    def fingerprint(self) -> str:
        """A hash of the weights, equal to ``fingerprint(policy)`` of a trainer holding the same
        (the service's ``fingerprints()``)."""
        return fingerprint(self.model)

    def weight_digests(self) -> dict[str, str]:
        """The checksum of every tensor a weight update fills, as held now (``tensor_digest``,
        by the trainer's names): equal to the trainer's for the version it sent."""
        return {name: tensor_digest(t) for name, t in self.weight_templates().items()}

    # ----------------------------------------------------------------- internals
    def _admit(self) -> None:
        now = time.time()
        needed = 0
        # A verify forward writes up to draft_tokens columns past a row's last one.
        spare = 0 if self.speculator is None else self.speculator.settings.draft_tokens
        fresh, resumed = [], []
        for req, submitted in self.admission.admit(len(self._rows), now):
            prompt = req.prompt_ids
            kept = (
                None if req.progress else self.prefixes.take(req.key, prompt, self._weight_version)
            )
            offset = 0 if kept is None else len(kept.token_ids)
            row = admitted_sequence(req, submitted, now, self._weight_version, offset)
            if kept is None:
                fresh.append(row)
            else:
                resumed.append((row, kept.kv))
            needed = max(needed, len(prompt) + budget(req) - 1 + spare)
        self._cache.reserve(needed, limit=self.context_length + spare)
        # Fresh rows first: one batched prefill writes them from column 0; then each resumed
        # row gets its kept columns back and prefills only what follows them.
        self._rows.extend(fresh)
        for row, kv in resumed:
            self._cache.load_row(len(self._rows), kv)
            self._rows.append(row)

    def _resumable(self, req: Request) -> bool:
        """Whether ``req`` continues an episode whose prefix this generator kept."""
        return req.key in self.prefixes

    def _prefill(self, start: int) -> None:
        resumed = [i for i in range(start, len(self._rows)) if self._rows[i].offset]
        for i in resumed:
            row = self._rows[i]
            new = row.request.prompt_ids[row.offset : row.length]
            self._forwards.prefill_after(i, new, row.offset)
            if self._routed is not None and new:
                self._routed.file([(row, range(row.offset, row.offset + len(new)))], len(new))
        new_rows = self._rows[start : resumed[0] if resumed else len(self._rows)]
        self._forwards.prefill(start, [r.columns() for r in new_rows])
        self._file_prefill(new_rows)

    def _file_prefill(self, rows: list[SlotSequence]) -> None:
        """File a batched prefill's expert choices: row ``i`` fed columns ``[0, length)``."""
        width = max((r.length for r in rows), default=0)
        if self._routed is not None and width:
            self._routed.file([(r, range(r.length)) for r in rows], width)

    def _decode(self) -> tuple[list[list[int]], list[list[float]]]:
        rows = self._rows
        logits = self._forwards.decode([r.length for r in rows], [r.next_input for r in rows])
        if self._routed is not None:
            self._routed.file([(r, range(r.length, r.length + 1)) for r in rows], 1)
        greedy = [self.greedy or r.request.greedy for r in rows]
        tokens, logprobs = draw_tokens(self._log_probs(logits), greedy=greedy, rng=self._rng)
        return [[t] for t in tokens], [[lp] for lp in logprobs]

    def _greedy_requests(self) -> bool:
        """Whether a sampling generator holds greedy requests (a held-out evaluation): such a
        step decodes plainly, as verification takes one rule for the whole batch."""
        return not self.greedy and any(r.request.greedy for r in self._rows)

    def _verify(self, drafts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        """One forward over every row's next input and draft; the tokens each row emits."""
        rows = self._rows
        lengths, inputs = [r.length for r in rows], [r.next_input for r in rows]
        logits = self._forwards.verify(lengths, inputs, drafts)  # [batch, 1 + draft, vocab]
        if self._routed is not None:
            fed = [range(n, n + 1 + len(d)) for n, d in zip(lengths, drafts, strict=True)]
            self._routed.file(list(zip(rows, fed, strict=True)), 1 + max(map(len, drafts)))
        return self.speculator.accept(
            self._log_probs(logits), drafts, greedy=self.greedy, rng=self._rng
        )

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probs of the distribution each row draws from (EOS masked for forced rows)."""
        forced = [i for i, r in enumerate(self._rows) if r.request.forced_length is not None]
        return token_log_probs(logits, forced, self.finishing.eos_ids, self.temperature)

    def _advance(self, tokens: list[list[int]], logprobs: list[list[float]]) -> list[Sample]:
        """Append each row's new tokens (one, or a verified draft run) and finish the rows a
        finishing rule ends."""
        now = time.time()
        finished, done = [], []
        for i, (row, run, lps) in enumerate(zip(self._rows, tokens, logprobs, strict=True)):
            reason = self._append(row, run, lps)
            if reason is not None:
                finished.append(self._to_sample(row, reason, now))
                done.append(i)
                if row.request.keep_prefix and row.weight_version == self._weight_version:
                    kept = row.columns()
                    kv = self._cache.save_row(i, row.length)
                    self.prefixes.put(row.request.key, kept, kv, row.weight_version)
                if self.speculator is not None:
                    self.speculator.finished(row)
        if done:
            self._release(done)
        return finished

    def _append(self, row: SlotSequence, tokens: list[int], logprobs: list[float]) -> str | None:
        """Append ``tokens`` one by one until a finishing rule ends the row (nothing past its
        end is kept); returns that rule's reason, or ``None``."""
        for tok, lp in zip(tokens, logprobs, strict=True):
            row.append(tok, lp, self._weight_version)
            reason = self.finishing.reason(row.request, row.token_ids)
            if reason is not None:
                return reason
        return None

    def _release(self, done: list[int]) -> None:
        """Free the slots in ``done``: move the last surviving rows into the holes."""
        rows, done_set = self._rows, set(done)
        keep = len(rows) - len(done)
        holes = [i for i in done if i < keep]
        movers = [i for i in range(keep, len(rows)) if i not in done_set]
        columns = max((rows[i].length for i in movers), default=0)
        self._cache.move_rows(movers, holes, columns)
        for hole, src in zip(holes, movers, strict=True):
            rows[hole] = rows[src]
        del rows[keep:]

    def _to_sample(self, row: SlotSequence, reason: str, now: float) -> Sample:
        return finished_sample(
            row,
            instance_id=self.instance_id,
            finished_s=now,
            finish_reason=reason,
            cached_tokens=row.offset,
            routed_experts=None if self._routed is None else self._routed.finish(row),
        )
