"""merge_replicas with no Ray: several servers' metrics as one valid exposition, each series labelled by replica."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from specdecode.control import StepRecord
from specdecode.serve.metrics import ServeMetrics, merge_replicas


def _served(drafted: int, accepted: int, running: int) -> bytes:
    m = ServeMetrics("smollm2")
    seq = SimpleNamespace(id=1, arrival=0.0, request=SimpleNamespace(prompt_ids=[1, 2, 3]))
    m.admitted(seq)
    m.stepped(seq, StepRecord(ctx=None, requested=drafted, drafted=drafted, accepted=accepted, draft_s=0.0,
                              verify_s=0.0), emitted=accepted + 1, now=0.5)
    m.stepped(seq, StepRecord(ctx=None, requested=0, drafted=0, accepted=0, draft_s=0.0, verify_s=0.0), emitted=1,
              now=0.52)
    m.gauges(running, 0, 0.25)
    return m.render()


def test_each_family_once_each_series_labelled_and_values_kept():
    text = merge_replicas({"r1": _served(4, 3, 2), "r2": _served(2, 0, 1)}).decode()
    assert text.count("# TYPE vllm:spec_decode_num_draft_tokens_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    values = {(s.name, s.labels.get("replica"), s.labels.get("position"), s.labels.get("le")): s.value
              for f in families.values() for s in f.samples}
    assert values[("vllm:spec_decode_num_draft_tokens_total", "r1", None, None)] == 4
    assert values[("vllm:spec_decode_num_draft_tokens_total", "r2", None, None)] == 2
    assert values[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "r1", "2", None)] == 1
    assert ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "r2", "0", None) not in values
    assert values[("vllm:num_requests_running", "r2", None, None)] == 1
    assert values[("vllm:generation_tokens_total", "r1", None, None)] == 5
    assert values[("vllm:time_to_first_token_seconds_count", "r1", None, None)] == 1
    assert values[("vllm:inter_token_latency_seconds_bucket", "r2", None, "0.025")] == 1
    assert all(s.labels["model_name"] == "smollm2" for f in families.values() for s in f.samples)
    assert merge_replicas({}) == b""
