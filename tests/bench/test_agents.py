"""The agent workload's tools and sessions (``bench-serve --workload agent``): the calculator evaluates arithmetic
from its syntax tree and refuses anything else; each tool checks its arguments; a session runs its calls and sends
the results back until a reply calls nothing (against a real SmolLM2 server, its first turn made to call a tool);
the workload refuses peers."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.agents import FILES, MAX_TURNS, SYSTEM, calculate, run_session, run_tool
from specdecode.bench.serve_command import BenchServeConfig, Server


@pytest.mark.parametrize("expression, value", [("1234 * 56 + 789", "69893"), ("(4 + 9) * 12 - 7", "149"),
                                               ("2 ** 10", "1024"), ("-3 + 7 % 4", "0"), ("7 / 2", "3.5")])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x + 1", "2 ** 1000", "1 / 0", "3 +"])
def test_the_calculator_refuses_anything_but_arithmetic(expression):
    assert calculate(expression).startswith("error:")


def test_each_tool_checks_its_arguments_and_answers_from_its_fixtures():
    assert run_tool("read_file", json.dumps({"path": "./config/settings.toml"})) == (FILES["config/settings.toml"], True)
    assert run_tool("read_file", json.dumps({"path": "nope.txt"}))[0].startswith("error: no file")
    found, valid = run_tool("search", json.dumps({"query": "rate limits per minute"}))
    assert valid and found.splitlines()[0].startswith("Rate limits")
    assert run_tool("calculate", json.dumps({"expression": "6 * 7"})) == ("42", True)
    assert run_tool("calculate", json.dumps({"expr": "6 * 7"}))[1] is False
    assert run_tool("search", "{not json")[1] is False
    assert run_tool("unknown", "{}")[1] is False


def test_the_agent_workload_runs_our_servers_only():
    with pytest.raises(ValueError, match="our own servers"):
        BenchServeConfig("m", methods=("none", "llamacpp-server"), workload="agent")


@pytest.mark.integration
def test_a_session_runs_its_calls_and_sends_the_results_back(smollm2_path):
    srv = Server("agent", ["--model", str(smollm2_path), "--served-model-name", "m", "--threads", "2",
                           "--log-level", "warning"])
    try:
        srv.wait_ready(timeout=180)
        session = run_session(srv.url + "/v1", 2, 64, first_choice="required")
    finally:
        srv.stop()
    assert session.error is None
    first = json.loads(session.transcript[0])
    assert first["content"] is None and session.turns[0].calls == len(first["calls"]) >= 1
    assert {c["name"] for c in first["calls"]} <= {"calculate", "read_file", "search"}
    assert 0 <= session.turns[0].valid <= session.turns[0].calls  # (SmolLM2's arguments may run past the budget)
    assert 2 <= len(session.turns) <= MAX_TURNS  # the results went back, and the model answered again
    assert all(t.ttft_s is not None and t.tokens > 0 for t in session.turns)
    assert SYSTEM and len(session.transcript) == len(session.turns)
