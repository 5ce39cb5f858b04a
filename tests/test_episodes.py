"""Multi-turn episodes on the real service: the tokens trained on are the tokens generated and
seen, turns reuse their prefix's KV cache, environments' failures have defined outcomes, and an
instance killed mid-episode loses nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest
import torch

from streamrl.components import StreamGenerationService
from streamrl.components.generation.timeouts import Timeouts
from streamrl.components.training.layout import layout_batch
from streamrl.envs.demos import sft_on_episodes
from streamrl.envs.episode import TurnFormat
from streamrl.envs.runner import EpisodeRunner
from streamrl.envs.tool_tasks import CalculatorEnv, calculator_demonstration, calculator_rows
from streamrl.errors import EnvError
from streamrl.policy.chat import stop_token_ids
from streamrl.policy.logprobs import completion_logprobs
from streamrl.policy.models import build_bpe_tokenizer, build_tiny_model, load_policy, save_policy
from streamrl.protocols import Sampler
from streamrl.records import Step

torch.set_num_threads(1)
CONTEXT = 256


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny policy warm-started on a few calculator episodes: its turns often end on the
    template's end-of-turn token, and sometimes run out of tokens."""
    env, rows = CalculatorEnv(), calculator_rows(200, seed=0)
    tok = build_bpe_tokenizer([str(env.reset(r)) + r["answer"] for r in rows], vocab_size=320)
    policy = build_tiny_model(tok, "test", seed=0)
    sft_on_episodes(
        rows,
        make_env=CalculatorEnv,
        demonstrate=calculator_demonstration,
        tokenizer=tok,
        model=policy,
        steps=40,
        lr=3e-3,
        tokens_per_batch=1024,
        seed=0,
    )
    path = tmp_path_factory.mktemp("policy")
    save_policy(policy, tok, path)
    return path


def service(policy_dir, instances: int = 1, **kw) -> StreamGenerationService:
    _, tok = load_policy(policy_dir)
    return StreamGenerationService(
        policy_dir, instances, max_batch_size=4, stop_token_ids=stop_token_ids(tok), **kw
    )


class Echo:
    """A game of ``turns`` steps: each observation names the turn; reward 1 at the end."""

    def __init__(self, turns: int = 3, delay_s: float = 0.0, bad: object = None) -> None:
        self.turns, self.delay_s, self.bad, self.seen = turns, delay_s, bad, []

    def reset(self, row):
        self.turns = row.get("turns", self.turns)
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> Step:
        time.sleep(self.delay_s)
        self.seen.append(action)
        if self.bad is not None:
            return self.bad
        done = len(self.seen) >= self.turns
        return Step(None if done else f"turn {len(self.seen)} seen", float(done), done)

    def close(self) -> None:
        pass


def run_episodes(runner: EpisodeRunner, rows: list[dict], group: int = 2) -> list:
    firsts = [runner.start(row, i) for row in rows for i in range(group)]
    runner.submit(firsts)
    return [runner.next_sample() for _ in firsts]


