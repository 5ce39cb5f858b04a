"""Word lists of the requests data set (``length_data_requests.py``), and its two text helpers.

Each list pairs a phrase with what it does to the length where it does something: a topic's
hidden difficulty, a form's natural length, a manner's multiplier. The numbers are made up; they
only have to be consistent, as a policy's habits are.
"""

from __future__ import annotations

import random

_ONES = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def number_words(n: int) -> str:
    """``n`` (0-999) in English words: 25 -> "twenty-five", 300 -> "three hundred"."""
    if not 0 <= n < 1000:
        raise ValueError(f"number_words: {n} is outside 0-999.")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else "")
    rest = n % 100
    return f"{_ONES[n // 100]} hundred" + (f" and {number_words(rest)}" if rest else "")


# (topic, hidden difficulty: how long an explanation of it runs, x 220 tokens)
TOPICS = (
    ("photosynthesis", 1.0),
    ("black holes", 1.5),
    ("the French Revolution", 1.4),
    ("compound interest", 0.8),
    ("how vaccines work", 1.2),
    ("the offside rule in football", 0.6),
    ("quantum entanglement", 1.7),
    ("sourdough fermentation", 0.9),
    ("the water cycle", 0.7),
    ("inflation", 1.1),
    ("public-key cryptography", 1.6),
    ("plate tectonics", 1.1),
    ("the causes of the First World War", 1.6),
    ("how a bill becomes law", 1.2),
    ("why the sky is blue", 0.7),
    ("urban beekeeping", 0.8),
    ("the rules of chess", 1.3),
    ("machine learning", 1.5),
    ("jet lag", 0.6),
    ("the stock market", 1.2),
    ("climate feedback loops", 1.4),
    ("how noise-cancelling headphones work", 0.9),
    ("the Roman Empire's fall", 1.5),
    ("composting at home", 0.6),
    ("the immune system", 1.4),
    ("supply and demand", 0.9),
    ("how elections are counted", 1.0),
    ("the life of a star", 1.3),
    ("mortgages", 1.0),
    ("coral reefs", 0.8),
)
LIST_THINGS = (
    "ideas for a rainy weekend",
    "names for a coffee shop",
    "ways to save money on groceries",
    "books about the sea",
    "questions to ask in a job interview",
    "houseplants that need little light",
    "tips for learning a language",
    "ingredients for a vegan curry",
    "reasons to visit Lisbon",
    "warm-up exercises before running",
    "board games for a family evening",
    "facts about octopuses",
    "risks of a software migration",
    "gift ideas for a retired teacher",
    "things to pack for a camping trip",
)
# detail of each list item: (phrase after the list, tokens per item)
ITEM_DETAIL = {
    "bare": (", one per line", 5),
    "sentence": (", each with a sentence about it", 20),
    "explained": (", and explain each one briefly", 42),
}
# form: its natural length in tokens when nothing limits it
FORMS = {
    "a haiku": 20,
    "a limerick": 45,
    "a tweet": 40,
    "a paragraph": 120,
    "a poem": 180,
    "a sonnet": 150,
    "a product description": 160,
    "a short story": 650,
    "a blog post": 850,
    "an essay": 950,
    "a speech": 700,
    "song lyrics": 260,
}
# manner: (phrase after the topic, multiplier, or a flat length that replaces the rule)
MANNERS = {
    "plain": ("", 1.0, 0),
    "briefly": (" briefly", 0.35, 0),
    "one sentence": (" in one sentence", 1.0, 30),
    "detail": (" in detail", 2.5, 0),
    "steps": (" step by step", 2.0, 0),
    "child": (" as if I were five years old", 0.7, 0),
}
LANGUAGES = {"French": 1.25, "German": 1.3, "Spanish": 1.2, "Japanese": 1.5, "Chinese": 0.9}
# edit: (instruction before the passage, output tokens per passage token)
EDITS = {
    "proofread": ("Fix the grammar and spelling in this text", 1.05),
    "formal": ("Rewrite this more formally", 1.2),
    "half": ("Shorten this to half its length", 0.5),
    "simplify": ("Rewrite this in plain words for a general reader", 0.9),
    "expand": ("Expand this into a fuller version with more detail", 2.2),
}
# (what the function does, tokens of a plain answer)
CODE_TASKS = (
    ("reverses a string", 60),
    ("checks whether a number is prime", 90),
    ("merges two sorted lists", 110),
    ("parses a CSV file into a list of dictionaries", 180),
    ("implements an LRU cache", 260),
    ("finds the shortest path in a weighted graph", 320),
    ("validates an email address", 100),
    ("computes a moving average over a stream", 140),
    ("serialises a binary tree and reads it back", 300),
    ("implements a tiny HTTP router with path parameters", 420),
    ("rate-limits calls with a token bucket", 220),
    ("counts word frequencies in a text file", 120),
)
CODE_LANGUAGES = {"Python": 1.0, "JavaScript": 1.1, "Rust": 1.3, "Go": 1.25, "Java": 1.35}
# extra: (phrase after the task, multiplier, tokens added)
CODE_EXTRAS = {
    "plain": ("", 1.0, 0),
    "tested": (" with docstrings and unit tests", 2.2, 0),
    "explained": (" and explain how it works", 1.0, 150),
    "bare": (", code only, no comments", 0.7, 0),
}
TONES = {"a short": 0.5, "a friendly": 1.0, "a formal": 1.2, "a detailed": 2.0}
RECIPIENTS = ("my landlord", "the team", "a new client", "my professor", "the school board")
SUBJECTS = (
    "a delayed delivery",
    "next week's planning meeting",
    "a refund I have not received",
    "the office move",
    "a change to the project budget",
    "missing a deadline",
)
# (sub-question with two {} for nouns, tokens of its answer)
QUESTIONS = (
    ("What is a {}?", 25),
    ("Where does the word {} come from?", 30),
    ("Why do people keep a {} at home?", 60),
    ("How is a {} different from a {}?", 90),
    ("What would happen without any {}?", 65),
    ("Is a {} heavier than a {}?", 20),
)
NOUNS = (
    "lantern",
    "harbour",
    "violin",
    "glacier",
    "compass",
    "teapot",
    "bicycle",
    "library",
    "orchard",
    "satellite",
    "ferry",
    "thermostat",
    "meadow",
    "typewriter",
    "bakery",
    "canyon",
)
_VERBS = ("carried", "painted", "followed", "repaired", "watched", "sold", "found", "described")
_ADJECTIVES = ("old", "quiet", "bright", "narrow", "heavy", "famous", "small", "strange", "new")
_PLACES = ("near the river", "after the storm", "in the early morning", "behind the station")


def sentence(rng: random.Random) -> str:
    """One sentence of a passage to translate, rewrite or summarise."""
    subject, thing = rng.choice(NOUNS), rng.choice(NOUNS)
    text = f"The {rng.choice(_ADJECTIVES)} {subject} {rng.choice(_VERBS)} the {thing}"
    if rng.random() < 0.5:
        text += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.15:
        text += f" in {rng.randint(1850, 2024)}"
    return text + "."


# Numbers that say nothing about the length of the answer.
DISTRACTORS = (
    "It is for my {} kids.",
    "We are a team of {}.",
    "I need it by {} pm.",
    "This is attempt number {}.",
    "It is for a talk in {}.",
)
OPENERS = ("Please", "Hi! Could you", "Quick one:", "I was wondering if you could")
SYSTEMS = (
    None,
    "You are a friendly assistant for everyday tasks.",
    "You help people write, plan and learn.",
)
