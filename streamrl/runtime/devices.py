"""Where the trainer runs and which GPUs the generators take: one value, resolved before any work.

"A device is a value, not a guess" (STYLE.md, 18): the config names the trainer's accelerator,
processes and GPUs (``trainer.accelerator``, ``trainer.devices``, ``trainer.num_nodes``,
``trainer.precision``) and the generators' GPUs (``rl.generation.gpus_per_instance``,
``rl.generation.gpu_ids``);
``resolve_placement`` turns them into a ``Placement`` against this machine's GPU inventory
(``cuda_device_count``) or refuses with a ``ConfigError`` naming the key and the fix. Nothing
downstream picks ``cuda:0`` or ``cuda:1+i`` by habit: Lightning gets
``Placement.lightning_devices()``, a local generator instance ``Placement.generator_device(i)``.

GPU indices are those torch numbers on this machine (``cuda:k``, after any
``CUDA_VISIBLE_DEVICES``); ``trainer_gpus`` are the same on every node of a multi-node run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

from streamrl.errors import ConfigError, unknown_name

Accelerator = Literal["auto", "cpu", "cuda"]
Precision = Literal["32-true", "bf16-mixed"]
#: The trainer precisions streamrl supports (Lightning's names).
PRECISIONS: tuple[Precision, ...] = ("32-true", "bf16-mixed")
ACCELERATORS: tuple[Accelerator, ...] = ("auto", "cpu", "cuda")


def cuda_device_count() -> int:
    """GPUs this process can see (0 without CUDA).

    The inventory every resolution reads; tests replace it
    (``monkeypatch.setattr(streamrl.runtime.devices, "cuda_device_count", lambda: 8)``).

    Returns:
        ``torch.cuda.device_count()``: 0 on a CPU-only torch or a machine without a GPU.
    """
    import torch

    return torch.cuda.device_count()


def gpu_memory_bytes(index: int) -> int:
    """Total memory of GPU ``index`` (``cuda:index``), what ``streamrl fit``'s memory checks
    compare their estimates with; tests replace it, as ``cuda_device_count``."""
    import torch

    return int(torch.cuda.get_device_properties(index).total_memory)


def host_memory_bytes() -> int:
    """This machine's available memory (``MemAvailable``), what a one-file checkpoint gathered
    on rank 0 must fit in; tests replace it."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


@dataclass(frozen=True)
class Placement:
    """Where the trainer runs and which GPUs local generator instances take.

    Attributes:
        accelerator: ``"cpu"`` or ``"cuda"`` (``"auto"`` resolved).
        ranks_per_node: trainer processes on this node.
        num_nodes: nodes the trainer spans.
        trainer_gpus: GPU indices the trainer ranks of this node use; ``()`` on the CPU.
        generator_gpus: GPU indices local generator instances take, round-robin; ``()`` when
            generating on the CPU. On Ray, the GPUs of this machine a local Ray cluster may hand
            to its actors (Ray gives each actor its own; the trainer's are never among them).
        precision: the trainer's precision (Lightning's name).

    Examples:
        >>> p = Placement("cuda", 2, 1, (0, 1), (2, 3), "bf16-mixed")
        >>> p.lightning_devices(), p.generator_device(3), p.sharded
        ([0, 1], 'cuda:3', True)
    """

    accelerator: Literal["cpu", "cuda"]
    ranks_per_node: int
    num_nodes: int
    trainer_gpus: tuple[int, ...]
    generator_gpus: tuple[int, ...]
    precision: Precision

    @property
    def ranks(self) -> int:
        """Trainer processes in all: ``ranks_per_node * num_nodes``."""
        return self.ranks_per_node * self.num_nodes

    @property
    def sharded(self) -> bool:
        """Whether the trainer uses FSDP2: more than one rank, or ``bf16-mixed`` (the
        mixed-precision policy is FSDP2's)."""
        return self.ranks > 1 or self.precision == "bf16-mixed"

    def lightning_devices(self) -> int | list[int]:
        """What Lightning's ``Trainer(devices=...)`` takes: the GPU indices on CUDA, the number
        of processes on the CPU."""
        return list(self.trainer_gpus) if self.accelerator == "cuda" else self.ranks_per_node

    def generator_device(self, instance_id: int) -> str:
        """The torch device of local generator instance ``instance_id``.

        Args:
            instance_id: the instance's id; instances take ``generator_gpus`` round-robin.

        Returns:
            ``"cpu"`` without generator GPUs, else ``"cuda:k"``.
        """
        if not self.generator_gpus:
            return "cpu"
        return f"cuda:{self.generator_gpus[instance_id % len(self.generator_gpus)]}"


