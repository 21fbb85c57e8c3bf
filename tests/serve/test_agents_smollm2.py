"""What agents need from `specdecode serve`, for real — tool calls, the Responses API, the prefix cache on by
default and the sampling fields clients send: a `specdecode serve` process on loopback serving SmolLM2 (whose chat
template knows no tools: they go in a system message, and calls are read in the Hermes form), driven by the
`openai` package and by two agent frameworks as their users run them (the OpenAI Agents SDK with its chat-completions
model and its default Responses model; LangChain's `ChatOpenAI`).

SmolLM2-135M rarely chooses a tool by itself, so the agents are given ``tool_choice`` required or a named function;
``auto``'s grammar is checked here to leave free text as the model writes it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from specdecode.bench.serve_command import Server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.integration

MODEL = "smollm2"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                        "parameters": {"type": "object", "required": ["a", "b"],
                                                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is 2 plus 3?"}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    srv = Server("tools", ["--model", str(smollm2_path), "--served-model-name", MODEL, "--threads", "2",
                           "--max-running", "4", "--log-level", "warning"])
    try:
        srv.wait_ready(timeout=180)
    except RuntimeError as exc:
        srv.proc.kill()
        pytest.fail(str(exc))
    yield srv.url
    srv.proc.kill()
    srv.proc.wait()
    srv.log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(call) -> dict:
    """The call's arguments, checked against its tool's schema."""
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def _streamed(client, **request) -> tuple[str, dict[int, list[str]], str | None]:
    """A streamed chat reply reassembled: content, {index: [id, name, arguments]}, the last finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", "", ""])
            if call.id:
                assert not entry[0], "a call's id and name come once"
                entry[0], entry[1] = call.id, call.function.name
            entry[2] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_constrained_calls_validate_stream_as_they_answer_and_speculate(client, choice):
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                   max_tokens=64, temperature=0)
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
    _valid(message.tool_calls[0])
    if isinstance(choice, dict):
        assert message.tool_calls[0].function.name == "get_weather"
    # The grammar's forced text (the opener, the name, the keys) is drafted and kept.
    spec = reply.usage.model_extra["speculation"]
    assert spec["accepted_tokens"] >= 5 and spec["mean_accepted_length"] > 1.5, spec
    content, calls, finish = _streamed(client, **request)
    assert content == "" and finish == "tool_calls"
    assert [(name, args) for _, name, args in calls.values()] == \
        [(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)]


def test_parallel_calls_come_back_in_order_with_their_indexes(client):
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=0)
    reply = client.chat.completions.create(**request)
    calls = reply.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        _valid(call)
    _, streamed, _ = _streamed(client, **request)
    assert sorted(streamed) == list(range(len(streamed)))
    assert [(s[1], s[2]) for s in streamed.values()][:len(calls)] == [(c.function.name, c.function.arguments)
                                                                       for c in calls]


def test_auto_leaves_an_answer_in_words_as_the_model_writes_it(client, smollm2):
    """Under auto the grammar constrains nothing before an opener: the reply equals the same prompt's reply with
    no grammar at all (a completion of the rendered chat, which the server renders the same way)."""
    messages = [{"role": "user", "content": "Hi! How are you?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")
    from specdecode.serve.requests import ChatMessage
    from specdecode.serve.tools import ToolSpec, plan_tools, render_messages
    tok = smollm2.tokenizer
    plan = plan_tools([ToolSpec(**t) for t in TOOLS], "auto", None, tok.chat_template, lambda text: None)
    rendered, variables = render_messages([ChatMessage(**m) for m in messages], plan, tok.chat_template)
    prompt = tok.apply_chat_template(rendered, **variables)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].text
    _, calls, _ = _streamed(client, model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0)
    assert calls == {}


def test_tool_choice_none_serves_the_chat_as_if_there_were_no_tools(client):
    with_none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                               max_tokens=24, temperature=0)
    without = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    assert with_none.choices[0].message.content == without.choices[0].message.content
    assert with_none.choices[0].message.tool_calls is None


def test_a_tool_result_goes_back_into_the_conversation(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result were rendered


def _post(base: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [ADD, WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_unknown", "content": "5"}], "tools": [ADD]},
     "messages[1].tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
])
def test_bad_tool_requests_get_a_400_naming_the_field(server, body, param):
    status, reply = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_tools_on_legacy_completions_are_refused(server):
    status, reply = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "tools": [ADD]})
    assert status == 400 and reply["error"]["param"] == "tools"


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_a_follow_up_turn_reuses_its_history_from_the_prefix_cache(client, server):
    """With default flags an agent's next turn loads the turns before it: the prompt tokens of the first request
    come back as prefix-cache hits (whole blocks), counted in /metrics, and the answer is what a cold server gives
    (the chat-completions equivalence tests above run on this same, warm, server)."""
    history = [{"role": "system", "content": "You are a careful assistant. " * 40}, *ASK]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    hits, queries = _metric(server, "vllm:prefix_cache_hits_total"), _metric(server, "vllm:prefix_cache_queries_total")
    follow = history + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And 3 plus 4?"}]
    client.chat.completions.create(model=MODEL, messages=follow, max_tokens=8, temperature=0)
    reused = _metric(server, "vllm:prefix_cache_hits_total") - hits
    assert reused >= first.usage.prompt_tokens - 64, reused  # all but the last, partial block
    assert _metric(server, "vllm:prefix_cache_queries_total") > queries + reused
    assert _metric(server, "specdecode:prefix_cache_bytes") > 0