def test_turn_format_appends_what_the_template_puts_between_turns(policy_dir):
    _, tok = load_policy(policy_dir)
    fmt = TurnFormat(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = fmt.observation_ids([5, end], "tool", "42")
    assert tok.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    cut = fmt.observation_ids([5, 6], "user", "hi")  # a turn cut by max_tokens gets closed
    assert tok.decode(cut) == "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_trained_tokens_are_the_generated_and_observed_ones(policy_dir):
    """The exact-token test: every episode's sequence is its turns' prompts and generations,
    separators included; it decodes to the template's own rendering of the conversation; and
    the trainer's log-probs of its generated tokens are the generators'."""
    policy, tok = load_policy(policy_dir)
    rows = [{"prompt_id": f"q{i}", "prompt": f"Echo game {i}, go."} for i in range(6)]
    with service(policy_dir) as sgs:
        turns = []  # every turn's sample, as the service returned it
        poll = sgs.poll_sample

        def spy(timeout_s):
            sample = poll(timeout_s)
            if sample is not None:
                turns.append(sample)
            return sample

        sgs.poll_sample = spy
        envs = {}

        def make_env():
            env = Echo(turns=3)
            envs[len(envs)] = env
            return env

        # 24 turns followed by an observation; with 32 tokens a turn, about 40% end on the
        # end-of-turn token and the rest are cut (sampled: the share moves with timing).
        runner = EpisodeRunner(sgs, make_env, tok, max_tokens=32, context=CONTEXT)
        episodes = run_episodes(runner, rows)
    assert len(episodes) == 12 and runner.counts["episodes_finished"] == 12
    assert sgs.counts["requests_submitted"] == len(turns) == sum(e.turns for e in episodes)
    ended_on_eot = cut = 0  # turns followed by an observation: closed by the model, or cut
    for ep in episodes:
        own = sorted((t for t in turns if t.key == ep.key), key=lambda t: len(t.prompt_ids))
        assert len(own) == ep.turns == 3
        full = ep.prompt_ids + ep.token_ids
        mask = [0] * len(ep.prompt_ids) + ep.loss_mask
        # Each turn was prompted with exactly the sequence so far, and generated what follows.
        for turn in own:
            n = len(turn.prompt_ids)
            assert full[:n] == turn.prompt_ids
            assert full[n : n + turn.length] == turn.token_ids
            assert mask[n : n + turn.length] == [1] * turn.length
        trained = [t for t, m in zip(ep.token_ids, ep.loss_mask) if m]
        assert trained == [t for turn in own for t in turn.token_ids]
        assert len(ep.logprobs) == len(ep.token_versions) == len(ep.token_ids)
        # Decoded, it is the chat template's rendering of the same conversation.
        messages = [{"role": "user", "content": rows[int(ep.prompt_id[1:])]["prompt"]}]
        end = tok.convert_tokens_to_ids("<|im_end|>")
        for k, turn in enumerate(own):
            text = tok.decode(turn.token_ids[:-1] if turn.token_ids[-1] == end else turn.token_ids)
            messages.append({"role": "assistant", "content": text})
            if k < 2:
                messages.append({"role": "user", "content": f"turn {k + 1} seen"})
        rendered = tok.apply_chat_template(messages, tokenize=False)
        # The last turn is not closed: the episode ended there.
        last = "\n" if own[-1].token_ids[-1] == end else "<|im_end|>\n"
        assert tok.decode(full) == rendered.removesuffix(last)
        # The trainer's log-probs of the generated tokens are the generator's (mask 1 only).
        batch = layout_batch([ep], "packed", 0, torch.device("cpu"))
        scored = completion_logprobs(policy, batch.tokens, sgs.temperature)  # as sampled
        lp = batch.per_sample(scored.logprobs)[0]
        picked = torch.tensor(ep.loss_mask).bool()
        assert lp[picked].tolist() == pytest.approx(
            [x for x, m in zip(ep.logprobs, ep.loss_mask) if m], abs=1e-4
        )
        assert ep.reward == 1.0 and ep.finish_reason == "done"
        ended_on_eot += sum(t.token_ids[-1] == end for t in own[:-1])
        cut += sum(t.token_ids[-1] != end for t in own[:-1])
        # Turns two and three reused the KV of the turn before on the same instance.
        assert own[0].cached_tokens == 0 and all(t.cached_tokens > 0 for t in own[1:])
        assert ep.cached_tokens == sum(t.cached_tokens for t in own)
    assert ended_on_eot > 0 and cut > 0  # both ways a turn ends were exercised


def test_calculator_tool_episodes_and_prefill_saved(policy_dir):
    _, tok = load_policy(policy_dir)
    rows = calculator_rows(4, seed=1)
    with service(policy_dir) as sgs:
        runner = EpisodeRunner(sgs, CalculatorEnv, tok, max_tokens=16, context=CONTEXT, max_turns=3)
        episodes = run_episodes(runner, rows)
    assert len(episodes) == 8
    assert {e.finish_reason for e in episodes} <= {"done", "max_turns", "context"}
    multi = [e for e in episodes if e.turns > 1]
    assert all(e.cached_tokens > 0 for e in multi)
    for e in episodes:
        assert e.prefill_tokens + e.cached_tokens > len(e.prompt_ids) * (e.turns > 1)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("not a step", "returned str"),
        (Step("x", reward=float("nan")), "reward nan"),
        (Step(None, done=False), "observation None"),
    ],
)
def test_malformed_steps_raise_env_errors(policy_dir, bad, match):
    _, tok = load_policy(policy_dir)
    with service(policy_dir) as sgs:
        runner = EpisodeRunner(sgs, lambda: Echo(bad=bad), tok, max_tokens=4, context=CONTEXT)
        with pytest.raises(EnvError, match=match):
            run_episodes(runner, [{"prompt_id": "q", "prompt": "go"}], group=1)


