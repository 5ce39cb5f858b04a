"""The run's sample counts over every start of a resumed run, each counted once (docs/failures.md,
"The ledger").

A checkpoint holds the last finished iteration; iterations in flight at a stop are generated
again on resume (``RolloutStream.state_dict``). So what the stream counted for a prompt still in
flight (samples received, faults of its environment or reward) is *not* carried into the
checkpoint: it is counted again, once, when the prompt is redone. What a prompt of a finished
iteration, or one filtered out of an in-flight iteration (it is not redone), counted is carried.
Events (instances and reward workers restarted, requests requeued, late copies discarded)
happened once whatever was redone, and are summed over the starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = ["StreamLedger"]


class StreamLedger:
    """Counts of the sample stream (``count``) and of events (``events``), resumable.

    Examples:
        >>> ledger = StreamLedger()
        >>> ledger.count("samples_received", iteration=0, prompt_id="a", n=4)
        >>> ledger.count("samples_received", iteration=1, prompt_id="b", n=4)
        >>> state = ledger.state_dict(in_flight={1: ["b"]}, events={"instances_restarted": 1})
        >>> state["counted"], state["events"]
        ({'samples_received': 4}, {'instances_restarted': 1})
    """

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self._by_prompt: dict[tuple[int, str], Counter[str]] = {}  # (iteration, prompt id)
        self._events_before: Counter[str] = Counter()  # summed over the earlier starts

    def count(self, name: str, iteration: int, prompt_id: str, n: int = 1) -> None:
        self.totals[name] += n
        self._by_prompt.setdefault((iteration, prompt_id), Counter())[name] += n

    def settled(self, iteration: int) -> None:
        """``iteration`` is trained: none of its prompts is redone."""
        for key in [k for k in self._by_prompt if k[0] <= iteration]:
            del self._by_prompt[key]

    def events(self, this_start: Mapping[str, int]) -> dict[str, int]:
        """Each event's count over the whole run: the earlier starts' and this one's."""
        names = set(self._events_before) | set(this_start)
        return {k: self._events_before[k] + this_start.get(k, 0) for k in sorted(names)}

    def state_dict(self, in_flight: Mapping[int, Iterable[str]], events: Mapping[str, int]) -> dict:
        """What a checkpoint carries: the counts less those of the prompts ``in_flight``
        (iteration -> prompt ids, redone on resume), and the events so far."""
        counted = Counter(self.totals)
        for iteration, prompt_ids in in_flight.items():
            for pid in prompt_ids:
                counted.subtract(self._by_prompt.get((iteration, pid), Counter()))
        return {
            "counted": {k: v for k, v in sorted(counted.items()) if v},
            "events": self.events(events),
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.totals = Counter(state.get("counted", {}))
        self._events_before = Counter(state.get("events", {}))
        self._by_prompt = {}
