"""A single-machine run listens on loopback only: every rendezvous store and gloo group it opens
(the trainer ranks', the weight groups', vLLM's protocol) is bound to 127.0.0.1, never to every
interface, so nothing on the network can write into a run's stores."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import yaml

from streamrl.components.weights.transport import WeightGroup, make_store


def _listening(root: psutil.Process) -> set[tuple[str, int, str]]:
    """``(address, port, process name)`` of every listening TCP socket of ``root``'s tree."""
    found = set()
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for process in tree:
        try:
            for connection in process.net_connections("inet"):
                if connection.status == psutil.CONN_LISTEN:
                    found.add((connection.laddr.ip, connection.laddr.port, process.name()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _off_loopback(sockets: set[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    return sorted(s for s in sockets if not ipaddress.ip_address(s[0]).is_loopback)


def _other_interface() -> str | None:
    """A network interface that is not loopback and has an IPv4 address, if any."""
    for _, name in socket.if_nameindex():
        addresses = psutil.net_if_addrs().get(name, [])
        if not name.startswith("lo") and any(a.family == socket.AF_INET for a in addresses):
            return name
    return None


@pytest.mark.parametrize("gloo_interface", [None, "network"])
def test_a_weight_group_and_its_store_listen_on_loopback_only(gloo_interface, monkeypatch):
    """Also when gloo's default would be a network interface (``GLOO_SOCKET_IFNAME``, or a host
    name that resolves to one): a local group binds its pairs to loopback itself."""
    if gloo_interface is not None:
        other = _other_interface()
        if other is None:
            pytest.skip("this machine has no network interface but loopback")
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", other)
    store, groups = make_store(2, timeout_s=10), []

    def receive() -> None:
        groups.append(WeightGroup(store.port, 1, 2, timeout_s=10))
        groups[-1].broadcast([torch.zeros(4)])

    member = threading.Thread(target=receive)
    member.start()
    groups.append(WeightGroup(store.port, 0, 2, store=store, timeout_s=10))
    groups[-1].broadcast([torch.ones(4)])
    member.join(10)
    sockets = _listening(psutil.Process())  # while both groups are open
    assert any(port == store.port for _, port, _ in sockets)
    assert len(sockets) >= 3  # the store, and each member's gloo pair
    assert _off_loopback(sockets) == []


@pytest.mark.timeout(900)
def test_a_local_fit_with_two_trainer_ranks_and_two_generators_listens_on_loopback_only(tmp_path):
    """``streamrl fit`` with 2 FSDP trainer ranks and 2 generator instances: its process tree's
    listening sockets, sampled every 50 ms from start to end, are all on loopback."""
    config = {
        "output_dir": str(tmp_path / "out"),
        "seed": 0,
        "data": {"tasks": ["copy"], "n_train": 32, "n_heldout": 4, "median_len": 3, "max_len": 6},
        "sft": {"model_size": "test", "steps": 2},
        "trainer": {"devices": 2},
        "rl": {
            "iterations": 2,
            "prompts_per_iteration": 4,
            "group_size": 2,
            "generation": {"num_instances": 2},
            "rollouts": {"max_tokens": 8},
            "module": {"mode": "async"},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    run = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli.main", "fit", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    root, seen = psutil.Process(run.pid), set()
    deadline = time.monotonic() + 840
    while run.poll() is None and time.monotonic() < deadline:
        seen |= _listening(root)
        time.sleep(0.05)
    if run.poll() is None:
        run.kill()
    output = run.communicate()[0]
    assert run.returncode == 0, output[-3000:]
    ports = {port for _, port, _ in seen}
    assert len(ports) >= 4, seen  # the ranks' store and group, the generators' weight groups
    assert _off_loopback(seen) == [], output[-2000:]
