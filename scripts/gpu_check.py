"""The steps of scripts/gpu_check.sh, each under `timeout -k`, all under one deadline.

Runs on the lent machine's image as it is (Python 3.12, torch + CUDA 13, no network): only the
standard library here; every step is a process of its own. Each step ends PASS, FAIL or SKIP with
its numbers; the verdict is one JSON object, written to $OUT/gpu_check.json and printed as the last
line of stdout. $OUT holds that file and steps.log (each step's last lines) and nothing else; the
model, the run and their logs stay under the work folder (/tmp/gpu-check).

    OUT=... python3 scripts/gpu_check.py            # on the GPU
    GPU_CHECK_DEVICE=cpu python3 scripts/gpu_check.py  # the same steps on the CPU, small shapes

Steps (limit in seconds): preflight (15: fails fast, every later step SKIPs), gpu-tests (30:
the GPU-marked tests of generation, the NCCL transport and MoE routing replay),
model (30), fit (100: a reward that varies across samples; each iteration's grad norm finite and
> 0, the trainer/generator log-prob gap < 0.05, samples_lost 0, the trainer's peak GPU memory
under FIT_PEAK_BOUND_BYTES), edges (40: sharded load on NCCL, bf16 reference, the save), width
(40: the trainer's step at a 7B width, two layers, against the memory model), weights (30: the
weight sync's GPU path on an HF instance, by checksum), vllm (40, only where vLLM is installed).
A step never starts past the deadline (DEADLINE_S) and never runs past it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The whole script's budget, wheels' install included (the device tool's call leaves room).
DEADLINE_S = 360.0
#: What the verdict needs after the last step.
VERDICT_S = 5.0
#: The trainer's peak GPU memory bound for the 0.5B fit (bf16-mixed, one rank, 8,400-token
#: micro-batches, activation checkpointing): the memory model's estimate for it
#: (``capacity.memory.trainer_memory``: 12.0 GiB, of which 2 GiB runtime reserve) + 25%.
FIT_PEAK_BOUND_BYTES = 15 * 2**30
#: The largest trainer/generator log-prob gap per token (bf16 engine, bf16-mixed trainer).
LOGPROB_GAP_BOUND = 0.05
#: Each step's limit in seconds. With the wheels' install (gpu_check.sh) and the verdict they
#: add up to less than the deadline, so every step can take its whole limit.
LIMITS = {
    "preflight": 15,
    "gpu-tests": 30,
    "model": 30,
    "fit": 100,
    "edges": 40,
    "weights": 30,
    "width": 40,
    "vllm": 40,
}
WHEELS_LIMIT_S = 30


#: A step's judge: its exit code and stdout -> (verdict, numbers).
Judge = Callable[[int, str], tuple[str, dict]]


class Check:
    """Runs the steps in order under one deadline; collects their verdicts."""

    def __init__(self, out: Path, work: Path, device: str, started: float) -> None:
        self.out, self.work, self.device = out, work, device
        self.deadline = started + DEADLINE_S
        self.steps: dict[str, dict] = {}
        self.log = (out / "steps.log").open("w")

    def run(self, name: str, command: list[str]) -> tuple[int, str]:
        """Run ``command`` under ``timeout -k`` within the step's limit and the deadline;
        returns its exit code (124/137: timed out) and stdout. Its logs go to the work folder,
        their last lines to steps.log."""
        limit = min(LIMITS[name], self.deadline - VERDICT_S - time.time())
        if limit < 1:
            return -1, ""
        stdout, stderr = self.work / f"{name}.out", self.work / f"{name}.log"
        with stdout.open("w") as out, stderr.open("w") as err:
            rc = subprocess.call(
                ["timeout", "-k", "5", f"{limit:.0f}", *command], stdout=out, stderr=err, cwd=ROOT
            )
        tail = stderr.read_text(errors="replace").strip().splitlines()[-15:]
        self.log.write(f"== {name}: rc {rc} (limit {limit:.0f} s)\n" + "\n".join(tail) + "\n")
        self.log.flush()
        return rc, stdout.read_text(errors="replace")

    def record(self, name: str, verdict: str, started: float, **numbers: object) -> None:
        self.steps[name] = {
            "verdict": verdict,
            "wall_s": round(time.time() - started, 1),
            **numbers,
        }

    def step(self, name: str, command: list[str], judge: Judge) -> None:
        """Run a step unless an earlier preflight failed or the deadline passed; ``judge(rc,
        stdout)`` gives ``(verdict, numbers)``."""
        started = time.time()
        if self.steps.get("preflight", {}).get("verdict") == "FAIL":
            return self.record(name, "SKIP", started, reason="preflight failed")
        rc, stdout = self.run(name, command)
        if rc == -1:
            return self.record(name, "SKIP", started, reason="no time left before the deadline")
        if rc in (124, 137):
            return self.record(name, "FAIL", started, rc=rc, reason="timed out")
        try:
            verdict, numbers = judge(rc, stdout)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            verdict, numbers = "FAIL", {"rc": rc, "reason": f"unreadable output: {err}"}
        self.record(name, verdict, started, **numbers)


def last_json(stdout: str) -> dict:
    """The last line of ``stdout`` that is a JSON object."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError("no JSON line")
    return json.loads(lines[-1])


