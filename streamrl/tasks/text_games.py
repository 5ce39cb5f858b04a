"""Gymnasium's Blackjack as a text game: a multi-turn task from an installed package, offline.

Each row is a deal (a seed of ``Blackjack-v1`` with Sutton & Barto's rules). The model sees its
hand and the dealer's card and answers ``hit`` or ``stick`` each turn; the episode's reward is
the game's (+1 win, 0 draw, -1 loss) and a win counts as success. Basic strategy wins 43% of
deals; hitting until 20 wins 30% (measured with ``blackjack_win_rate``): the room RL has above a
warm start that imitates the weaker player.

Examples:
    >>> rows = blackjack_rows(2, seed=0)
    >>> env = BlackjackText()
    >>> env.reset(rows[0]).splitlines()[-2]
    'You have 17 (no usable ace). The dealer shows 5.'
    >>> env.step("stick").done
    True
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from streamrl.errors import ConfigError
from streamrl.records import Step

RULES = "Blackjack. Get closer to 21 than the dealer without going over. Aces count 1 or 11."
ACTIONS = {"stick": 0, "hit": 1}


def _gymnasium():
    try:
        import gymnasium
    except ImportError as err:
        raise ConfigError(
            "The blackjack game needs gymnasium: pip install 'streamrl[tasks]' (or gymnasium)."
        ) from err
    return gymnasium


def describe(obs: tuple) -> str:
    """A Blackjack observation ``(player sum, dealer card, usable ace)`` as text."""
    total, dealer, ace = (int(x) for x in obs)
    dealer_card = "an ace" if dealer == 1 else str(dealer)
    return f"You have {total} ({'a' if ace else 'no'} usable ace). The dealer shows {dealer_card}."


class BlackjackText:
    """``Blackjack-v1`` (``sab=True``) as an ``Environment``: answer ``hit`` or ``stick``.

    A turn that is neither is told so and counts as a turn (the runner's ``max_turns`` ends an
    episode that never answers).
    """

    def __init__(self) -> None:
        self.gym = _gymnasium()
        self.env = None
        self.invalid = 0

    def reset(self, row: Mapping) -> str:
        self.env = self.gym.make("Blackjack-v1", sab=True)
        obs, _ = self.env.reset(seed=int(row["seed"]))
        return f"{RULES}\n{describe(obs)}\nhit or stick?"

    def step(self, action: str) -> Step:
        words = action.strip().lower().split()
        if not words or words[0] not in ACTIONS:
            self.invalid += 1
            return Step("Answer hit or stick.", info={"invalid": True})
        obs, reward, terminated, truncated, _ = self.env.step(ACTIONS[words[0]])
        if terminated or truncated:
            return Step(None, reward=float(reward), done=True)
        return Step(f"{describe(obs)}\nhit or stick?")

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def blackjack_rows(n: int, seed: int = 0, prefix: str = "blackjack") -> list[dict]:
    """``n`` deals ``{prompt_id, prompt, seed}`` (the prompt is the first state, as shown)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        deal = rng.randrange(2**31)
        env = BlackjackText()
        prompt = env.reset({"seed": deal})
        env.close()
        rows.append({"prompt_id": f"{prefix}-{seed}-{i}", "prompt": prompt, "seed": deal})
    return rows


def threshold_player(hit_below: int) -> Callable[[tuple], int]:
    """Hit while the hand is below ``hit_below``, whatever the dealer shows."""
    return lambda obs: int(obs[0] < hit_below)


def blackjack_demonstration(
    row: Mapping, hit_below: int = 20, noise: float = 0.2, seed: int = 0
) -> list[str]:
    """The turns of a weak player on the row's deal: ``threshold_player(hit_below)``, taking the
    other action with probability ``noise`` (so the warm start still samples both)."""
    rng = random.Random(f"{seed}-{row['seed']}")
    gym = _gymnasium()
    env = gym.make("Blackjack-v1", sab=True)
    obs, _ = env.reset(seed=int(row["seed"]))
    player, turns, done = threshold_player(hit_below), [], False
    while not done:
        action = player(obs) if rng.random() >= noise else 1 - player(obs)
        turns.append("hit" if action else "stick")
        obs, _, terminated, truncated, _ = env.step(action)
        done = terminated or truncated
    env.close()
    return turns


def blackjack_win_rate(player: Callable[[tuple], int], deals: int = 10_000) -> float:
    """The share of ``deals`` (seeds 0..deals-1) a policy of observations wins."""
    env = _gymnasium().make("Blackjack-v1", sab=True)
    wins = 0
    for deal in range(deals):
        obs, _ = env.reset(seed=deal)
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(player(obs))
            done = terminated or truncated
        wins += reward > 0
    env.close()
    return wins / deals
