"""One case of ``streamrl bench weights``, in a process of its own (``python -m
streamrl.bench.weights_case --case JSON``): this process is trainer rank 0; it starts the other
trainer ranks and the generator instances, pushes ``versions`` weight versions and prints one
JSON line of figures.

- ``new``: the library's path. Each version is staged tensor by tensor (gathered from the FSDP2
  shards with more than one trainer rank) into a host copy in the wire dtype and sent by
  ``AsyncWeightSync`` from there to a ``StreamGenerationService`` of HF-engine instances in that
  dtype, one copy per version down a chain, each instance receiving into its staging and
  loading from it.
- ``old``: the path as it was before (the reference, kept here only): the full float32 state
  gathered on every rank (``full_state``), cloned, and broadcast tensor by tensor to each
  instance in turn over a group of its own; each instance receives into fresh full-model
  buffers, then copies them into its model.

Memory is the resident set's peak during the pushes above the resident set before them (Linux
``VmHWM``, reset through ``/proc/<pid>/clear_refs``), for this process and for every instance,
after one untimed warm-up version (so that weights mapped from the checkpoint file and made
private at their first write are not counted as the sync's). The host staging copy, resident
since the warm-up, is added back: it exists for the sync, and on the CPU it is inside the peak,
so it is also reported apart (``staging_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WeightsCase", "measure_case"]

#: vLLM instances in a bench: eager, a small KV cache (nothing is generated).
VLLM_OPTIONS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_model_len": 256}


@dataclass(frozen=True)
class WeightsCase:
    """One case: a path, a number of instances and trainer ranks, on one model directory."""

    path: str  # "old", "new" (HF instances), "vllm" (its staging path) or "protocol" (vLLM's)
    instances: int
    trainer_ranks: int
    model_dir: str
    versions: int = 3
    bucket_bytes: int = 256 * 2**20
    wire_dtype: str = "bfloat16"  # the new path's (the old path's was always float32)
    timeout_s: float = 900.0


def measure_case(case: WeightsCase) -> dict[str, Any]:
    """Run ``case`` (this process is trainer rank 0) and return its figures."""
    port = _free_port()
    ranks = [
        mp.get_context("spawn").Process(target=_rank_main, args=(rank, port, case), daemon=True)
        for rank in range(1, case.trainer_ranks)
    ]
    for process in ranks:
        process.start()
    try:
        model = _trainer_model(0, port, case)
        push = _OldPush(case, model) if case.path == "old" else _NewPush(case, model)
        try:
            result = _push_versions(case, model, push)
        finally:
            push.close()
        if dist.is_initialized():
            dist.barrier()  # the other ranks leave with us
    finally:
        for process in ranks:
            process.join(60)
            if process.is_alive():
                process.kill()
    return result


def _push_versions(case: WeightsCase, model: torch.nn.Module, push: Any) -> dict[str, Any]:
    pids = push.instance_pids()
    _nudge(model)
    push.push(1)  # the warm-up version, untimed
    time.sleep(1.0)  # let it settle: its transient pages are not the next ones'
    before = {pid: _status_kb(pid, "VmRSS") for pid in [os.getpid(), *pids]}
    peak = dict.fromkeys(before, 0)
    seconds = []
    for version in range(2, case.versions + 2):
        _nudge(model)
        for pid in before:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak restarts from now
        started = time.perf_counter()
        push.push(version)
        seconds.append(time.perf_counter() - started)
        for pid in before:
            peak[pid] = max(peak[pid], _status_kb(pid, "VmHWM"))
    # the staging, resident since the warm-up, added back (an instance's has the same layout)
    staging = {pid: push.generator_staging_bytes for pid in pids}
    staging[os.getpid()] = push.staging_bytes
    extra = {pid: (peak[pid] - before[pid]) * 1024 + staging[pid] for pid in before}
    wire = push.wire_dtype
    return {
        "path": case.path,
        "instances": case.instances,
        "trainer_ranks": case.trainer_ranks,
        "versions": case.versions,
        "seconds_per_version": round(statistics.median(seconds), 3),
        "seconds_each": [round(s, 3) for s in seconds],
        "trainer_peak_extra_bytes": extra[os.getpid()],
        "generator_peak_extra_bytes": max(extra[pid] for pid in pids),
        "egress_bytes_per_version": push.bytes_sent // (case.versions + 1),
        "model_bytes": sum(p.numel() for p in model.parameters()) * _itemsize(wire),
        "wire_dtype": str(wire).removeprefix("torch."),
        "bucket_bytes": case.bucket_bytes if case.path != "old" else None,
        "staging_bytes": push.staging_bytes,
        "generator_staging_bytes": push.generator_staging_bytes,
        "consistent": push.consistent(),
    } | push.join_figures(case.versions + 2)


class _NewPush:
    """The library's path: stage, then ``StreamGenerationService.update`` (HF instances; vLLM
    instances on their staging, or on vLLM's weight-transfer protocol)."""

    def __init__(self, case: WeightsCase, model: torch.nn.Module) -> None:
        from streamrl.components.generation.engines import HFEngine, VLLMEngine
        from streamrl.components.generation.service import StreamGenerationService
        from streamrl.components.generation.timeouts import Timeouts
        from streamrl.components.weights.path import WeightPath

        self.case, self.model = case, model
        self.wire_dtype = getattr(torch, case.wire_dtype)
        vllm = case.path in ("vllm", "protocol")
        engine = (
            VLLMEngine(options=VLLM_OPTIONS | {"dtype": case.wire_dtype})
            if vllm
            else HFEngine(dtype=case.wire_dtype)
        )
        self.service = StreamGenerationService(
            case.model_dir,
            case.instances,
            engine=engine,
            max_batch_size=1,
            weights=WeightPath(
                bucket_mb=case.bucket_bytes / 2**20, protocol=case.path == "protocol"
            ),
            timeouts=Timeouts(*[case.timeout_s] * 4),
            partial_rollout="keep" if vllm else "finish",
        ).start()
        self.named = list(model.named_parameters())

    @property
    def generator_staging_bytes(self) -> int:
        """An instance's host staging: the trainer's layout, none with vLLM's protocol."""
        return 0 if self.case.path == "protocol" else self.staging_bytes

    def instance_pids(self) -> list[int]:
        return [h.proc.pid for h in self.service.pool.handles]

    def push(self, version: int) -> None:
        from streamrl.components.weights.sync import stage

        staged = stage(self.named, self.service.weight_sync, version, self.wire_dtype)
        self.service.update(staged, version)

    @property
    def bytes_sent(self) -> int:
        return self.service.weight_sync.bytes_sent

    @property
    def staging_bytes(self) -> int:
        return self.service.weight_sync.staged.nbytes

    def join_figures(self, version: int) -> dict[str, Any]:
        """With vLLM's protocol, what a newcomer costs (``SharedBroadcast``): one more instance
        catches up alone on the last version (``catch_up_s``), then ``version`` forms the
        shared group again with it (``formed_s``, and the seconds of that whole version)."""
        if self.case.path != "protocol" or self.case.trainer_ranks != 1:
            return {}  # (another trainer rank would not join the extra version's gathers)
        shared = self.service.pool.feeds.shared
        formed_before = list(shared.formed_s)
        self.service.add_instance(wait=True)
        caught_up = shared.alone_s[-1]
        _nudge(self.model)
        started = time.perf_counter()
        self.push(version)
        return {
            "first_formed_s": round(formed_before[0], 3) if formed_before else None,
            "catch_up_s": round(caught_up[1], 3),
            "formed_again_s": round(shared.formed_s[-1], 3),
            "version_with_newcomer_s": round(time.perf_counter() - started, 3),
        }

    def consistent(self) -> bool:
        """Every instance holds the trainer's weights: equal fingerprints (HF), or the
        checksums of the first version checked on each (vLLM keeps no HF copy)."""
        if self.case.path in ("vllm", "protocol"):
            return self.service.counts["weight_versions_verified"] == self.case.instances
        return len(set(self.service.fingerprints().values())) == 1

    def close(self) -> None:
        self.service.close()


