"""What a run needs of each GPU's memory, before it starts: per trainer GPU and per generator GPU.

StreamRL splits a cluster's GPUs between the two stages (§4.2); a split is only a plan if each
side fits. This is an estimate from the model's shape, the run's settings and the parts of the
trainer as streamrl builds them (FSDP2 over the trainer ranks, ``bf16-mixed``, AdamW, per-layer
activation checkpointing, chunked log-probs; ``streamrl.components.training``), term by term, so
a user sees which knob moves which term. ``streamrl plan memory`` prints it; ``streamrl fit``
refuses a config whose estimate exceeds the device (``fit_problem``), naming the knob.

Per trainer GPU (``N`` ranks, ``P`` parameters, ``P_l`` per decoder layer, ``P_r`` outside the
layers: embeddings, head, final norm):

- weights ``4P/N`` (float32 masters; a LoRA base never trains: ``2P/N`` in bfloat16 plus the
  adapters), gradients ``4P/N``, AdamW ``8P/N`` (LoRA: the adapters' only), a KL reference
  ``2P/N`` (bfloat16 shards; LoRA: none, the base with its adapters off);
- gathered while computing: two layers in bfloat16 (the one computing and the one prefetched),
  the root's own ``P_r`` in bfloat16 for the whole step, one layer's and the root's unsharded
  gradients before their reduce-scatter, in bfloat16 and in float32 (6 bytes per parameter; a
  frozen part has none);
- activations per token of a micro-batch: with checkpointing each layer keeps its bfloat16
  input (``2h`` bytes) and one layer is recomputed at a time; without, every layer keeps its
  own, ``2 (7h + 3 kv + 4 i)`` bytes per token (``h`` hidden, ``kv`` the K/V width, ``i`` the
  MLP width: the inputs of the norms, projections and the SwiGLU MLP; attention by
  SDPA/flash keeps no ``seq x seq`` scores);
- log-probs: one chunk of float32 logits (``streamrl.policy.logprobs``: 64M logits), counted
  three times (logits, their softmax, their gradient);
- a runtime reserve (CUDA context, NCCL buffers, the allocator's slack): 2 GiB, an assumption.

Per generator GPU (tensor parallel ``t``): bfloat16 weights ``2P/t``; the KV cache of a token,
``2 L kv_heads head_dim x 2`` bytes ``/ t``; the sequences of ``T`` tokens that fit in 90% of
the GPU (vLLM's default ``gpu_memory_utilization``) after the weights and a 2 GiB reserve.

Examples:
    >>> from streamrl.policy.models import model_config
    >>> shape = ModelShape.from_config(model_config("7b"))
    >>> round(shape.params / 1e9, 2)
    7.62
    >>> per_gpu = trainer_memory(shape, ranks=4, micro_batch_tokens=8704)
    >>> round(per_gpu.total / 2**30)  # GiB on each of 4 trainer GPUs
    45
    >>> generator_memory(shape, gpu_bytes=80 * 2**30, sequence_tokens=8704).sequences
    120
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import PretrainedConfig

GIB = 2**30
#: CUDA context, NCCL buffers, the allocator's slack: assumed, per GPU.
RUNTIME_RESERVE_BYTES = 2 * GIB
#: Logits per log-prob chunk when ``trainer.logprob_chunk_tokens`` is unset (``logprobs``).
DEFAULT_CHUNK_LOGITS = 64 * 2**20
#: vLLM's default share of a GPU it takes.
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class ModelShape:
    """What the estimates read of a causal LM's config (a Qwen2/Llama-style decoder).

    Attributes:
        hidden / layers / heads / kv_heads / head_dim / intermediate / vocab: the shape.
        tied: the LM head is the input embedding.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        return cls(
            hidden=hidden,
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate=int(config.intermediate_size),
            vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def layer_params(self) -> int:
        """One decoder layer: attention (Q, K, V with biases, O), the SwiGLU MLP, two norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + (q + 2 * kv) + q * self.hidden
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Outside the layers: the embedding, an untied head, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @property
    def activation_bytes_per_token_layer(self) -> int:
        """Bytes one decoder layer keeps per token for its backward pass (bfloat16)."""
        kv = self.kv_heads * self.head_dim
        return 2 * (7 * self.hidden + 3 * kv + 4 * self.intermediate)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, bfloat16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes per trainer GPU, by term (module docstring); ``total`` is their sum."""

    weights: int
    gradients: int
    optimizer: int
    reference: int
    gathered: int
    activations: int
    logprob_chunk: int
    reserve: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def rows(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class GeneratorMemory:
    """Bytes per generator GPU and the KV cache it leaves.

    Attributes:
        weights: bfloat16 weights on this GPU.
        kv_per_token: K and V of one token on this GPU.
        free_for_kv: what is left for the KV cache.
        sequences: sequences of ``sequence_tokens`` whose KV cache fits at once.
    """

    weights: int
    kv_per_token: int
    free_for_kv: int
    sequences: int


def lora_params(
    shape: ModelShape, r: int, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
) -> int:
    """Parameters of rank-``r`` LoRA adapters on ``targets`` in every layer (0 when ``r`` is 0):
    ``r x (in + out)`` per adapted projection."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, i = shape.hidden, shape.intermediate
    sizes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    return r * shape.layers * sum(sum(sizes[t]) for t in targets if t in sizes)


def trainer_memory(
    shape: ModelShape,
    ranks: int,
    micro_batch_tokens: int,
    *,
    lora_params: int = 0,
    reference: bool = False,
    activation_checkpointing: bool = True,
    chunk_logits: int = DEFAULT_CHUNK_LOGITS,
) -> TrainerMemory:
    """The estimate per trainer GPU (module docstring).

    Args:
        shape: the model.
        ranks: trainer ranks sharding it (FSDP2).
        micro_batch_tokens: tokens of one forward/backward pass (``rl.micro_batches``'
            ``max_tokens``, or one whole sample when it is longer).
        lora_params: trained adapter parameters (0: full fine-tuning).
        reference: a frozen KL reference (the algorithm's ``kl_coef > 0``; none under LoRA).
        activation_checkpointing: each layer recomputed in the backward pass.
        chunk_logits: logits per log-prob chunk.
    """
    p, lora = shape.params, lora_params > 0
    trained = lora_params if lora else p
    per_layer = shape.activation_bytes_per_token_layer
    if activation_checkpointing:  # every layer's input, and one layer recomputed at a time
        kept = 2 * shape.hidden * shape.layers + per_layer
    else:
        kept = per_layer * shape.layers
    # one layer's and the root's gradients before their reduce-scatter: bfloat16 as computed,
    # float32 as reduced (a frozen part has none)
    unsharded_grads = 0 if lora else 6 * (shape.layer_params + shape.root_params)
    return TrainerMemory(
        weights=(2 * p if lora else 4 * p) // ranks + 4 * lora_params,
        gradients=4 * trained // (1 if lora else ranks),
        optimizer=8 * trained // (1 if lora else ranks),
        reference=2 * p // ranks if reference and not lora else 0,
        gathered=2 * (2 * shape.layer_params + shape.root_params) + unsharded_grads,
        activations=kept * micro_batch_tokens,
        logprob_chunk=3 * 4 * chunk_logits,
        reserve=RUNTIME_RESERVE_BYTES,
    )


def generator_memory(
    shape: ModelShape, gpu_bytes: int, sequence_tokens: int, tensor_parallel: int = 1
) -> GeneratorMemory:
    """The estimate per generator GPU (module docstring) for sequences of ``sequence_tokens``
    (prompt plus ``rl.rollouts.max_tokens``)."""
    weights = 2 * shape.params // tensor_parallel
    kv_per_token = shape.kv_bytes_per_token // tensor_parallel
    free = int(GPU_MEMORY_UTILIZATION * gpu_bytes) - weights - RUNTIME_RESERVE_BYTES
    sequences = max(0, free) // max(1, kv_per_token * sequence_tokens)
    return GeneratorMemory(weights, kv_per_token, max(0, free), int(sequences))


def trainer_knob(memory: TrainerMemory, ranks: int, activation_checkpointing: bool) -> str:
    """What to change when ``memory`` does not fit: the knob of its largest movable term."""
    states = memory.weights + memory.gradients + memory.optimizer + memory.reference
    if memory.activations >= states:
        if not activation_checkpointing:
            return "set trainer.activation_checkpointing: true"
        return "lower rl.micro_batches' max_tokens (activations grow with its tokens)"
    return (
        f"add trainer ranks (trainer.devices, now {ranks}: the weights, gradients and AdamW "
        "state are sharded over them) or train LoRA adapters (rl.lora)"
    )
