"""LoRA vs full weights: what one update costs (bytes, load time on a generator) and decode
speed, full vs LoRA through the PEFT forward and merged (docs/lora.md).

Run: ``python -m streamrl.bench.lora``.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from streamrl.components.generation.hf_generator import HFStreamGenerator
from streamrl.policy.lora import LoRASpec, MergedLoRA, adapter_weights, apply_lora, sync_bytes
from streamrl.policy.models import build_tiny_model, build_tokenizer
from streamrl.records import Request


def bench_lora(size: str = "demo", r: int = 8, batch: int = 16, tokens: int = 48) -> None:
    """Print what one update costs (bytes, load time on a generator) and decode tokens/s, full
    vs LoRA (through the PEFT forward, and merged); medians of 5 interleaved runs, one thread."""
    torch.set_num_threads(1)
    tok = build_tokenizer()
    plain = build_tiny_model(tok, size).eval()
    lora, merged = (apply_lora(build_tiny_model(tok, size), LoRASpec(r=r)).eval() for _ in "ab")
    with torch.no_grad():  # a trained-looking adapter: B away from its zero start
        for name, p in adapter_weights(lora).items():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    merged.load_state_dict(lora.state_dict())
    merge = MergedLoRA(merged)
    full_b, lora_b = sync_bytes(plain), sync_bytes(adapter_weights(lora))
    print(
        f"{size}: sync per update: full {full_b} B, LoRA r={r} on q/k/v/o {lora_b} B "
        f"({full_b / lora_b:.1f}x fewer)"
    )
    models = {"plain": plain, "lora-peft-forward": lora, "lora-merged": merged}
    gens = {k: HFStreamGenerator(m, max_batch_size=batch, greedy=True) for k, m in models.items()}
    full = {n: p.detach().clone() for n, p in plain.named_parameters()}
    adapters = {n: p.detach().clone() for n, p in adapter_weights(lora).items()}
    loads: dict[str, list[float]] = {label: [] for label in gens}
    rates: dict[str, list[float]] = {label: [] for label in gens}
    outputs: dict[str, list] = {}
    for _ in range(5):
        for label, gen in gens.items():
            started = time.perf_counter()
            with merge.unmerged() if label == "lora-merged" else contextlib.nullcontext():
                gen.load_weights(full if label == "plain" else adapters, 0)
            loads[label].append(time.perf_counter() - started)
        for label, gen in gens.items():
            gen.submit(
                [
                    Request(
                        f"p{i}",
                        tok(f"copy {i}=")["input_ids"],
                        max_tokens=tokens,
                        forced_length=tokens,
                    )
                    for i in range(2 * batch)
                ]
            )
            started = time.perf_counter()
            samples = sorted(gen.stream(), key=lambda s: s.prompt_id)
            rates[label].append(sum(s.length for s in samples) / (time.perf_counter() - started))
            outputs[label] = [s.token_ids for s in samples]
    for label, values in loads.items():
        print(
            f"load one update on the generator ({label}): {1e3 * statistics.median(values):.2f} ms"
        )
    for label, values in rates.items():
        print(f"decode {label}: {statistics.median(values):.0f} tok/s (batch {batch})")
    same = outputs["lora-merged"] == outputs["lora-peft-forward"]
    print(f"merged and PEFT-forward greedy outputs equal: {same}")


if __name__ == "__main__":
    bench_lora()
