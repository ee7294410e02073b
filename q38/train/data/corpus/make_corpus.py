"""Regenerate the shipped corpus: ``python q38/train/data/corpus/make_corpus.py``.

``tiny.jsonl`` is original English prose produced by a small template grammar from a fixed seed, so it is
deterministic, free of third-party text, and regular enough that a byte-level tiny model's loss falls within a
few hundred steps.
Records are short (about 100-500 bytes) so that packing at seq_len 256-512 truncates little. ``chat_example.jsonl`` is a handful of short ChatML conversations in the ``messages`` format.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_BYTES = 220_000

NAMES = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Hugo", "Iris", "Jonas", "Kate", "Leo", "Mia",
         "Noah", "Olga", "Paul", "Rosa", "Sam", "Tina", "Victor"]
ANIMALS = ["cat", "dog", "cow", "horse", "goat", "sheep", "duck", "hen", "pig", "rabbit", "fox", "owl"]
ANIMAL_ADJ = ["small", "old", "brown", "white", "black", "lazy", "quick", "quiet", "happy", "sleepy", "young"]
ANIMAL_ACTS = ["sleeps", "eats grass", "runs", "waits", "sits", "plays", "looks around", "drinks water", "rests"]
FARM_PLACES = ["in the barn", "near the gate", "by the pond", "under the tree", "in the field", "behind the house",
               "on the hill", "next to the fence"]
TIMES = ["In the morning", "At noon", "In the afternoon", "In the evening", "At night", "Before breakfast",
         "After lunch"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SKIES = ["clear", "grey", "cloudy", "bright", "dark", "blue", "pale"]
WINDS = ["north", "south", "east", "west"]
WEATHER = ["It rained for an hour.", "It did not rain at all.", "A little snow fell.", "The sun was warm.",
           "Fog covered the valley.", "The air was cold and dry.", "There was a short storm."]
DISHES = ["soup", "bread", "a salad", "a cake", "rice", "pancakes", "a stew", "a pie"]
INGREDIENTS = ["carrots", "potatoes", "onions", "apples", "eggs", "tomatoes", "beans", "lemons", "cups of flour"]
COOK_ACTS = ["cut", "wash", "mix", "boil", "bake", "stir", "fry", "peel"]
MANNERS = ["slowly", "with care", "for ten minutes", "in a large pot", "in a bowl", "until they are soft", "gently"]
SHOPS = ["bakery", "market", "library", "post office", "shop", "pharmacy", "school", "station"]
ITEMS = ["a loaf of bread", "some milk", "a new book", "three stamps", "a bag of apples", "a blue pen",
         "fresh fish", "a small plant"]
FEELINGS = ["happy", "tired", "surprised", "pleased", "calm", "curious", "hungry"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]
OBJECTS = ["ball", "hat", "cup", "door", "car", "kite", "box", "chair", "coat", "boat"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def farm(r: random.Random) -> str:
    out = [f"This is a story about the farm of {r.choice(NAMES)}."]
    for _ in range(r.randint(2, 5)):
        a, adj = r.choice(ANIMALS), r.choice(ANIMAL_ADJ)
        out.append(f"{r.choice(TIMES)} the {adj} {a} {r.choice(ANIMAL_ACTS)} {r.choice(FARM_PLACES)}.")
        if r.random() < 0.4:
            out.append(f"The {a} is {adj}, and the {r.choice(ANIMALS)} is {r.choice(ANIMAL_ADJ)}.")
    out.append("That is the end of the day on the farm.")
    return " ".join(out)


def weather(r: random.Random) -> str:
    out = [f"Weather notes by {r.choice(NAMES)}."]
    start = r.randrange(7)
    for i in range(r.randint(2, 4)):
        day = DAYS[(start + i) % 7]
        t = r.randint(-5, 30)
        out.append(f"On {day} the sky was {r.choice(SKIES)} and the wind came from the {r.choice(WINDS)}.")
        out.append(f"The temperature was {t} degrees. {r.choice(WEATHER)}")
    return " ".join(out)


def recipe(r: random.Random) -> str:
    dish = r.choice(DISHES)
    out = [f"How to make {dish}."]
    for step in range(1, r.randint(2, 5) + 1):
        n = r.randint(1, 6)
        out.append(f"Step {step}: {r.choice(COOK_ACTS)} {NUMBER_WORDS[n]} {r.choice(INGREDIENTS)} "
                   f"{r.choice(MANNERS)}.")
    out.append(f"Now {dish} is ready. Serve it warm and share it with {r.choice(NAMES)}.")
    return " ".join(out)


def town(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    out = []
    for _ in range(r.randint(1, 3)):
        shop, item = r.choice(SHOPS), r.choice(ITEMS)
        out.append(f"{a} walked to the {shop} to buy {item}.")
        out.append(f"At the {shop}, {a} met {b}, who was {r.choice(FEELINGS)}.")
        out.append(f'"Hello, {b}," said {a}. "Hello, {a}," said {b}.')
        a, b = b, a
    out.append(f"Then {a} and {b} went home together.")
    return " ".join(out)


def numbers(r: random.Random) -> str:
    out = ["Some facts about numbers."]
    for _ in range(r.randint(4, 9)):
        kind = r.randrange(4)
        x, y = r.randint(0, 10), r.randint(0, 10)
        if kind == 0:
            out.append(f"{x} plus {y} is {x + y}.")
        elif kind == 1:
            hi, lo = max(x, y), min(x, y)
            out.append(f"{hi} minus {lo} is {hi - lo}.")
        elif kind == 2:
            out.append(f"{NUMBER_WORDS[x]} and {NUMBER_WORDS[y]} make {NUMBER_WORDS[x + y]}.")
        else:
            start = r.randint(0, 14)
            out.append("Counting: " + ", ".join(NUMBER_WORDS[start:start + 5]) + ".")
    return " ".join(out)


def colors(r: random.Random) -> str:
    name = r.choice(NAMES)
    out = [f"{name} has many things."]
    for _ in range(r.randint(2, 5)):
        c, o = r.choice(COLORS), r.choice(OBJECTS)
        out.append(f"The {o} of {name} is {c}.")
        if r.random() < 0.5:
            out.append(f"Is the {o} {c}? Yes, the {o} is {c}.")
        else:
            other = r.choice([x for x in COLORS if x != c])
            out.append(f"Is the {o} {other}? No, the {o} is not {other}. It is {c}.")
    return " ".join(out)


GENERATORS = [farm, weather, recipe, town, numbers, colors]


def tiny_records(seed: int = 38, target_bytes: int = TARGET_BYTES) -> list[dict]:
    r = random.Random(seed)
    records, size = [], 0
    while size < target_bytes:
        text = r.choice(GENERATORS)(r)
        records.append({"text": text})
        size += len(text) + 12
    return records


def chat_records(seed: int = 83, n: int = 20) -> list[dict]:
    r = random.Random(seed)
    records = []
    for i in range(n):
        kind = i % 4
        msgs: list[dict] = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": "You are a short and helpful assistant."})
        if kind == 0:
            x, y = r.randint(0, 10), r.randint(0, 10)
            msgs += [{"role": "user", "content": f"What is {x} plus {y}?"},
                     {"role": "assistant", "content": f"{x} plus {y} is {x + y}."}]
        elif kind == 1:
            c, o = r.choice(COLORS), r.choice(OBJECTS)
            msgs += [{"role": "user", "content": f"My {o} is {c}. What color is my {o}?"},
                     {"role": "assistant", "content": f"Your {o} is {c}."}]
        elif kind == 2:
            dish = r.choice(DISHES)
            msgs += [{"role": "user", "content": f"How do I start making {dish}?"},
                     {"role": "assistant", "content": f"First, {r.choice(COOK_ACTS)} the {r.choice(INGREDIENTS)} "
                                                      f"{r.choice(MANNERS)}."},
                     {"role": "user", "content": "And then?"},
                     {"role": "assistant", "content": f"Then {r.choice(COOK_ACTS)} them {r.choice(MANNERS)}."}]
        else:
            name, shop = r.choice(NAMES), r.choice(SHOPS)
            msgs += [{"role": "user", "content": f"Where did {name} go?"},
                     {"role": "assistant", "content": f"{name} went to the {shop}."}]
        records.append({"messages": msgs})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write_jsonl(HERE / "tiny.jsonl", tiny_records())
    write_jsonl(HERE / "chat_example.jsonl", chat_records())
    for name in ("tiny.jsonl", "chat_example.jsonl"):
        print(name, (HERE / name).stat().st_size, "bytes")
