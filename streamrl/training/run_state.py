"""What a resumed run needs beyond weights and optimizer state (Lightning checkpoints those):
where the trainer, the prompt stream and the in-flight iterations are, and every component's
state. ``StreamRLModule``'s checkpoint hooks call these two functions."""

from __future__ import annotations

from typing import Any, Protocol

from streamrl.runtime.rng_state import rng_state, set_rng_state


class RunStateOwner(Protocol):
    """What the two functions read and set (``StreamRLModule`` is one)."""

    weight_version: int
    samples_trained: int
    samples_in_step: int  # back-propagated in an iteration whose optimizer step is not done
    rollouts: Any  # a RolloutStream, or None on an FSDP rank > 0
    elastic: Any  # an ElasticController, or None
    algorithm: Any  # an Algorithm
    pipeline: Any  # a DynamicBatchPipeline
    dropped_stale_settled: int  # samples dropped as stale by the iterations trained


def save_run_state(module: RunStateOwner, checkpoint: dict) -> None:
    """Add the run's state to ``checkpoint`` (under ``"streamrl"``); an FSDP rank > 0 adds
    nothing: the stream is rank 0's. Written mid-iteration (a stopped run), it holds the last
    finished iteration: the one under way is in flight, generated and trained again on resume."""
    rollouts = module.rollouts
    if rollouts is None:
        return
    checkpoint["streamrl"] = {
        "weight_version": module.weight_version,
        "samples_trained": module.samples_trained - module.samples_in_step,
        "dropped_stale": module.dropped_stale_settled,
        "rollouts": rollouts.state_dict(),
        "elastic": module.elastic.state_dict() if module.elastic else None,
        "algorithm": module.algorithm.state_dict(),
        "prompt_source": rollouts.prompts.state_dict(),
        "length_ranker": rollouts.ranker.state_dict() if rollouts.ranker else None,
        "dispatcher": rollouts.service.dispatcher.state_dict(),
        "rng": rng_state(),
    }


def load_run_state(module: RunStateOwner, checkpoint: dict) -> None:
    """Restore what ``save_run_state`` wrote (older checkpoints lack some keys); in-flight
    iterations are dispatched again with the same prompts."""
    # Checkpoints written before the reference stopped being a submodule still hold it.
    weights = checkpoint.get("state_dict", {})
    for key in [k for k in weights if k.startswith("reference.")]:
        del weights[key]
    state = checkpoint.get("streamrl")
    if state is None:
        return
    module.weight_version = state["weight_version"]
    module.samples_trained = state.get("samples_trained", 0)
    module.pipeline.dropped_stale = module.dropped_stale_settled = state.get("dropped_stale", 0)
    if "algorithm" in state:
        module.algorithm.load_state_dict(state["algorithm"])
    if "rng" in state:
        set_rng_state(state["rng"])
    rollouts = module.rollouts
    if rollouts is None:  # an FSDP rank > 0: the stream's state is rank 0's
        return
    rollouts.prompts.load_state_dict(state["prompt_source"])
    if "rollouts" in state:
        rollouts.load_state_dict(state["rollouts"])
    if module.elastic is not None and state.get("elastic") is not None:
        module.elastic.load_state_dict(state["elastic"])
    if rollouts.ranker is not None and state["length_ranker"] is not None:
        rollouts.ranker.load_state_dict(state["length_ranker"])
    if "dispatcher" in state:  # what it learned of the length distribution D (§5.3)
        rollouts.service.dispatcher.load_state_dict(state["dispatcher"])
