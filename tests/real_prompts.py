"""Real prompts for integration tests on real models: some input-grounded, some open-ended."""

GROUNDED = [
    "Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate, "
    "and the mayor signed it the next morning.",
    "Summarise in one paragraph: Solar panels convert sunlight into electricity using photovoltaic cells. "
    "When light hits a cell, it knocks electrons loose, creating a current. Panels are usually mounted on roofs "
    "and connected to an inverter, which turns direct current into the alternating current used by homes.",
    "Fix the bug in this Python function and return the corrected code:\n\ndef mean(xs):\n    total = 0\n"
    "    for x in xs:\n        total += x\n    return total / len(x)\n",
    "Translate to French: The library opens at nine in the morning and closes at six in the evening.",
    "Extract every date from this text as a list: The contract was signed on 3 March 2021, amended on "
    "14 July 2022, and expires on 31 December 2025.",
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy?",
    "Explain how a hash table works.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
]
ALL = GROUNDED + OPEN