# ------------------------------------------------------------------ the Responses API

def test_a_response_is_the_chat_completions_answer(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *ASK],
                                          max_tokens=32, temperature=0)
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="What is 2 plus 3?",
                                       max_output_tokens=32, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_a_response_streams_typed_events_that_add_up_to_it(client):
    whole = client.responses.create(model=MODEL, input="Name a river.", max_output_tokens=24, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Name a river.", max_output_tokens=24, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text


def test_a_function_call_round_trip_through_responses(client):
    tools = [{"type": "function", "name": "add", "description": "Add two integers",
              "parameters": SCHEMAS["add"]}]
    first = client.responses.create(model=MODEL, input="What is 2 plus 3?", tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["add"])
    events = list(client.responses.create(model=MODEL, input="What is 2 plus 3?", tools=tools, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=64, temperature=0,
                                          stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == calls[0].arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [calls[0].arguments]
    follow = client.responses.create(model=MODEL, tools=tools, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "What is 2 plus 3?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "add", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}])
    assert follow.usage.input_tokens > first.usage.input_tokens


def test_a_response_follows_its_text_format(client):
    schema = {"type": "object", "properties": {"river": {"type": "string"}}, "required": ["river"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Name a river as JSON.", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "river", "schema": schema}})
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "5"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "", "output": "5"}]}, "input"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools.0.name"),
    ({"input": "\udfff"}, "input"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": []}, "input"),
])
def test_bad_responses_requests_get_a_400_naming_the_field(server, body, param):
    status, reply = _post(server, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


# ------------------------------------------------------------------ agent frameworks, unmodified

@pytest.mark.parametrize("kind", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_an_openai_agents_sdk_agent_calls_its_tool(server, kind):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    model = getattr(agents, kind)(MODEL, AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="calculator", instructions="Use the add tool.", tools=[add], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             temperature=0, max_tokens=64),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "What is 2 plus 3?"))
    assert len(seen) >= 1 and result.final_output == str(sum(seen[0]))


def test_a_langchain_chat_model_calls_its_tool_and_reads_the_result(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=server + "/v1", api_key="unused", temperature=0,
                                      max_tokens=48, max_retries=0)
    asked = [HumanMessage("What is 6 times 7?")]
    message = llm.bind_tools([multiply], tool_choice="multiply").invoke(asked)
    assert [c["name"] for c in message.tool_calls] == ["multiply"]
    call = message.tool_calls[0]
    assert set(call["args"]) == {"a", "b"} and all(isinstance(v, int) for v in call["args"].values())
    streamed = None
    for chunk in llm.bind_tools([multiply], tool_choice="multiply").stream(asked):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["args"] == call["args"]
    answer = llm.bind_tools([multiply]).invoke(asked + [message, ToolMessage(str(multiply.invoke(call["args"])),
                                                                             tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length",
                                                                                             "tool_calls")


# ------------------------------------------------------------------ sampling fields

def test_penalties_bias_and_min_p_give_the_library_s_answer(client, smollm2):
    """Served greedy answers with presence/frequency/repetition penalties, a logit bias and min-p (speculating with
    the default drafter) are what the library's plain decoding gives with the same settings."""
    from specdecode.engine import Engine
    from specdecode.sampling import Penalties, SamplingParams
    messages = [{"role": "user", "content": "List the days of the week, then list them again."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    banned = smollm2.tokenizer.encode(" Monday")[0]
    asked = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={str(banned): -100},
                 extra_body={"repetition_penalty": 1.2, "min_p": 0.05})
    served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0, **asked)
    sampling = SamplingParams(min_p=0.05, penalties=Penalties(0.8, 0.4, 1.2, ((banned, -100.0),)))
    want = Engine(smollm2.model, smollm2.tokenizer).generate(prompt, sampling, max_new_tokens=48)
    assert served.choices[0].message.content == want.text != plain.choices[0].message.content
    assert banned not in want.token_ids


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
])
def test_bad_sampling_fields_get_a_400_naming_them(server, body, param):
    status, reply = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_n_choices_are_each_their_own_sequence_streamed_and_not(client):
    """``n`` > 1: each choice is decoded as its own request (greedy: all alike, each the single answer; seeded
    sampling: choice i as a request with seed + i), streamed interleaved by index, usage summed over the choices."""
    single = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0)
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.message.content for c in greedy.choices} == {single.choices[0].message.content}
    assert greedy.usage.prompt_tokens == single.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * single.usage.completion_tokens
    sampled = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=1.0, seed=5, n=3)
    alone = [client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=1.0, seed=5 + i)
             for i in range(3)]
    assert [c.message.content for c in sampled.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in sampled.choices}) > 1
    texts, finishes = {}, {}
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=1.0, seed=5,
                                                n=3, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == sampled.usage.completion_tokens
    assert [texts[i] for i in range(3)] == [c.message.content for c in sampled.choices]
    assert all(finishes[i] in ("stop", "length") for i in range(3))
