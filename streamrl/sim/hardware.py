"""Published hardware and model numbers, and the assumptions that turn them into cost models.

From the paper (digest ``reference/streamrl-paper.md``): Table 1 (H800 / H20 specs, machine cost
2.85 : 1.00), Fig. 6 (``PTL(BS)`` of a 7B model on one H800), §7.1 (Qwen2.5 shapes, an 80 Gbps
cross-datacenter link). Assumptions (not in the paper), each used once below:

- **Decode latency of other models and GPUs.** ``PTL(1)`` of the 7B table is weight reads: it is
  scaled by parameters per GPU (``params / TP``) and by HBM bandwidth. The batch-dependent part
  ``PTL(BS) - PTL(1)`` is taken as half compute (scaled by TFLOPS) and half KV reads (scaled by
  bandwidth), also by parameters per GPU. Tensor parallelism adds two all-reduces per layer and
  step, 12 us each.
- **KV-cache bound on the batch.** ``90% of HBM x TP - bf16 weights``, divided by the KV bytes
  of one sequence at prompt + *maximum* output length, capped to [8, 512]. An engine that
  admits a sequence only when its whole context fits never preempts (the forced-length protocol
  of §7 runs every sample to its end); a paged engine that admits on the mean and preempts would
  hold about 3x more at 20K (see ``kv_batch_limit``).
- **Training cost.** PPO with actor, critic and reference of the same size: 16 x params FLOPs per
  token (fwd+bwd of two models, three forward passes), at 35% MFU; each added data-parallel unit
  gives 0.95 of a unit.
- **Weight transfer.** bf16 weights; 200 Gbps inside a datacenter (one NIC per broadcast tree),
  80 Gbps across; 1 s fixed (resharding, loading). Colocated switching moves the three models'
  shard of one trainer unit over a 25 GB/s host link, each way.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.components.capacity.allocator import TrainerCostModel
from streamrl.components.skewness.latency import PAPER_7B_H800_MS, LatencyModel


@dataclass(frozen=True)
class GPU:
    """A GPU type (Table 1). ``price`` is per GPU-hour in the paper's machine-cost units / 8."""

    name: str
    tflops_bf16: float
    hbm_gb: float
    hbm_tb_s: float
    price: float

    @property
    def price_per_s(self) -> float:
        return self.price / 3600


H800 = GPU("H800", 989.5, 80, 3.35, 2.85 / 8)
H20 = GPU("H20", 148.0, 96, 4.0, 1.00 / 8)
GPUS = {"h800": H800, "h20": H20}


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2.5 model (§7.1) and how StreamRL would lay it out.

    Attributes:
        params: parameter count.
        layers / kv_heads / head_dim: for the KV-cache size per token.
        gen_tp: GPUs per generator instance.
        train_unit_gpus: GPUs per trainer unit (TP x PP inside nodes).
        total_gpus: the H800 budget of §7 (Fig. 8).
    """

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    gen_tp: int
    train_unit_gpus: int
    total_gpus: int

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


QWEN25 = {
    "7b": ModelShape("Qwen2.5-7B", 7.62e9, 28, 4, 128, 1, 8, 32),
    "32b": ModelShape("Qwen2.5-32B", 32.8e9, 64, 8, 128, 2, 8, 64),
    "72b": ModelShape("Qwen2.5-72B", 72.7e9, 80, 8, 128, 4, 16, 128),
}

TP_ALLREDUCE_S = 12e-6
MFU = 0.35
PPO_FLOPS_PER_PARAM_TOKEN = 16.0
DP_EFFICIENCY = 0.95
LINK_GBPS = {"single-dc": 200.0, "cross-dc": 80.0}
SYNC_LATENCY_S = 1.0
HOST_LINK_GB_S = 25.0


def decode_latency(model: ModelShape, gpu: GPU = H800) -> LatencyModel:
    """``PTL(BS)`` of one ``model`` instance (``gen_tp`` GPUs) on ``gpu``, scaled from Fig. 6."""
    seven = QWEN25["7b"]
    per_gpu = model.params / model.gen_tp / seven.params
    bandwidth = H800.hbm_tb_s / gpu.hbm_tb_s
    compute = H800.tflops_bf16 / gpu.tflops_bf16
    comm = 2 * model.layers * TP_ALLREDUCE_S if model.gen_tp > 1 else 0.0
    base = PAPER_7B_H800_MS[1] / 1000
    sizes = sorted(PAPER_7B_H800_MS)
    ptl = [
        per_gpu
        * (base * bandwidth + (PAPER_7B_H800_MS[b] / 1000 - base) * (compute + bandwidth) / 2)
        + comm
        for b in sizes
    ]
    return LatencyModel(sizes, ptl)


def kv_batch_limit(model: ModelShape, gpu: GPU, context_tokens: float) -> int:
    """Sequences one instance (``model.gen_tp`` GPUs) holds in its KV cache at
    ``context_tokens`` each: the batch bound of Algorithm 2 (§5.3, ``BS_max``).

    ``free = 0.9 x HBM x TP - bf16 weights``; one sequence needs ``kv_bytes_per_token x
    context_tokens``. Pass prompt + maximum output for an engine that never preempts (the paper
    presets do), prompt + mean output for a paged engine's steady state.

    Examples:
        >>> # 72B, TP 4 on H800: 0.9 x 80 GB x 4 - 145.4 GB = 142.6 GB free; a token's K and V
        >>> # over 80 layers x 8 KV heads x 128 dims in bf16 is 327,680 bytes; at 400 + 20,000
        >>> # tokens a sequence needs 6.68 GB, so 21 fit (at the mean 6.3K, 69 would).
        >>> kv_batch_limit(QWEN25["72b"], H800, 400 + 20000)
        21
    """
    free = 0.9 * gpu.hbm_gb * 1e9 * model.gen_tp - model.weight_bytes
    return int(min(512, max(8, free // (model.kv_bytes_per_token * context_tokens))))


def trainer_cost(model: ModelShape, gpu: GPU = H800) -> TrainerCostModel:
    """PPO training cost per token on one trainer unit of ``model.train_unit_gpus`` GPUs."""
    flops = PPO_FLOPS_PER_PARAM_TOKEN * model.params
    unit_flops = model.train_unit_gpus * gpu.tflops_bf16 * 1e12 * MFU
    return TrainerCostModel(
        flops / unit_flops, step_s=0.5, unit_gpus=model.train_unit_gpus, dp_efficiency=DP_EFFICIENCY
    )


def colocated_switch_s(model: ModelShape) -> float:
    """One switch of the colocated GPUs between stages (three models' shard over the host link)."""
    return 3 * model.weight_bytes / model.train_unit_gpus / (HOST_LINK_GB_S * 1e9)