def test_hung_steps_turn_limits_and_full_contexts_end_episodes_with_a_flag(policy_dir):
    _, tok = load_policy(policy_dir)
    rows = [{"prompt_id": "q", "prompt": "go"}]
    with service(policy_dir) as sgs:
        hung = EpisodeRunner(
            sgs, lambda: Echo(delay_s=60), tok, max_tokens=4, context=CONTEXT, env_timeout_s=0.5
        )
        started = time.monotonic()
        (ep,) = run_episodes(hung, rows, group=1)
        assert ep.finish_reason == "env_timeout" and time.monotonic() - started < 20
        assert hung.counts["env_timeouts"] == 1
        limited = EpisodeRunner(
            sgs, lambda: Echo(turns=9), tok, max_tokens=4, context=CONTEXT, max_turns=2
        )
        (ep,) = run_episodes(limited, rows, group=1)
        assert ep.finish_reason == "max_turns" and ep.turns == 2
        short = EpisodeRunner(
            sgs, lambda: Echo(turns=99), tok, max_tokens=8, context=48, max_turns=99
        )
        (ep,) = run_episodes(short, rows, group=1)
        assert ep.finish_reason == "context" and len(ep.prompt_ids) + ep.length <= 48


def _kill_one_holding_requests(sgs, killed: list[int], within_s: float = 30.0) -> None:
    """SIGKILL the first instance seen holding requests (not between two turns, when its
    episodes wait on their environments and it holds none), once."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not killed:
        for handle in list(sgs.pool.handles):
            if handle.state == "active" and len(handle.open) > 0 and handle.proc.is_alive():
                os.kill(handle.proc.pid, signal.SIGKILL)
                killed.append(handle.instance_id)
                return
        time.sleep(0.005)


def test_a_killed_instance_loses_no_episode(policy_dir):
    _, tok = load_policy(policy_dir)
    # One short episode; when it ends, the long ones are mid-way, their turns on both
    # instances or in their environments: the instance is killed while it holds some.
    rows = [{"prompt_id": f"q{i}", "prompt": f"game {i}", "turns": 6} for i in range(4)]
    rows[0]["turns"] = 1
    with service(policy_dir, 2, timeouts=Timeouts(heartbeat_s=5)) as sgs:
        runner = EpisodeRunner(sgs, lambda: Echo(delay_s=0.2), tok, max_tokens=12, context=CONTEXT)
        firsts = [runner.start(row, i) for row in rows for i in range(2)]
        runner.submit(firsts)
        got = [runner.next_sample()]
        killed: list[int] = []
        killer = threading.Thread(target=_kill_one_holding_requests, args=(sgs, killed))
        killer.start()
        got += [runner.next_sample() for _ in firsts[1:]]
        killer.join(timeout=30)
    assert len(killed) == 1
    assert sorted(e.key for e in got) == sorted(r.key for r in firsts)
    assert all(e.finish_reason == "done" for e in got)
    assert sorted(e.turns for e in got) == [1, 1] + [6] * 6
    assert sgs.counts["instances_restarted"] == 1 and sgs.counts["requests_requeued"] >= 1
    assert runner.counts["episodes_started"] == runner.counts["episodes_finished"] == 8


class Recorder:
    """A length predictor that keeps what it is taught (the ranker's side of the contract)."""

    ready = False

    def __init__(self) -> None:
        self.taught: list[tuple[str, int]] = []

    def predict(self, prompts):
        return [0.0] * len(prompts)

    def learn(self, prompts, lengths):
        self.taught += list(zip(prompts, lengths))

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_the_ranker_learns_episode_cost_and_groups_are_episodes(policy_dir):
    """Through the trainer's stream: GRPO groups hold one row's episodes, scored by their
    environment, and the length predictor learns each episode's whole token count."""
    from streamrl.algorithms import GRPO
    from streamrl.training.prompts import PromptSource
    from streamrl.training.rollout import RolloutStream

    _, tok = load_policy(policy_dir)
    rows = [{"prompt_id": f"q{i}", "prompt": f"play {i}", "turns": 1 + i % 3} for i in range(4)]
    recorder = Recorder()
    with service(policy_dir) as sgs:
        runner = EpisodeRunner(sgs, Echo, tok, max_tokens=8, context=CONTEXT)
        stream = RolloutStream(
            sgs,
            PromptSource(rows, 4),
            tok,
            GRPO(group_size=2),  # no reward: the environment rewards each episode
            max_tokens=8,
            context=CONTEXT,
            ranker=recorder,
            ranker_refresh_every=1,
            sampler=runner,
        )
        assert isinstance(sgs, Sampler) and isinstance(runner, Sampler)
        groups = list(stream.iteration())
        stream.dispatch()  # the refresh runs with the next dispatch
        list(stream.groups(1))
    assert sorted(g.prompt_id for g in groups) == ["q0", "q1", "q2", "q3"]
    for group in groups:
        turns = {s.turns for s in group.samples}
        assert len(group.samples) == 2 and turns == {1 + int(group.prompt_id[1:]) % 3}
        assert group.rewards == [1.0, 1.0] and all(s.loss_mask for s in group.samples)
    lengths = sorted(s.length for g in groups for s in g.samples)
    assert sorted(n for _, n in recorder.taught[: len(lengths)]) == lengths
    assert max(lengths) > 2 * 8  # a 3-turn episode's cost: its turns and observations


def test_a_sampler_that_does_not_score_needs_a_reward(policy_dir):
    """The service's completions come unscored: a stream on it without a reward is refused at
    construction, saying what to pass."""
    from streamrl.algorithms.grpo import GRPO
    from streamrl.training.prompts import PromptSource
    from streamrl.training.rollout import RolloutStream

    sgs = StreamGenerationService(policy_dir, 1)  # not started: nothing runs
    rows = [{"prompt_id": "q0", "prompt": "hi"}]
    with pytest.raises(ValueError, match="does not score its samples; pass reward="):
        RolloutStream(sgs, PromptSource(rows, 1), None, GRPO(group_size=2), max_tokens=4, context=8)


def test_a_runner_waits_no_longer_than_the_services_timeout(policy_dir):
    """A service that takes turns but never returns one (a stand-in: the real service's own
    heartbeats catch hung instances first) ends the wait with a GeneratorError."""
    from streamrl.components.generation.pool import GeneratorError

    class Silent:
        sample_timeout_s, open_requests = 0.5, 0

        def submit(self, requests, scores=None):
            self.open_requests += len(requests)

        def poll_sample(self, timeout_s):
            time.sleep(timeout_s)

        def instances(self):
            return []

    _, tok = load_policy(policy_dir)
    runner = EpisodeRunner(Silent(), Echo, tok, max_tokens=4, context=CONTEXT)
    runner.submit([runner.start({"prompt_id": "q", "prompt": "go"})])
    started = time.monotonic()
    with pytest.raises(GeneratorError, match="came back within"):
        runner.next_sample()
    assert time.monotonic() - started < 5


class AllToFirst:
    """Puts every request on the first instance: an imbalance for the runner to correct."""

    def plan(self, requests, scores, instances):
        return [list(requests)] + [[] for _ in range(instances - 1)]

    def observe(self, lengths):
        pass

    def batch_limits(self, instances):
        return None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_turns_move_off_an_overloaded_instance(policy_dir):
    _, tok = load_policy(policy_dir)
    rows = [{"prompt_id": f"q{i}", "prompt": f"game {i}", "turns": 3} for i in range(6)]
    with service(policy_dir, 2, dispatcher=AllToFirst()) as sgs:
        runner = EpisodeRunner(sgs, Echo, tok, max_tokens=8, context=CONTEXT, rebalance_requests=2)
        episodes = run_episodes(runner, rows)
    assert runner.counts["turns_moved"] > 0
    assert {e.instance_id for e in episodes} == {0, 1}  # some finished where they moved
    assert all(e.turns == 3 and e.finish_reason == "done" for e in episodes)


class Listed:
    """A prompt source that deals its rows in order (the stream's refills take the next)."""

    def __init__(self, rows: list[dict], batch_size: int) -> None:
        self.rows, self.batch_size = iter(rows), batch_size

    def next_row(self) -> dict:
        return next(self.rows)

    def next_batch(self) -> list[dict]:
        return [self.next_row() for _ in range(self.batch_size)]


def hanging_echo(opened: Counter):
    """One-turn Echo games (reward 1) whose first ``row["hang"]`` episodes of each row hang in
    ``step``, past the runner's ``env_timeout_s``: the environment's fault."""

    class Hangs(Echo):
        def reset(self, row):
            self.hang = opened[row["prompt_id"]] < row["hang"]
            opened[row["prompt_id"]] += 1
            return super().reset(row)

        def step(self, action: str) -> Step:
            if self.hang:
                time.sleep(30)
            return super().step(action)

    return Hangs


@pytest.mark.parametrize("on_fault", ["drop", "train"])
def test_episodes_the_environment_cut_are_left_out_of_their_groups(policy_dir, on_fault):
    """``drop``: an episode cut by ``env_timeout`` is no member of its group (scored over the
    others, not as a reward of 0); a group left with fewer than GRPO's 2 episodes is refilled;
    every episode is accounted for. ``train``: they are trained with reward 0."""
    from streamrl.algorithms import GRPO
    from streamrl.training.rollout import RolloutStream

    _, tok = load_policy(policy_dir)
    hangs = {"q0": 1, "q1": 0, "q2": 3, "q3": 2, "q4": 0, "q5": 0}
    rows = [
        {"prompt_id": p, "prompt": f"play {p}", "turns": 1, "hang": h} for p, h in hangs.items()
    ]
    opened: Counter = Counter()
    with service(policy_dir) as sgs:
        runner = EpisodeRunner(
            sgs,
            hanging_echo(opened),
            tok,
            max_tokens=4,
            context=CONTEXT,
            env_timeout_s=0.3,
            on_fault=on_fault,
        )
        stream = RolloutStream(
            sgs,
            Listed(rows, 4),
            tok,
            GRPO(group_size=3),
            reward=lambda c, r: 99.0,  # never used: the environment rewards
            max_tokens=4,
            context=CONTEXT,
            episodes=runner,  # the older name of sampler=
        )
        groups = {g.prompt_id: g for g in stream.iteration()}
    timeouts = runner.counts["episodes_env_timeout"]
    if on_fault == "train":
        assert sorted(groups) == ["q0", "q1", "q2", "q3"] and timeouts == 6
        assert sorted(groups["q0"].rewards) == [0.0, 1.0, 1.0]
        assert sorted(groups["q3"].rewards) == [0.0, 0.0, 1.0] and groups["q2"].rewards == [0.0] * 3
        assert min(groups["q0"].advantages) < 0 < max(groups["q0"].advantages)
        assert stream.samples_env_fault == stream.stats.left_out == 0
        return
    # q2 (all 3 cut) and q3 (1 left) were refilled by q4 and q5; q0 trains its 2 episodes.
    assert sorted(groups) == ["q0", "q1", "q4", "q5"] and stream.prompts_dispatched == 6
    assert {p: len(g.samples) for p, g in groups.items()} == {"q0": 2, "q1": 3, "q4": 3, "q5": 3}
    assert groups["q0"].rewards == [1.0, 1.0] and groups["q0"].advantages == [0.0, 0.0]
    trained = [s for g in groups.values() for s in g.samples]
    assert all(s.finish_reason == "done" for s in trained)
    assert stream.samples_env_fault == timeouts == 6 and stream.samples_filtered == 1
    assert stream.stats.left_out == 1  # missing from a trained group: the loss divides by 11
    assert 3 * stream.prompts_dispatched == len(trained) + 1 + 6  # nothing unaccounted for


class Delivered:
    """The module's side of a ``RolloutStream``: fixed groups, ``left_out`` samples missing."""

    def __init__(self, groups, per_iteration: int, left_out: int) -> None:
        from streamrl.training.rollout import IterationStats
        from streamrl.training.timeline import TraceRecorder

        self.ready, self.samples_per_iteration = groups, per_iteration
        self.stats, self.trace = IterationStats(left_out=left_out), TraceRecorder()

    def dispatch(self, min_weight_version: int = 0) -> int:
        return 0

    def groups(self, iteration: int):
        return iter(self.ready)


def test_the_loss_is_the_mean_over_the_samples_the_groups_have(policy_dir):
    """3 samples of a 4-sample iteration whose 4th episode was left out train exactly as a
    3-sample iteration: the micro-batches' 1/4 is corrected to 1/3 before the step."""
    from streamrl.algorithms import GRPO
    from streamrl.records import Sample, ScoredGroup
    from streamrl.training.module import StreamRLModule

    policy, _ = load_policy(policy_dir)
    samples = [Sample(f"q{i // 2}", i, [5, 6], [7 + i, 9], [-1.0, -1.5], 0, 0) for i in range(3)]
    groups = [
        ScoredGroup("q0", samples[:2], [1.0, 0.0], [1.0, -1.0]),
        ScoredGroup("q1", samples[2:], [1.0], [0.5]),
    ]
    grads, losses = [], []
    for per_iteration, left_out in [(4, 1), (3, 0)]:
        policy.zero_grad(set_to_none=True)
        module = StreamRLModule(
            policy, GRPO(group_size=2), Delivered(groups, per_iteration, left_out), 1
        )
        module.manual_backward = lambda loss: loss.backward()  # no Trainer in this test
        module.train_on_stream(0)
        grads.append(
            torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])
        )
        losses.append(float(module.iteration_loss))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])
    assert losses[0] == pytest.approx(losses[1])


