"""Tool-call validity through `specdecode serve`: the share of calls that parse and validate against their tool's
JSON schema, per model, `tool_choice` (required, a named function, auto) and temperature, on agent-style questions
over three tools (a calculator, a file reader, a search), with the speculation figures of the constrained calls.

    python benchmarks/tool_call_validity.py --models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json

import jsonschema
import openai

from specdecode.bench.serve_command import Server
from specdecode.models.fetch import fetch

TOOLS = [
    {"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression",
                                      "parameters": {"type": "object", "required": ["expression"],
                                                     "properties": {"expression": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project",
                                      "parameters": {"type": "object", "required": ["path"],
                                                     "properties": {"path": {"type": "string"},
                                                                    "max_lines": {"type": "integer", "minimum": 1}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the documentation",
                                      "parameters": {"type": "object", "required": ["query"],
                                                     "properties": {"query": {"type": "string"},
                                                                    "top_k": {"type": "integer", "minimum": 1,
                                                                              "maximum": 10}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    ("What is 17 times 23?", "calculate"), ("Compute (4 + 9) * 12 - 7.", "calculate"),
    ("How much is 2 to the power of 10?", "calculate"), ("Show me the first lines of src/main.py.", "read_file"),
    ("What does the README say? Read README.md.", "read_file"), ("Open config/settings.toml.", "read_file"),
    ("Find the docs about rate limits.", "search"), ("Search for how to rotate API keys.", "search"),
    ("Look up the section on streaming responses.", "search"), ("Add 1234 and 5678.", "calculate"),
]


def run(client: openai.OpenAI, choice, temperature: float, max_tokens: int) -> dict:
    calls = valid = replies = accepted = drafted = 0
    for question, tool in QUESTIONS:
        chosen = {"type": "function", "function": {"name": tool}} if choice == "named" else choice
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                               tools=TOOLS, tool_choice=chosen, parallel_tool_calls=False,
                                               max_tokens=max_tokens, temperature=temperature, seed=7)
        replies += 1
        spec = reply.usage.model_extra["speculation"]
        accepted, drafted = accepted + spec["accepted_tokens"], drafted + spec["drafted_tokens"]
        for call in reply.choices[0].message.tool_calls or []:
            calls += 1
            try:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError, KeyError):
                pass
    return {"replies": replies, "calls": calls, "valid": valid, "accepted_tokens": accepted,
            "drafted_tokens": drafted}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96, help="each reply's budget (a call cut by it is no call)")
    args = p.parse_args()
    results = []
    for name in args.models.split(","):
        server = Server("tools", ["--model", str(fetch(name)), "--served-model-name", "m", "--threads",
                                  str(args.threads), "--log-level", "warning"])
        server.wait_ready(timeout=900)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        try:
            for choice in ("required", "named", "auto"):
                for temperature in (0.0, 0.7):
                    results.append({"model": name, "tool_choice": choice, "temperature": temperature,
                                    **run(client, choice, temperature, args.max_tokens)})
        finally:
            server.proc.kill()
            server.proc.wait()
    print(f"{'model':<30} {'choice':<9} {'T':>4} {'calls':>6} {'valid':>6} {'replies':>8} {'accepted/drafted':>17}")
    for r in results:
        print(f"{r['model']:<30} {r['tool_choice']:<9} {r['temperature']:>4} {r['calls']:>6} {r['valid']:>6} "
              f"{r['replies']:>8} {r['accepted_tokens']:>8}/{r['drafted_tokens']:<8}")
    print(json.dumps({"bench": "tool_call_validity", "threads": args.threads, "max_tokens": args.max_tokens,
                      "rows": results}))


if __name__ == "__main__":
    main()