class _OldPush:
    """The old path (module docstring): full state, clone, a star of per-tensor broadcasts."""

    def __init__(self, case: WeightsCase, model: torch.nn.Module) -> None:
        from streamrl.components.weights.transport import WeightGroup, make_store

        self.case, self.model = case, model
        self.wire_dtype, self.bytes_sent, self.staging_bytes = torch.float32, 0, 0
        self.join_figures = lambda version: {}
        self.generator_staging_bytes = 0
        ctx = mp.get_context("spawn")
        self.stores = [make_store(2, case.timeout_s) for _ in range(case.instances)]
        self.links, self.procs = [], []
        for store in self.stores:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_old_instance_main, args=(store.port, case, theirs), daemon=True
            )
            proc.start()
            self.links.append(mine)
            self.procs.append(proc)
        self.groups = [
            WeightGroup(store.port, 0, 2, store=store, timeout_s=case.timeout_s)
            for store in self.stores
        ]
        self.digests: list[str] = []

    def instance_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def push(self, version: int) -> None:
        from streamrl.components.training.sharding import full_state

        full = full_state(self.model)  # a collective: every rank gathers everything
        snapshot = {name: t.detach().clone() for name, t in full.items()}
        del full
        for link, group in zip(self.links, self.groups):
            link.send(version)
            self.bytes_sent += group.broadcast(snapshot.values())
        del snapshot
        self.digests = [_recv(link, self.case.timeout_s) for link in self.links]

    def consistent(self) -> bool:
        return len(set(self.digests)) == 1

    def close(self) -> None:
        for link in self.links:
            link.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _old_instance_main(port: int, case: WeightsCase, link: Any) -> None:
    """An old-path instance: fresh full-model buffers per version, then a copy into the model."""
    from streamrl.components.generation.hf_weights import copy_into, fingerprint
    from streamrl.components.weights.transport import WeightGroup
    from streamrl.policy.models import load_policy

    torch.set_num_threads(1)
    model, _ = load_policy(case.model_dir)
    group = WeightGroup(port, 1, 2, timeout_s=case.timeout_s)
    while (version := link.recv()) is not None:
        buffers = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
        group.broadcast(buffers.values())
        copy_into(model, buffers)
        del buffers
        link.send(fingerprint(model) if version == case.versions + 1 else "")