def resolve_placement(
    accelerator: str = "auto",
    devices: int | list[int] | None = None,
    num_nodes: int = 1,
    precision: str | None = None,
    *,
    generator_gpus_per_instance: int = 0,
    generator_devices: list[int] | None = None,
    local_generators: bool = True,
    share_trainer_gpus: bool = False,
) -> Placement:
    """Resolve the trainer's and the generators' devices against this machine's GPUs.

    Args:
        accelerator: ``trainer.accelerator``: ``"auto"`` (CUDA when a GPU is visible, else the
            CPU), ``"cpu"`` or ``"cuda"``.
        devices: ``trainer.devices``: a number of processes (on CUDA: GPUs ``0..n-1``), or on
            CUDA a list of GPU indices; ``None`` is 1.
        num_nodes: ``trainer.num_nodes``.
        precision: ``trainer.precision``, one of ``PRECISIONS``; ``None`` is ``"bf16-mixed"``
            on CUDA and ``"32-true"`` on the CPU.
        generator_gpus_per_instance: ``rl.generation.gpus_per_instance``: GPUs per generator
            instance (0: the CPU).
        generator_devices: ``rl.generation.gpu_ids``: the GPU indices local generator instances
            take; ``None``: every GPU the trainer does not hold.
        local_generators: whether generator instances run on this machine's GPUs (a local
            cluster); ``False`` on Ray, which assigns each actor its GPUs out of
            ``generator_gpus`` when it starts a local cluster here.
        share_trainer_gpus: ``trainer.share_gpus``: let the generators use the trainer's
            GPUs too (a one-GPU machine, a check): no overlap is refused, and by default the
            generators take every GPU.

    Returns:
        The ``Placement``.

    Raises:
        ConfigError: an unknown or impossible value (CUDA without a GPU, a GPU index out of
            range or repeated, a list of GPUs on the CPU), the trainer and the generators
            sharing a GPU, or no GPU left for the generators.
    """
    count = cuda_device_count()
    kind = _accelerator(accelerator, count)
    ranks_per_node, trainer_gpus = _trainer_devices(kind, devices, count)
    if num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes must be >= 1, got {num_nodes}.")
    if precision is None:
        precision = "bf16-mixed" if kind == "cuda" else "32-true"
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision: {unknown_name('precision', precision, PRECISIONS)}")
    generator_gpus = _generator_gpus(
        () if share_trainer_gpus else trainer_gpus,
        count,
        generator_gpus_per_instance,
        generator_devices,
        local_generators,
    )
    return Placement(kind, ranks_per_node, num_nodes, trainer_gpus, generator_gpus, precision)


def _accelerator(accelerator: str, count: int) -> Literal["cpu", "cuda"]:
    if accelerator not in ACCELERATORS:
        raise ConfigError(
            f"trainer.accelerator: {unknown_name('accelerator', accelerator, ACCELERATORS)}"
        )
    if accelerator == "auto":
        return "cuda" if count > 0 else "cpu"
    if accelerator == "cuda" and count == 0:
        raise ConfigError(
            "trainer.accelerator is 'cuda' but this machine has no GPU (torch.cuda.is_available() "
            "is False); set trainer.accelerator: cpu (or auto), or run on a GPU machine with a "
            "CUDA build of torch."
        )
    return "cpu" if accelerator == "cpu" else "cuda"


def _trainer_devices(
    kind: str, devices: int | Sequence[int] | None, count: int
) -> tuple[int, tuple[int, ...]]:
    """``(ranks_per_node, trainer_gpus)`` from ``trainer.devices``."""
    if devices is None:
        devices = 1
    if isinstance(devices, (list, tuple)):
        if kind == "cpu":
            raise ConfigError(
                f"trainer.devices is {list(devices)} on the CPU: a list names GPU indices; on "
                "the CPU give a number of processes (trainer.devices: 2)."
            )
        gpus = _gpu_list("trainer.devices", devices, count)
        return len(gpus), gpus
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(
            f"trainer.devices must be a number of processes >= 1 or a list of GPU indices, got "
            f"{devices!r}."
        )
    if kind == "cpu":
        return devices, ()
    if devices > count:
        raise ConfigError(
            f"trainer.devices is {devices} but this machine has {count} GPU(s); ask for at most "
            f"{count}, or name the GPUs (trainer.devices: [0, 1])."
        )
    return devices, tuple(range(devices))


