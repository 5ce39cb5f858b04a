"""``streamrl bench memory`` on a tiny shape: the JSON contract, the chunked head's smaller
log-prob peak, and a case out of memory reported while the bench goes on.

Each case is a fresh Python process (a few seconds of imports each): six processes in all.
"""

from __future__ import annotations

import json

import pytest

from streamrl.cli.main import main

# hidden 64, 2 layers, 4 heads, 2 KV heads: a ~0.4M-parameter model whose head dominates.
TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2"]


def _bench(capsys, *argv: str) -> dict:
    assert main(["bench", "memory", *TINY, *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_bench_memory_reports_both_paths_and_the_chunked_head_peaks_lower(capsys):
    # 32-token chunks: at this vocabulary the default chunk would hold every scored token.
    result = _bench(capsys, "--vocab", "4096", "--seq", "64,256", "--chunk-tokens", "32")
    cases = {(c["path"], c["seq"]): c for c in result["cases"]}
    assert set(cases) == {(p, s) for p in ("old", "new") for s in (64, 256)}
    for case in cases.values():  # the keys other tools read
        assert case["vocab"] == 4096 and not case["oom"] and "error" not in case
        assert case["peak_bytes"] >= case["static_bytes"] > 0
        assert case["tokens_per_s"] > 0 and case["logprob_extra_bytes"] > 0
    # The old path holds [seq, vocab] logits (several copies, and their gradients); the new one
    # a [32, vocab] chunk at a time.
    old, new = cases[("old", 256)], cases[("new", 256)]
    assert new["logprob_extra_bytes"] < 0.5 * old["logprob_extra_bytes"]
    ratio = result["ratios"]["256"]["logprob_extra"]
    assert ratio == pytest.approx(new["logprob_extra_bytes"] / old["logprob_extra_bytes"], 1e-3)
    assert result["model"]["parameters"] == cases[("old", 64)]["parameters"] > 0


@pytest.mark.timeout(120)
def test_bench_memory_reports_a_case_out_of_memory_and_goes_on(capsys):
    # 0.25 GiB past start-up: the old path's first [2112, 32768] float32 logits (277 MB) do not
    # fit; the new path's 256-token chunks (34 MB) do.
    argv = ["--vocab", "32768", "--seq", "2048", "--chunk-tokens", "256"]
    result = _bench(capsys, *argv, "--memory-limit-gib", "0.25")
    old, new = result["cases"]
    assert old["path"] == "old" and old["oom"] is True and old["phase"] == "logprobs"  # first
    assert old["failed_allocation_bytes"] >= 2112 * 32768 * 4
    assert old["needed_bytes"] == old["in_use_at_failure_bytes"] + old["failed_allocation_bytes"]
    assert new["path"] == "new" and new["oom"] is False and new["peak_bytes"] > 0
    assert result["ratios"] == {}  # no ratio without both paths


def test_ratios_keep_the_log_prob_figure_of_an_old_step_out_of_memory():
    from streamrl.bench.memory import memory_ratios

    old = {"path": "old", "seq": 8, "oom": True, "logprob_extra_bytes": 800}
    new = {"path": "new", "seq": 8, "peak_bytes": 5, "step_extra_bytes": 4}
    new.update(logprob_extra_bytes=100, tokens_per_s=2.0)
    assert memory_ratios([old, new]) == {"8": {"logprob_extra": 0.125}}
    assert memory_ratios([new]) == {}
