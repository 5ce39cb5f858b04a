"""Memory soak: run the demo loop for a long time and sample the resident memory of every process.

The stream must not grow memory however long it runs (bounded sample pipes, bounded trace,
bounded ranker buffer). This runs ``streamrl fit`` on the demo config with many iterations,
samples RSS of the trainer and of each generator process every ``--every`` seconds, and writes
``rss.csv``, ``rss.png`` and a JSON line: RSS after warm-up, at the end, and the fitted slope.

    python scripts/soak_rss.py --minutes 30 --out runs/soak
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import yaml


def sample(proc: psutil.Process) -> dict[str, float]:
    """RSS in MiB of the trainer and of its generator children (summed)."""
    rss = {"trainer": proc.memory_info().rss / 2**20, "generators": 0.0}
    for child in proc.children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):  # a generator instance
                rss["generators"] += child.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return rss


def slope_mib_per_h(t_s: np.ndarray, rss: np.ndarray) -> float:
    return float(np.polyfit(t_s / 3600, rss, 1)[0]) if len(t_s) > 2 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=3.0, help="minutes ignored for the slope")
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(Path("configs/demo.yaml").read_text())
    config["rl"]["iterations"] = 100_000  # stopped by time, not by iterations
    config["output_dir"] = str(out / "run")
    (out / "soak.yaml").write_text(yaml.safe_dump(config))
    cmd = [
        sys.executable,
        "-m",
        "streamrl.cli.main",
        "fit",
        "--config",
        str(out / "soak.yaml"),
        "--no-progress",
    ]
    with open(out / "fit.log", "w") as log:
        rows = _watch(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log), args)
    data = np.array(rows)
    lines = [",".join(f"{v:.2f}" for v in row) for row in rows]
    (out / "rss.csv").write_text("t_s,trainer_mib,generators_mib\n" + "\n".join(lines))
    steady = data[data[:, 0] >= args.warmup * 60]
    result = {
        "minutes": round(data[-1, 0] / 60, 1),
        "trainer_mib_after_warmup": round(float(steady[0, 1]), 1),
        "trainer_mib_end": round(float(data[-1, 1]), 1),
        "trainer_slope_mib_per_h": round(slope_mib_per_h(steady[:, 0], steady[:, 1]), 1),
        "generators_mib_after_warmup": round(float(steady[0, 2]), 1),
        "generators_mib_end": round(float(data[-1, 2]), 1),
        "generators_slope_mib_per_h": round(slope_mib_per_h(steady[:, 0], steady[:, 2]), 1),
    }
    _plot(data, out / "rss.png")
    print(json.dumps(result))
    return 0


def _watch(proc: subprocess.Popen, args: argparse.Namespace) -> list[tuple[float, float, float]]:
    watched = psutil.Process(proc.pid)
    rows: list[tuple[float, float, float]] = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < args.minutes * 60 and proc.poll() is None:
            rss = sample(watched)
            rows.append((time.monotonic() - started, rss["trainer"], rss["generators"]))
            print(
                f"{rows[-1][0]:7.0f} s  trainer {rss['trainer']:7.1f} MiB  generators "
                f"{rss['generators']:7.1f} MiB",
                file=sys.stderr,
            )
            time.sleep(args.every)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the CLI stops its generators and exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def _plot(data: np.ndarray, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(data[:, 0] / 60, data[:, 1], label="trainer")
    ax.plot(data[:, 0] / 60, data[:, 2], label="generators (sum)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("streamrl demo loop, resident memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
