"""A ``VLLMStreamGenerator`` in a process of its own, called through a pipe: what an instance of
a run is to the trainer (vLLM keeps some modules per process, e.g. its rotary embeddings, so
engines that load weights at the same time must not share one)."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from typing import Any

from test_vllm_generator import ENGINE

#: The longest one call may take.
CALL_TIMEOUT_S = 120.0


def _serve(conn: Any, policy_dir: str, backends: dict[str, str], kwargs: dict) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import importlib

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from streamrl.components.generation.vllm_generator import VLLMStreamGenerator

    for name, path in backends.items():  # test backends, as a vLLM plugin would register them
        module, _, cls = path.partition(":")
        engine = getattr(importlib.import_module(module), cls)
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine)
    generator = VLLMStreamGenerator(policy_dir, max_batch_size=4, greedy=True, **ENGINE, **kwargs)
    conn.send(("ready", None))
    while True:
        method, args = conn.recv()
        if method == "close":
            generator.close()
            conn.send(("ok", None))
            return
        try:
            if method == "generate":  # submit, then stream until idle
                generator.submit(args[0])
                result: Any = list(generator.stream())
            else:
                result = getattr(generator, method)(*args)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class HostedInstance:
    """The generator's methods, each a call into its process (``CALL_TIMEOUT_S`` at most)."""

    def __init__(self, policy_dir: Any, backends: dict[str, str] | None = None, **kwargs) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.proc = context.Process(
            target=_serve, args=(child, str(policy_dir), backends or {}, kwargs), daemon=True
        )
        self.proc.start()
        self._answer()

    def _answer(self) -> Any:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the hosted instance died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the hosted instance did not answer in {CALL_TIMEOUT_S} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(value)
        return value

    def call(self, method: str, *args: Any) -> Any:
        self.conn.send((method, args))
        return self._answer()

    def __getattr__(self, method: str) -> Any:
        return lambda *args: self.call(method, *args)

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
