"""The agent workload of ``bench-serve --workload agent``: multi-turn sessions in which the model calls tools and
reads their results, replayed through a server with the OpenAI chat API (``tools``, ``tool_choice`` auto).

Three tools over fixtures held here: ``calculate`` (arithmetic, evaluated from the expression's syntax tree, never
``eval``), ``read_file`` (a small project tree) and ``search`` (a corpus of documentation snippets). A session sends
its task, runs each call the reply makes and sends the results back, until a reply calls nothing or ``MAX_TURNS``
turns have run; every request is streamed, so each turn's time to its first token is seen. Per method it reports
tokens/s over the sessions' wall time, TTFT per turn, the calls made and how many validate against their schema,
and whether every transcript equals plain decoding's. It does not start servers (``serve_command.py``).
"""

from __future__ import annotations

import ast
import json
import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import openai

from specdecode.bench.load import closed_loop

AGENT_WORKLOAD = "agent"  # bench-serve's --workload name for these sessions
MAX_TURNS = 4
FILES = {
    "README.md": "# inventory-service\nTracks stock levels per warehouse. Run `make serve` to start the API on "
                 "port 8080; `make test` runs the tests.\n",
    "src/stock.py": "def reorder_point(daily_use, lead_days, safety=10):\n    return daily_use * lead_days + safety\n",
    "config/settings.toml": "[server]\nport = 8080\nworkers = 4\n\n[limits]\nrequests_per_minute = 120\n",
    "docs/CHANGELOG.md": "## 1.4.0\n- per-warehouse reorder points\n## 1.3.2\n- fix rounding of stock levels\n",
}
CORPUS = [
    "Rate limits: each API key may send 120 requests per minute; beyond that the API answers 429 with Retry-After.",
    "Authentication: send the API key in the Authorization header as a bearer token; keys rotate every 90 days.",
    "Warehouses: each warehouse has an id such as WH-3 and its own stock levels and reorder points.",
    "Reorder points: the stock level at which an order is placed, daily use times lead days plus a safety stock.",
    "Streaming: add stream=true to receive server-sent events, one per stock change.",
]
TOOLS = [
    {"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression",
                                      "parameters": {"type": "object", "required": ["expression"],
                                                     "properties": {"expression": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project by its path",
                                      "parameters": {"type": "object", "required": ["path"],
                                                     "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the documentation",
                                      "parameters": {"type": "object", "required": ["query"],
                                                     "properties": {"query": {"type": "string"}}}}},
]
SYSTEM = ("You are a coding assistant for the inventory-service project. Use the tools to look things up or "
          "compute, then answer briefly. Project files: " + ", ".join(FILES) + ".")
TASKS = [
    "What port does the server listen on? Check config/settings.toml.",
    "What is the reorder point for a daily use of 35 units, 6 lead days and a safety stock of 10? Compute it.",
    "What changed in version 1.4.0? Read docs/CHANGELOG.md.",
    "How many requests per minute may one API key send? Search the docs.",
    "Read src/stock.py and tell me what reorder_point returns for daily_use=12 and lead_days=9.",
    "How do I start the API? Read README.md.",
    "How often do API keys rotate? Search the docs.",
    "What is 1234 * 56 + 789? Use the calculator.",
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """An arithmetic expression's value, from its syntax tree (numbers and + - * / ** % only)."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** %")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """A call's result and whether its arguments were valid (parsed, with the required key of the right type)."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "error: the arguments are not JSON", False
    key = {"calculate": "expression", "read_file": "path", "search": "query"}.get(name)
    if key is None or not isinstance(args, dict) or not isinstance(args.get(key), str):
        return f"error: {name} takes {{{key!r}: string}}", False
    if name == "calculate":
        return calculate(args[key]), True
    if name == "read_file":
        return FILES.get(args[key].lstrip("./"), f"error: no file {args[key]}"), True
    words = set(args[key].lower().split())
    hits = sorted(CORPUS, key=lambda doc: -len(words & set(doc.lower().replace(":", " ").split())))
    return "\n".join(hits[:2]), True


@dataclass
class Turn:
    """One request of a session: its time to the first token, tokens, wall time and the calls it made."""

    ttft_s: float | None
    tokens: int
    latency_s: float
    calls: int = 0
    valid: int = 0


@dataclass
class Session:
    task: int
    turns: list[Turn] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)  # each reply's content and calls, for the identity check
    error: str | None = None


def _streamed_turn(client: openai.OpenAI, messages: list[dict], max_tokens: int, choice: str) -> tuple[Turn, dict]:
    start, first = time.perf_counter(), None
    content, calls, tokens = "", {}, 0
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=choice,
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if (delta.content or delta.tool_calls) and first is None:
            first = time.perf_counter() - start
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]
    return Turn(first, tokens, time.perf_counter() - start), message


def run_session(base_url: str, task: int, max_tokens: int, first_choice: str = "auto") -> Session:
    """One task's session; ``first_choice`` is the first turn's ``tool_choice`` (``required`` makes it call a tool,
    as agent frameworks do to start a tool loop), every later turn's is ``auto``."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900)
    session = Session(task)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[task]}]
    try:
        for turn_index in range(MAX_TURNS):
            turn, message = _streamed_turn(client, messages, max_tokens, first_choice if turn_index == 0 else "auto")
            session.turns.append(turn)
            calls = [c["function"] for c in message.get("tool_calls", [])]  # their ids are random: not compared
            session.transcript.append(json.dumps({"content": message["content"], "calls": calls}, sort_keys=True))
            messages.append(message)
            if "tool_calls" not in message:
                break
            for call in message["tool_calls"]:
                result, valid = run_tool(call["function"]["name"], call["function"]["arguments"])
                turn.calls, turn.valid = turn.calls + 1, turn.valid + valid
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    except openai.OpenAIError as exc:
        session.error = str(exc)
    return session


def run_sessions(port: int, concurrency: int, max_tokens: int) -> tuple[list[Session], float]:
    """Every task's session, ``concurrency`` at a time (a closed loop); the sessions and the wall time."""
    base_url = f"http://127.0.0.1:{port}/v1"
    return closed_loop(len(TASKS), concurrency, lambda task: run_session(base_url, task, max_tokens))


def summarize_sessions(sessions: list[Session], wall_s: float) -> dict[str, Any]:
    turns = [t for s in sessions for t in s.turns]
    ttfts = sorted(t.ttft_s for t in turns if t.ttft_s is not None)
    later = sorted(t.ttft_s for s in sessions for t in s.turns[1:] if t.ttft_s is not None)
    return {"tokens_per_s": sum(t.tokens for t in turns) / wall_s if wall_s else 0.0, "wall_s": wall_s,
            "turns": len(turns), "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "follow_up_ttft_p50_s": statistics.median(later) if later else None,
            "calls": sum(t.calls for t in turns), "valid_calls": sum(t.valid for t in turns),
            "errors": sum(s.error is not None for s in sessions)}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def agent_table(rows: list[dict[str, Any]], transcripts: dict, levels: list[int], methods: tuple[str, ...],
                plain: str) -> list[dict[str, Any]]:
    """One row per method and level over the runs' ``rows`` (medians), with tokens/s against ``plain``'s and
    whether every transcript equals ``plain``'s first."""
    table = []
    for level in levels:
        reference = _median([r["tokens_per_s"] for r in rows if r["method"] == plain and r["concurrency"] == level])
        for method in methods:
            mine = [r for r in rows if r["method"] == method and r["concurrency"] == level]
            row = {"method": method, "concurrency": level,
                   **{k: _median([r[k] for r in mine]) for k in ("tokens_per_s", "wall_s", "ttft_p50_s",
                                                                 "follow_up_ttft_p50_s")},
                   "turns": mine[0]["turns"], "calls": mine[0]["calls"], "valid_calls": mine[0]["valid_calls"],
                   "errors": sum(r["errors"] for r in mine),
                   "identical": all(t == transcripts[(plain, level)][0] for t in transcripts[(method, level)])}
            row["vs_plain"] = row["tokens_per_s"] / reference if reference else None
            table.append(row)
    return table


def print_agent_table(table: list[dict[str, Any]], log: Callable[[str], None]) -> None:
    log(f"{'method':<18}{'conc':>5}{'tok/s':>9}{'vs plain':>10}{'wall':>8}{'TTFT p50':>10}{'follow-up':>10}"
        f"{'turns':>7}{'calls':>7}{'valid':>7}  identical")
    for t in table:
        ms = lambda v: f"{1e3 * v:.0f}ms" if v is not None else "-"  # noqa: E731
        log(f"{t['method']:<18}{t['concurrency']:>5}{t['tokens_per_s']:>9.1f}{t['vs_plain'] or 0:>10.2f}"
            f"{t['wall_s']:>7.1f}s{ms(t['ttft_p50_s']):>10}{ms(t['follow_up_ttft_p50_s']):>10}{t['turns']:>7}"
            f"{t['calls']:>7}{t['valid_calls']:>7}  {t['identical']}")