def judge_preflight(rc: int, stdout: str) -> tuple[str, dict]:
    found = last_json(stdout)
    return ("PASS" if rc == 0 and found.get("ok") else "FAIL"), found


def judge_tests(rc: int, stdout: str) -> tuple[str, dict]:
    counts = {}
    for word in ("passed", "failed", "skipped", "error", "deselected"):
        for line in stdout.splitlines()[-3:]:
            for part in line.replace(",", " ").split(" in ")[0].split("  "):
                bits = part.strip().split(" ")
                if len(bits) == 2 and bits[1].startswith(word) and bits[0].isdigit():
                    counts[word] = int(bits[0])
    bad = counts.get("failed", 0) + counts.get("error", 0)
    return ("PASS" if rc in (0, 5) and not bad else "FAIL"), {"rc": rc, **counts}


def judge_fit(rc: int, stdout: str, device: str) -> tuple[str, dict]:
    summary = last_json(stdout)
    grads = summary.get("grad_norms", [])
    peak = (summary.get("trainer") or {}).get("peak_memory_bytes_per_rank")
    peak_bytes = max(peak) if isinstance(peak, list) and peak else peak
    checks = {
        "grad_norms_finite_positive": bool(grads) and all(0 < g < float("inf") for g in grads),
        "logprob_gap_below_bound": summary.get("logprob_gap_max", 1.0) < LOGPROB_GAP_BOUND,
        "samples_lost_zero": summary.get("samples_lost") == 0,
        "peak_under_bound": device == "cpu" or (peak_bytes or 0) < FIT_PEAK_BOUND_BYTES,
    }
    numbers = {
        "rc": rc,
        **checks,
        "grad_norms": grads,
        "logprob_gap_max": summary.get("logprob_gap_max"),
        "samples_trained": summary.get("samples_trained"),
        "samples_lost": summary.get("samples_lost"),
        "trainer_peak_gpu_bytes": peak_bytes,
        "peak_bound_bytes": FIT_PEAK_BOUND_BYTES,
        "samples_per_s": summary.get("samples_per_s"),
    }
    return ("PASS" if rc == 0 and all(checks.values()) else "FAIL"), numbers


def judge_ok(rc: int, stdout: str) -> tuple[str, dict]:
    found = last_json(stdout)
    return ("PASS" if rc == 0 and found.get("ok") else "FAIL"), {"rc": rc, **found}


PREFLIGHT = """
import json, sys, importlib
found = {"python": sys.version.split()[0]}
try:
    import torch
    found.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
                 gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    import transformers, lightning, jsonargparse
    found.update(transformers=transformers.__version__, lightning=lightning.__version__)
    importlib.import_module("streamrl.cli.main")  # jsonargparse and its signatures' parser
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    found["hf_engine"] = (major, minor) >= (5, 20)  # HFStreamGenerator's continuous batching
    found["ok"] = found["hf_engine"] and (sys.argv[1] == "cpu" or found["cuda"])
except Exception as err:
    found.update(ok=False, error=f"{type(err).__name__}: {err}")
print(json.dumps(found))
"""


