"""Composes the second part of the head-training prompt set from content lists and the handwritten part.

The handwritten prompts (``train-<category>-NNN`` in ``src/specdecode/heads/data/prompts.jsonl``) give 420
answers' worth of content; a head trained on them alone keeps its first token 61% of the time on them and
38% on the bench suites. This script adds prompts with new content (topics, tasks, sentences, numbers)
and new instructions over the handwritten passages and conversations, deterministically:

    python tools/compose_head_prompts.py          # rewrites the composed lines of prompts.jsonl in place

It never reads the bench suites; tests/heads/test_prompts.py checks that no prompt shares an eight-word
span with them and that this script reproduces the packaged file. It does not call a model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[1] / "src" / "specdecode" / "heads" / "data" / "prompts.jsonl"
COMPOSED = "train-composed-"

# --- qa: topics x question forms -------------------------------------------------------------------------
MECHANISMS = [
    "a refrigerator", "a heat pump", "a microwave oven", "an electric motor", "a solar panel", "a wind turbine",
    "a jet engine", "a touchscreen", "GPS navigation", "a credit card payment", "a search engine", "Wi-Fi",
    "a lithium-ion battery", "a nuclear power plant", "a 3D printer", "noise-cancelling headphones",
    "a compass", "a thermostat", "an elevator", "a bicycle gear system", "a hybrid car", "a barcode scanner",
    "public-key encryption", "a spam filter", "a recommendation system", "an MRI scanner", "a hearing aid",
    "the human kidney", "the immune system's memory", "muscle growth after exercise", "sleep cycles",
    "the digestion of food", "a rainbow", "a thunderstorm", "ocean tides", "the greenhouse effect",
    "plate tectonics", "a volcano eruption", "the water cycle", "bird migration", "photosynthesis in algae",
    "fermentation in bread making", "compound interest", "inflation", "a mortgage", "an index fund",
    "supply and demand", "a central bank's interest rate", "an election with ranked-choice voting",
    "a patent", "a version control system", "a compiler", "garbage collection in programming languages",
    "a database index", "a DNS lookup", "a load balancer", "a neural network", "a hash function",
]
SUBJECTS = [
    "the Roman Empire", "the printing press", "the Industrial Revolution", "the Silk Road", "ancient Egypt",
    "the Renaissance", "the Apollo program", "the invention of the telephone", "the history of chess",
    "the Great Wall of China", "the Amazon rainforest", "coral reefs", "the planet Mars", "black holes",
    "the Moon", "honeybees", "octopuses", "elephants", "penguins", "sharks", "tardigrades", "the Sahara",
    "Antarctica", "the Pacific Ocean", "the Alps", "Iceland", "Japan's bullet trains", "the Olympic Games",
    "jazz music", "impressionist painting", "Shakespeare's plays", "the novel Don Quixote", "origami",
    "coffee", "tea", "chocolate", "olive oil", "rice", "the tomato", "vitamin D", "caffeine", "meditation",
    "remote work", "electric scooters", "recycling plastic", "vertical farming", "open-source software",
    "the Python programming language", "spreadsheets", "cloud computing", "quantum computers",
    "the metric system", "time zones", "the calendar", "libraries", "museums", "public parks",
]
MECHANISM_FORMS = [
    "How does {t} work?", "Explain how {t} works to someone with no technical background.",
    "What are the main parts of {t}, and what does each one do?", "Describe {t} in three short paragraphs.",
]
SUBJECT_FORMS = [
    "Tell me about {t}.", "Give me five interesting facts about {t}.", "Why is {t} important? Answer briefly.",
    "Write a short, friendly introduction to {t} for a curious teenager.",
    "What are the most common misconceptions about {t}?",
]

# --- code: tasks x languages -----------------------------------------------------------------------------
TASKS = [
    "checks whether a string is a palindrome, ignoring spaces and case",
    "returns the n-th Fibonacci number iteratively", "counts how often each word appears in a text",
    "removes duplicate values from a list while keeping their order", "flattens a nested list of lists",
    "converts a temperature from Celsius to Fahrenheit and back", "finds the second largest number in a list",
    "checks whether two strings are anagrams of each other", "returns the greatest common divisor of two integers",
    "splits a list into chunks of a given size", "capitalises the first letter of every word in a sentence",
    "validates that a string looks like an email address", "computes the average of the numbers in a file",
    "returns the longest word in a sentence", "rotates a list by k positions to the right",
    "groups a list of words by their first letter", "counts the vowels in a string",
    "checks whether a year is a leap year", "converts a Roman numeral to an integer",
    "computes the factorial of a number recursively", "finds all pairs in a list that sum to a target value",
    "returns the transpose of a matrix given as a list of rows", "compresses a string like 'aaabb' into 'a3b2'",
    "reads a CSV file and prints the sum of one column", "parses a date in the form YYYY-MM-DD and prints the weekday",
    "implements binary search on a sorted list", "sorts a list of people by age and then by name",
    "generates a random password of a given length", "checks whether brackets in a string are balanced",
    "converts a number of seconds into hours, minutes and seconds",
]
LANGUAGES = ["Python", "JavaScript", "Java", "Go", "C", "Rust", "TypeScript", "C++"]
CODE_FORMS = [
    "Write a {lang} function that {task}.", "In {lang}, write a function that {task}. Include a short usage example.",
    "Show me how to write a {lang} function that {task}, and explain it line by line.",
]
CONCEPTS = [
    "list comprehensions in Python", "the difference between a process and a thread", "recursion",
    "what a REST API is", "Big-O notation", "the difference between SQL and NoSQL databases", "unit testing",
    "what a closure is in JavaScript", "how Git branches work", "what a race condition is", "dependency injection",
    "the difference between a stack and a queue", "what an HTTP status code 404 means", "immutability",
    "what a virtual environment is in Python", "how async and await work", "what a regular expression is",
    "the difference between compiled and interpreted languages", "what a memory leak is", "object-oriented programming",
]

# --- math: parametrised word problems --------------------------------------------------------------------
MATH = [
    "A shop sells notebooks at {a} dollars each. If Maria buys {b} notebooks and pays with a {c}-dollar note, how much change does she get? Show your working.",
    "A car uses {a} litres of fuel per 100 km. How much fuel does it need for a trip of {b}0 km? Explain step by step.",
    "A cake recipe that serves {a} uses {b}00 grams of sugar. How many grams of sugar does a cake for {c}{a} guests take? Show each step.",
    "A cyclist rides at {a} km per hour for {b} hours and then at {c} km per hour for 2 hours. How far does she ride in total? Solve step by step.",
    "The price of a laptop is {a}00 euros. It is reduced by {b}0 percent in a sale. What is the new price? Explain your reasoning.",
    "A class has {a} boys and {b} girls. What percentage of the class are girls? Round to one decimal place and show your steps.",
    "A garden is {a} metres long and {b} metres wide. Fencing costs {c} dollars per metre. How much does it cost to fence the whole garden? Work it out step by step.",
    "If {a} workers can paint a house in {b} days, how many days would {c} workers take, working at the same rate? Explain.",
    "Sam saves {a} dollars every week. How many weeks does he need to save {b}00 dollars? Show your reasoning.",
    "A bus leaves at 8:{a}5 and the journey takes {b} minutes more than an hour. At what time does it arrive? Explain step by step.",
    "What is {a}{b} multiplied by {c}{a}? Show how to do the multiplication by hand.",
    "A box contains {a} red balls and {b} blue balls. Two balls are drawn without replacement. What is the probability that both are red? Show your working.",
    "Solve the equation {a}x + {b} = {c}{a} and check your answer.",
    "A square has a perimeter of {a}{b} cm. What are its side length and its area? Explain each step.",
    "A phone plan costs {a} dollars per month plus {b} cents per minute of calls. How much does a month with {c}00 minutes of calls cost? Show your steps.",
    "The average of four numbers is {a}{b}. Three of them are {a}, {b}0 and {c}{c}. What is the fourth number? Solve step by step.",
]

# --- translation: sentences x languages ------------------------------------------------------------------
SENTENCES = [
    "The library will be closed on Monday because of the public holiday.",
    "I would like to book a table for four people at eight o'clock tonight.",
    "Please send me the report before the meeting tomorrow morning.",
    "The weather forecast says it will rain all weekend.",
    "My brother has just started a new job at a hospital in the city.",
    "How much does a return ticket to the airport cost?",
    "We need to buy milk, eggs, bread and some fresh vegetables.",
    "The children are playing football in the park after school.",
    "Could you speak a little more slowly, please? I am still learning.",
    "Our neighbours are moving to another country next month.",
    "The concert was cancelled because the singer was ill.",
    "I have been waiting for the bus for more than twenty minutes.",
    "This soup is delicious; could you give me the recipe?",
    "The hotel room has a beautiful view of the sea.",
    "Don't forget to water the plants while I am away.",
    "The new bridge will make the journey to work much shorter.",
    "She reads a book every evening before going to sleep.",
    "Turn left at the traffic lights and the station is on your right.",
    "The meeting has been moved to Thursday afternoon.",
    "I lost my keys somewhere between the office and the car park.",
    "The shop on the corner sells the best bread in town.",
    "Thank you very much for your help with the move last weekend.",
    "It is important to drink enough water when it is hot.",
    "We visited the old castle and walked along the river.",
    "The doctor will see you in about ten minutes.",
    "My phone battery is almost empty; can I charge it here?",
    "They are planning a surprise party for their grandmother's birthday.",
    "The train was full, so we had to stand for the whole journey.",
    "Please fill in this form and bring it back to the front desk.",
    "The museum has a new exhibition about the history of flight.",
]
TARGETS = ["French", "German", "Spanish", "Italian", "Portuguese", "Dutch"]
TRANSLATION_FORMS = ["Translate into {lang}: {s}", "How would you say this in {lang}? \"{s}\"",
                     "Translate the following sentence into {lang} and explain any tricky word choices: {s}"]

# --- new instructions over the handwritten passages and conversations ------------------------------------
SUMMARY_FORMS = [
    "Write a one-line headline for the following text.\n\n{p}",
    "List the three most important points of this text as bullet points.\n\n{p}",
    "Explain the following text to a ten-year-old in a few sentences.\n\n{p}",
    "Summarise the text below in about fifty words.\n\n{p}",
]
PASSAGE_QUESTIONS = [
    "Read the passage and answer: what is its main point, in one or two sentences?\n\nPassage:\n{p}",
    "List every number that appears in the passage below and say what each one refers to.\n\nPassage:\n{p}",
    "Using only the passage below, write three questions a reader could answer from it, each with its answer.\n\nPassage:\n{p}",
]
FOLLOW_UPS = [
    "Can you give me a concrete example of that?", "Could you put that into a short checklist?",
    "What would you suggest for a complete beginner?", "Can you summarise your answer in one sentence?",
    "What are the most common mistakes people make with this?",
]
PERSONAS = [
    "You are a patient teacher who explains things step by step.",
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a friendly travel guide.", "You are an experienced software engineer who reviews code carefully.",
    "You are a helpful assistant that always answers with a short list.",
]


def _passages(rows: list[dict], category: str) -> list[str]:
    """The longest paragraph of each handwritten prompt of ``category`` (its passage)."""
    out = []
    for r in rows:
        if r["category"] == category and "prompt" in r:
            lines = [line.strip().strip('"') for line in r["prompt"].split("\n")]
            out.append(max(lines, key=len))
    return out


def compose(handwritten: list[dict]) -> list[dict]:
    """The composed prompts, in a fixed order, from the handwritten ones and the lists above."""
    rng = random.Random(0)
    items: list[tuple[str, str | list]] = []
    for t in MECHANISMS:
        for f in rng.sample(MECHANISM_FORMS, 2):
            items.append(("qa", f.format(t=t)))
    for t in SUBJECTS:
        for f in rng.sample(SUBJECT_FORMS, 2):
            items.append(("qa", f.format(t=t)))
    for task in TASKS:
        for lang, form in zip(rng.sample(LANGUAGES, 3), CODE_FORMS):
            items.append(("code", form.format(lang=lang, task=task)))
    for c in CONCEPTS:
        items.append(("code", f"Explain {c}, with a short code example."))
    for template in MATH:
        drawn: set[str] = set()
        for _ in range(6):
            a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 9)
            while (text := template.format(a=a, b=b, c=c)) in drawn:  # a repeat (some use two numbers): next b
                b = b % 8 + 2
            drawn.add(text)
            items.append(("math_reasoning", text))
    for s in SENTENCES:
        for lang, form in zip(rng.sample(TARGETS, 3), TRANSLATION_FORMS):
            items.append(("translation", form.format(lang=lang, s=s)))
    for p in _passages(handwritten, "summarization"):
        for f in rng.sample(SUMMARY_FORMS, 2):
            items.append(("summarization", f.format(p=p)))
    for p in _passages(handwritten, "rag"):
        items.append(("rag", rng.choice(PASSAGE_QUESTIONS).format(p=p)))
    for r in handwritten:
        if r["category"] == "multi_turn":
            opening = [m for m in r["messages"] if m["role"] != "system"][:2]
            for q in rng.sample(FOLLOW_UPS, 2):
                items.append(("multi_turn", opening + [{"role": "user", "content": q}]))
    for t in MECHANISMS[::2] + SUBJECTS[::2]:
        persona = rng.choice(PERSONAS)
        items.append(("multi_turn", [{"role": "system", "content": persona},
                                     {"role": "user", "content": rng.choice(SUBJECT_FORMS).format(t=t)}]))
    out = []
    for n, (category, body) in enumerate(items, 1):
        row = {"id": f"{COMPOSED}{category}-{n:04d}", "category": category}
        row["prompt" if isinstance(body, str) else "messages"] = body
        out.append(row)
    return out


def main() -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    handwritten = [r for r in rows if not r["id"].startswith(COMPOSED)]
    lines = [json.dumps(r, ensure_ascii=False) for r in handwritten + compose(handwritten)]
    PROMPTS.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{PROMPTS}: {len(handwritten)} handwritten + {len(lines) - len(handwritten)} composed prompts")


if __name__ == "__main__":
    main()
