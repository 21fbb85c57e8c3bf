"""``specdecode bench``: every method and its peers, side by side, on packaged or user prompt suites.

prompts.py (suites, validation, rendering) -> methods.py (what runs) -> runner.py (how it runs) ->
report.py (figures and output); command.py wires them to the command line. Importing this package
is cheap: models, transformers and matplotlib load only when a benchmark runs.
"""
