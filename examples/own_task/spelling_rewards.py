"""The own-task example's reward: a plain function of the completion and the prompt's row.

streamrl imports it from the config's directory (``rl.reward: spelling_rewards:letters_in_place``).
"""


def letters_in_place(completion: str, row: dict) -> float:
    """1.0 for the word spelled backwards exactly; otherwise the share of letters in their
    place, halved (partial credit gives GRPO a signal between right and wrong)."""
    answer = completion.strip()
    target = row["solution"]
    if answer == target:
        return 1.0
    in_place = sum(a == b for a, b in zip(answer, target))
    return 0.5 * in_place / max(len(answer), len(target), 1)