def fit_config(work: Path, device: str) -> Path:
    """The fit's config: 0.5B in bf16 on the GPU; the test shape in float32 on the CPU."""
    cuda = device == "cuda"
    config = {
        "model": str(work / "model"),
        "output_dir": str(work / "fit"),
        "data": {"tasks": ["copy", "count"], "n_train": 32, "n_heldout": 2},
        "rl": {
            "iterations": 2,
            "prompts_per_iteration": 2,
            "group_size": 4,
            "generation": {
                "num_instances": 1,
                "gpus_per_instance": 1 if cuda else 0,
                "max_batch_size": 8,
                "temperature": 1.0,
            },
            "engine": {
                "class_path": "hf",
                "init_args": {"dtype": "bfloat16" if cuda else "float32"},
            },
            "rollouts": {"max_tokens": 512 if cuda else 32},
            "eval": {"max_tokens": 32},
            "micro_batches": {"max_tokens": 8400},
            "reward": "gpu_check_reward:varied",
            "reward_pool": {"workers": 0},
            "correction": {"engine_gap": True},
            "length_predictor": None,
            "checkpoints": {"every": 0},
        },
        "trainer": {
            "accelerator": device,
            "devices": 1,
            "precision": "bf16-mixed" if cuda else "32-true",
            "activation_checkpointing": cuda,
            "share_gpus": cuda,  # one GPU: the generator shares it with the trainer
        },
    }
    path = work / "fit.json"  # JSON is YAML: the CLI reads it as its config file
    path.write_text(json.dumps(config))
    return path


def main() -> None:
    # the shell script's start: the wheels' install counts against the deadline too
    started = float(os.environ.get("GPU_CHECK_STARTED", time.time()))
    device = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    out = Path(os.environ.get("OUT", "gpu-check-out"))
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu-check"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(STREAMRL_CACHE=str(work / "cache"), HF_HOME=str(work / "hf"))
    check = Check(out, work, device, started)
    py = sys.executable
    cli = [py, "-m", "streamrl.cli.main"]
    check.step("preflight", [py, "-c", PREFLIGHT, device], judge_preflight)
    check.step(
        "gpu-tests",
        [
            py,
            "-m",
            "pytest",
            "tests/test_generation_service.py",
            "tests/test_nccl_transport.py",
            "tests/test_routing.py",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
        ],
        judge_tests,
    )
    size = "0.5b" if device == "cuda" else "test"
    check.step(
        "model",
        [*cli, "model", "--size", size, "--out", str(work / "model"), "--context", "1024"],
        lambda rc, _: ("PASS" if rc == 0 else "FAIL", {"rc": rc, "size": size}),
    )
    check.step(
        "fit",
        [*cli, "fit", "--config", str(fit_config(work, device)), "--no-progress"],
        lambda rc, stdout: judge_fit(rc, stdout, device),
    )
    if device == "cuda":
        check.step(
            "edges",
            [py, "scripts/gpu_edges_check.py", str(work / "model"), str(work / "edges")],
            judge_ok,
        )
    else:
        check.record("edges", "SKIP", time.time(), reason="NCCL needs a GPU")
    check.step("width", [py, "scripts/gpu_width_check.py", "--device", device], judge_ok)
    check.step(
        "weights",
        [py, "scripts/gpu_weights_check.py", str(work / "model"), "--device", device],
        judge_ok,
    )
    if subprocess.call([py, "-c", "import vllm"], stderr=subprocess.DEVNULL) == 0:
        check.step(
            "vllm",
            [
                py,
                "scripts/gpu_vllm_check.py",
                str(work / "model"),
                str(work / "vllm"),
                "--device",
                device,
            ],
            judge_ok,
        )
    else:
        check.record("vllm", "SKIP", time.time(), reason="vLLM is not installed here")
    verdict = {
        "verdict": "FAIL" if any(s["verdict"] == "FAIL" for s in check.steps.values()) else "PASS",
        "device": device,
        "wall_s": round(time.time() - started, 1),
        "deadline_s": DEADLINE_S,
        "steps": check.steps,
    }
    check.log.close()
    (out / "gpu_check.json").write_text(json.dumps(verdict, indent=1))
    print(json.dumps(verdict))


if __name__ == "__main__":
    main()
