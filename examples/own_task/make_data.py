"""Write the own-task example's data: words to spell backwards, one JSON row each.

Run from the repository root: python examples/own_task/make_data.py [--rows 2000]
Writes examples/own_task/data/reverse.jsonl (columns: question, solution, source).
"""

import argparse
import json
import random
from pathlib import Path

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "nu",
    "pe",
    "ra",
    "si",
    "to",
    "vu",
    "we",
    "xa",
    "yo",
    "zi",
    "bre",
    "cla",
    "dro",
    "fli",
    "gru",
    "pla",
    "sno",
    "tri",
]


def word(rng: random.Random) -> str:
    """A pronounceable made-up word of 2 to 4 syllables (3 to 12 letters)."""
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--rows", type=int, default=2000)
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--out", default=str(Path(__file__).parent / "data" / "reverse.jsonl"))
    args = cli.parse_args()
    rng = random.Random(args.seed)
    words: set[str] = set()
    while len(words) < args.rows:
        words.add(word(rng))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(words)  # a set's order changes from run to run; the file must not
    rng.shuffle(ordered)
    with out.open("w") as f:
        for w in ordered:
            row = {"question": f"spell backwards: {w}", "solution": w[::-1], "source": "reverse"}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.rows} rows to {out}")


if __name__ == "__main__":
    main()
