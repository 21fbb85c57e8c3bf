"""Schemathesis against `specdecode serve`'s own OpenAPI schema, on a real server (SmolLM2 on loopback):
generated requests, valid (naming the served model, so that they reach the engine) and invalid, a bounded
number per operation (a 96-token context keeps each short; a deadline would answer 504, a 5xx by design). No answer is a 5xx, every status code is one the schema documents for its route, and every
body matches the schema."""

from __future__ import annotations

import pytest

from specdecode.bench.serve_command import Server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                               response_schema_conformance, status_code_conformance)

pytestmark = pytest.mark.integration
CASES = 30  # per operation and generation mode: bounded for CI


@pytest.fixture(scope="module")
def api_schema(smollm2_path):
    srv = Server("fuzz", ["--model", str(smollm2_path), "--served-model-name", "m", "--threads", "1",
                          "--max-running", "2", "--max-len", "96", "--log-level", "error"])
    try:
        srv.wait_ready(timeout=180)
        yield schemathesis.openapi.from_url(srv.url + "/openapi.json")
    finally:
        srv.stop()


# The GET routes take no input, so they have no invalid requests to generate.
OPERATIONS = [("POST /v1/completions", "positive"), ("POST /v1/completions", "negative"),
              ("POST /v1/chat/completions", "positive"), ("POST /v1/chat/completions", "negative"),
              ("POST /v1/responses", "positive"), ("POST /v1/responses", "negative"),
              ("GET /v1/models", "positive"), ("GET /health", "positive"), ("GET /metrics", "positive")]


@pytest.mark.parametrize("label, mode", OPERATIONS)
def test_no_5xx_and_every_answer_as_documented(api_schema, label, mode):
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in the server's schema"
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]

    strategy = operation.as_strategy(GenerationMode(mode))
    if mode == "positive" and label.startswith("POST"):  # the served name, so that valid requests reach the engine
        strategy = strategy.map(_served_model)

    @given(case=strategy)
    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case) -> None:
        case.call_and_validate(checks=checks)

    check()


def _served_model(case):
    if isinstance(case.body, dict):
        case.body["model"] = "m"
    return case