def _gpu_list(key: str, ids: Sequence[int], count: int) -> tuple[int, ...]:
    """``ids`` as a tuple, checked: non-empty, unique, each a GPU of this machine."""
    if not ids:
        raise ConfigError(f"{key} is an empty list; name at least one GPU index (e.g. [0]).")
    repeated = sorted({i for i in ids if list(ids).count(i) > 1})
    if repeated:
        raise ConfigError(f"{key} {list(ids)} repeats GPU(s) {repeated}; name each GPU once.")
    outside = [i for i in ids if not 0 <= i < count]
    if outside:
        raise ConfigError(
            f"{key} {list(ids)} names GPU(s) {outside} but this machine has {count} "
            f"(indices 0..{count - 1}); use indices in that range."
            if count
            else f"{key} {list(ids)} names GPUs but this machine has none; drop {key}."
        )
    return tuple(ids)


def _generator_gpus(
    trainer_gpus: tuple[int, ...],
    count: int,
    gpus_per_instance: int,
    generator_devices: Sequence[int] | None,
    local_generators: bool,
) -> tuple[int, ...]:
    """The GPUs local generator instances take (on Ray: the GPUs of this machine a local Ray
    cluster may hand out); ``()`` on the CPU."""
    if gpus_per_instance < 0:
        raise ConfigError(
            "rl.generation.gpus_per_instance must be >= 0 (0 generates on the CPU), got "
            f"{gpus_per_instance}."
        )
    if gpus_per_instance == 0:
        if generator_devices is not None:
            raise ConfigError(
                f"rl.generation.gpu_ids is {list(generator_devices)} but "
                "rl.generation.gpus_per_instance is 0: generators run on the CPU and would "
                "ignore it; set rl.generation.gpus_per_instance: 1 or drop gpu_ids."
            )
        return ()
    if local_generators and count == 0:
        raise ConfigError(
            f"rl.generation.gpus_per_instance={gpus_per_instance} but this machine has no CUDA "
            "GPU (torch.cuda.is_available() is False); drop --gpus / set "
            "rl.generation.gpus_per_instance: 0 to generate on the CPU, or use a CUDA torch on a "
            "GPU machine."
        )
    if generator_devices is not None:
        gpus = _gpu_list("rl.generation.gpu_ids", generator_devices, count)
        shared = sorted(set(gpus) & set(trainer_gpus))
        if shared:
            raise ConfigError(
                f"trainer.devices {list(trainer_gpus)} and rl.generation.gpu_ids {list(gpus)} "
                f"share GPU(s) {shared}: a GPU either trains or generates; give each GPU to one "
                "of the two lists (or set trainer.share_gpus: true to share them on purpose)."
            )
        return gpus
    gpus = tuple(g for g in range(count) if g not in trainer_gpus)
    if not gpus and local_generators:
        raise ConfigError(
            f"the trainer holds all {count} GPUs of this machine ({list(trainer_gpus)}); leave "
            "some to the generators (trainer.devices) or generate on the CPU "
            "(rl.generation.gpus_per_instance: 0)."
        )
    return gpus


def pin_visible_gpu(device: str, environ: MutableMapping[str, str] | None = None) -> str:
    """Make a local generator instance on ``cuda:k`` see that GPU only, before CUDA starts in
    its process: ``CUDA_VISIBLE_DEVICES`` becomes the k-th GPU this process sees (the parent's
    own ``CUDA_VISIBLE_DEVICES`` respected), so an engine that takes "the" GPU (vLLM) and NCCL's
    current device are that one, never the trainer's ``cuda:0``. ``cuda:k,l`` (a
    tensor-parallel instance's set) makes it see those. Returns the device as the process then
    names it (``cuda:0``); any other device (``cpu``; ``cuda`` under Ray, which sets the
    variable itself) is returned unchanged.

    Examples:
        >>> env = {"CUDA_VISIBLE_DEVICES": "4,5,6"}
        >>> pin_visible_gpu("cuda:2", env), env["CUDA_VISIBLE_DEVICES"]
        ('cuda:0', '6')
        >>> env = {}
        >>> pin_visible_gpu("cuda:2,3", env), env["CUDA_VISIBLE_DEVICES"], visible_gpu_count(env)
        ('cuda:0', '2,3', 2)
        >>> pin_visible_gpu("cpu", env)
        'cpu'
    """
    if not device.startswith("cuda:"):
        return device
    environ = os.environ if environ is None else environ
    indices = [int(i) for i in device.split(":", 1)[1].split(",")]
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    outside = [i for i in indices if visible and i >= len(visible)]
    if outside:
        raise ConfigError(
            f"generator device {device} is not among the {len(visible)} GPUs this process sees "
            f"(CUDA_VISIBLE_DEVICES={','.join(visible)})."
        )
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] if visible else str(i) for i in indices)
    return "cuda:0"


def visible_gpu_count(environ: Mapping[str, str] | None = None) -> int:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` lets this process see (what ``pin_visible_gpu`` set),
    without starting CUDA; ``torch.cuda.device_count()`` when the variable is unset."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return cuda_device_count()
    return len([d for d in listed.split(",") if d.strip()])