def _rank_main(rank: int, port: int, case: WeightsCase) -> None:
    """Trainer rank > 0: its shard of the model, joining each version's gathers."""
    torch.set_num_threads(1)
    model = _trainer_model(rank, port, case)
    names = list(model.named_parameters())
    wire = getattr(torch, case.wire_dtype)
    for version in range(1, case.versions + 2):  # the warm-up version too
        _nudge(model)
        if case.path == "new":
            from streamrl.components.weights.staging import stage_parameters

            stage_parameters(names, None, version, wire)
        else:
            from streamrl.components.training.sharding import full_state

            full_state(model)
    dist.barrier()


def _trainer_model(rank: int, port: int, case: WeightsCase) -> torch.nn.Module:
    """The policy in float32 on this trainer rank: whole with one rank, else FSDP2-sharded."""
    from streamrl.policy.models import load_policy

    model, _ = load_policy(case.model_dir)
    if case.trainer_ranks == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh

    from streamrl.components.training.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=case.trainer_ranks)
    mesh = init_device_mesh("cpu", (case.trainer_ranks,))
    return shard_model(model, mesh)


def _nudge(model: torch.nn.Module) -> None:
    """What an optimizer step does to the weights, for the bench: every one changes."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1e-3)


def _recv(link: Any, timeout_s: float) -> Any:
    if not link.poll(timeout_s):
        raise TimeoutError(f"an old-path instance sent nothing within {timeout_s:g} s")
    return link.recv()


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m streamrl.bench.weights_case", description="one case of bench weights"
    )
    parser.add_argument("--case", required=True, help="a WeightsCase as JSON")
    case = WeightsCase(**json.loads(parser.parse_args().case))
    from streamrl.runtime.quiet import quiet_libraries

    quiet_libraries()
    print(json.dumps({"case": asdict(case), **measure_case(case)}), flush=True)


if __name__ == "__main__":
    _main()