def test_a_mixture_of_experts_episode_carries_every_turns_experts(policy_dir, tmp_path):
    """A tiny Qwen3-MoE plays 2-turn episodes on the HF engine, each next turn reusing its
    prefix's KV cache: the episode's sample carries experts for every fed token (the prompt,
    each turn's tokens, the observations; only the last token unrecorded), and the float32
    trainer's routers choose exactly those over the whole sequence."""
    import numpy as np

    from streamrl.policy.routing import NOT_RECORDED, RoutingReplay

    _, tok = load_policy(policy_dir)
    moe_dir = save_policy(build_tiny_model(tok, "moe-test", seed=0), tok, tmp_path / "moe")
    policy, _ = load_policy(moe_dir)
    rows = [{"prompt_id": f"q{i}", "prompt": f"Echo game {i}, go."} for i in range(3)]
    with service(moe_dir) as sgs:
        runner = EpisodeRunner(sgs, lambda: Echo(turns=2), tok, max_tokens=8, context=CONTEXT)
        episodes = run_episodes(runner, rows)
    assert runner.counts["cached_tokens"] > 0  # later turns kept their prefix
    replay = RoutingReplay(policy)
    for e in episodes:
        experts = e.routed_experts
        assert e.turns == 2 and experts.shape == (len(e.prompt_ids) + e.length, 3, 2)
        assert (experts[:-1] >= 0).all() and (experts[-1] == NOT_RECORDED).all()
        with torch.no_grad(), replay.replaying(torch.from_numpy(experts), apply=False):
            policy(torch.tensor([e.prompt_ids + e.token_ids]))
    mismatched, compared = replay.take_mismatch()
    assert mismatched == 0 and compared == sum(len(e.prompt_ids) + e.length - 1 for e in episodes)
    assert all(np.asarray(e.routed_experts).dtype == np.int16 for e in episodes)
