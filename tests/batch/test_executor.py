"""The batch executor on tiny random models: each request's greedy tokens are bitwise those it gets served alone,
under every cache setting and row budget; cancelling frees the slot for the next request; bad input is named."""

from __future__ import annotations

import pytest
import torch

from batch_cases import CACHE_SETTINGS, PROMPTS, requests
from kernel_paths import NATIVE_PATHS, path_params, require_path
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import QueueFullError, SchedulerConfig
from specdecode.batch.target_kv import CHUNKED_PREFIX_BLOCK
from specdecode.control import ControllerFactory
from specdecode.control.long import LongDrafts
from specdecode.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter, NgramTreeDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.kv.cache import CacheConfig
from specdecode.models.build import pack_model
from specdecode.models.transformer import Transformer
from tiny_models import OracleTreeDrafter, random_head_drafter, varied_model

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def target() -> Transformer:
    return varied_model(0)


@pytest.fixture(scope="module")
def draft_model() -> Transformer:
    return varied_model(0, keep_layers=[0, 1])  # the target truncated: agrees often, not always


def _new_drafter(kind: str, target: Transformer, draft_model: Transformer, cache: CacheConfig):
    """A drafter factory (the batch engine makes one drafter per KV slot)."""
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter
    if kind == "ngram-tree":
        return NgramTreeDrafter
    if kind == "draft":
        return lambda: DraftModelDrafter(draft_model, target, cache)
    if kind == "draft-tree":
        return lambda: DraftModelDrafter(draft_model, target, cache, tree_width=2)
    if kind == "layerskip":  # drafts in its sequence's slot of the target's own cache
        return lambda: LayerSkipDrafter(target, [1])
    return lambda: random_head_drafter(kind, target, seed=3, cache=cache)


@pytest.mark.parametrize("setting", CACHE_SETTINGS)
@pytest.mark.parametrize("kind", ["none", "eagle3"])
def test_batched_greedy_output_equals_each_request_served_alone(target, draft_model, setting, kind):
    """Plain decoding and the EAGLE-3 head variant; every registered drafter runs this in test_conformance.py."""
    cache = CACHE_SETTINGS[setting]
    new = _new_drafter(kind, target, draft_model, cache)
    solo = Engine(target, drafter=new() if new else None, spec=SpeculativeConfig(gamma=4), cache=cache)
    want = [solo.generate(**r).token_ids for r in requests()]
    engine = BatchEngine(target, new_drafter=new, spec=SpeculativeConfig(gamma=4), cache=cache,
                         scheduler=SchedulerConfig(max_running=3), max_len=96)
    for _ in range(2):  # the second round reuses the slots (and the prefix cache)
        results = engine.run(requests())
        assert [r.token_ids for r in results] == want, (setting, kind)
        assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    if kind != "none":
        assert sum(r.stats.drafted_tokens for r in results) > 0  # drafts were verified
    if kind in ("ngram", "ngram-tree", "draft", "draft-tree", "layerskip"):
        assert sum(r.stats.accepted_tokens for r in results) > 0  # and some kept (random heads may get none)
    assert engine.scheduler.slots.free == 3 and all(t.referenced == 0 for t in engine.memory.prefixes.values())


@pytest.mark.parametrize("setting", ["auto", "int8", "window"])
def test_batched_trees_move_each_accepted_path_into_its_slot(target, setting):
    """Several sequences' trees (paths off the first branch, ``OracleTreeDrafter``) share each forward with
    chains and prompt rows; every request still gets its plain greedy output."""
    cache = CACHE_SETTINGS[setting]
    solo = Engine(target, cache=cache)
    want = [solo.generate(**r).token_ids for r in requests()]
    answers = {tuple(r["prompt"]): w for r, w in zip(requests(), want)}
    engine = BatchEngine(target, new_drafter=lambda: OracleTreeDrafter(answers, target.config.vocab_size),
                         spec=SpeculativeConfig(gamma=5), cache=cache,
                         scheduler=SchedulerConfig(max_running=3, max_rows=18), max_len=96)
    results = engine.run(requests())
    assert [r.token_ids for r in results] == want, setting
    assert sum(r.stats.tree_steps for r in results) > 10
    assert all(r.stats.accepted_tokens >= r.stats.tree_steps for r in results)


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("kind", ["none", "ngram", "eagle"])
def test_prompts_prefilled_inside_decode_steps_change_no_token(path, kind):
    """On our kernels prompts are prefilled a few rows per step, in the same forwards as other sequences'
    decode rows (an EAGLE head reading their features chunk by chunk); every request still gets, bitwise,
    what it gets alone."""
    require_path(path)
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path)
    new = _new_drafter(kind, model, None, CacheConfig())
    solo = Engine(model, drafter=new() if new else None, spec=SpeculativeConfig(gamma=4))
    want = [solo.generate(**r).token_ids for r in requests()]
    for rows, chunk in ((16, 256), (5, 3)):  # prompts in chunks of up to 15 rows, or 1 to 3 rows at a time
        engine = BatchEngine(model, new_drafter=new, spec=SpeculativeConfig(gamma=4), max_len=96,
                             scheduler=SchedulerConfig(max_running=4, max_rows=rows, prefill_chunk=chunk))
        assert engine.admission.chunked
        assert [r.token_ids for r in engine.run(requests())] == want, (path, kind, rows)


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
@pytest.mark.parametrize("kind", ["none", "ngram", "eagle"])
def test_prompts_prefilled_inside_decode_steps_reuse_stored_prefixes_bitwise(path, kind):
    """With the prefix cache (the server's default), a prompt read inside the decode steps first loads the longest
    stored prefix, and a prompt once read is stored: a conversation's next turn (its history plus a new message)
    starts from the stored history and gets, bitwise, what it gets with no prefix cache."""
    require_path(path)
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path)
    new = _new_drafter(kind, model, None, CacheConfig())
    solo = Engine(model, drafter=new() if new else None, spec=SpeculativeConfig(gamma=4))
    histories = [dict(r, prompt=r["prompt"] * 3) for r in requests()]
    turns = [dict(r, prompt=r["prompt"] + [23, 24, 25, 26, 27, 28]) for r in histories]  # each history, followed up
    want = [solo.generate(**r).token_ids for r in histories + turns]
    engine = BatchEngine(model, new_drafter=new, spec=SpeculativeConfig(gamma=4), max_len=160,
                         cache=CacheConfig(prefix_cache=True), scheduler=SchedulerConfig(max_running=4, max_rows=7))
    assert engine.admission.chunked
    first, follow = engine.run(histories), engine.run(turns)
    assert [r.token_ids for r in first + follow] == want, (path, kind)
    held = [len(r["prompt"]) - 1 for r in histories]  # each first turn's prompt rows, whole blocks of them stored
    block = CHUNKED_PREFIX_BLOCK
    assert [r.stats.prefix_hit_tokens for r in follow] == [n // block * block for n in held]
    assert sum(r.stats.prefix_hit_tokens for r in follow) >= 3 * block
    assert all(t.referenced == 0 for t in engine.memory.prefixes.values())


def test_a_tight_row_budget_shortens_drafts_and_changes_no_token(target):
    want = BatchEngine(target, new_drafter=NgramDrafter, spec=SpeculativeConfig(gamma=6),
                       scheduler=SchedulerConfig(max_running=4, max_rows=40), max_len=96).run(requests())
    tight = BatchEngine(target, new_drafter=NgramDrafter, spec=SpeculativeConfig(gamma=6),
                        scheduler=SchedulerConfig(max_running=4, max_rows=6), max_len=96).run(requests())
    assert [r.token_ids for r in tight] == [r.token_ids for r in want]
    assert sum(r.stats.drafted_tokens for r in tight) < sum(r.stats.drafted_tokens for r in want)


def test_cancel_frees_the_slot_for_the_next_request_and_ends_its_stream(target):
    engine = BatchEngine(target, scheduler=SchedulerConfig(max_running=2), max_len=96)
    outputs = {}
    seqs = [engine.submit(p, max_new_tokens=20, eos_token_ids=(),
                          on_output=lambda s, o: outputs.setdefault(s.id, []).append(o)) for p in PROMPTS[:3]]
    engine.step()
    assert [s.slot for s in seqs] == [0, 1, None]
    engine.cancel(seqs[0])
    assert seqs[0].finish_reason == "cancelled" and outputs[seqs[0].id][-1].finish_reason == "cancelled"
    engine.step()
    assert seqs[2].slot == 0  # the cancelled request's slot, reused within one step
    while engine.has_work:
        engine.step()
    assert len(seqs[0].generated) == 1 and len(seqs[1].generated) == len(seqs[2].generated) == 20
    alone = Engine(target).generate(PROMPTS[2], max_new_tokens=20, eos_token_ids=())
    assert seqs[2].generated == alone.token_ids  # the reused slot holds nothing of the cancelled request
    assert engine.scheduler.slots.free == 2
    assert [o.finish_reason for o in outputs[seqs[1].id]].count("length") == 1


def test_bad_input_and_a_full_queue_are_refused_with_the_reason(target):
    engine = BatchEngine(target, scheduler=SchedulerConfig(max_running=1, max_waiting=0), max_len=32)
    with pytest.raises(ValueError, match=r"exceeds the engine's max_len per sequence \(32 tokens\)"):
        engine.submit([1] * 30, max_new_tokens=8)
    with pytest.raises(ValueError, match="stop strings need an engine with a tokenizer"):
        engine.submit([1, 2], max_new_tokens=8, stop="x")
    engine.submit([1, 2], max_new_tokens=8)
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit([1, 2], max_new_tokens=8)
    with pytest.raises(ValueError, match=r"max_len must be in 1..512"):
        BatchEngine(target, max_len=1000)


class _FillSpy:
    """A fixed-gamma controller that notes, at each step, the budget share it was told and what the caches hold."""

    early_stop = False

    def __init__(self, engine: BatchEngine, seen: list) -> None:
        self.engine, self.seen = engine, seen

    def next_gamma(self, ctx) -> int:
        memory = self.engine.memory
        in_use = sum(c.bytes_used() for c in memory.caches.values()) + memory.prefix_bytes
        self.seen.append((ctx.cache_fill, in_use / memory.budget,
                          self.engine.kv.cache.bytes_used() / memory.budget))
        return 3

    def stop(self, position, signal) -> bool:
        return False

    def keep(self, drafted: int) -> int:
        return drafted

    def update(self, record) -> None:
        pass


class _RowSpy:
    """A controller that asks for 2 and 1 tokens in turn and notes which controller it is, the rows it was told the
    others hold, its budget left and what it asked for."""

    early_stop = False

    def __init__(self, seen: list) -> None:
        self.seen, self.calls = seen, 0

    def next_gamma(self, ctx) -> int:
        self.calls += 1
        gamma = 2 if self.calls % 2 else 1
        self.seen.append((self, ctx.others_rows, ctx.remaining, gamma))
        return gamma

    def stop(self, position, signal) -> bool:
        return False

    def keep(self, drafted: int) -> int:
        return drafted

    def update(self, record) -> None:
        pass


class _RecordSpy(_RowSpy):
    """A _RowSpy that keeps every step record it is handed."""

    def __init__(self, seen: list, records: list) -> None:
        super().__init__(seen)
        self.records = records

    def update(self, record) -> None:
        self.records.append(record)


@pytest.mark.parametrize("path", path_params(NATIVE_PATHS))
def test_a_step_that_ends_a_prompt_is_recorded_with_the_prompt_rows_it_held(path):
    # Drift fixed: a sequence whose last prompt rows shared its first decode step recorded the step as run alone
    # with nothing else in it, so the controllers learnt a prompt chunk's forward as a plain one-row step.
    require_path(path)
    model = varied_model(0, dtype=torch.bfloat16)
    pack_model(model, path)
    engine = BatchEngine(model, new_drafter=NgramDrafter, spec=SpeculativeConfig(gamma=2), max_len=96,
                         scheduler=SchedulerConfig(max_running=1, max_rows=4, prefill_chunk=8))
    records: list = []
    engine.admission.new_controller = ControllerFactory(lambda _: _RecordSpy([], records))
    engine.run([dict(prompt=list(range(20, 40)), max_new_tokens=4, eos_token_ids=())])  # 19 prompt rows: 8 + 8 + 3
    assert [r.others_rows for r in records][:2] == [3, 0]


def _rows_seen(target, draft_model, max_rows: int) -> list[list]:
    """Two long requests under _RowSpy controllers: per step where both decode with room for whole drafts (no
    prompt rows, no budget's end), (controller, others' rows it was told, what it asked for) in drafting order."""
    seen: list = []
    engine = BatchEngine(target, new_drafter=lambda: DraftModelDrafter(draft_model, target, CacheConfig()),
                         spec=SpeculativeConfig(gamma=2), scheduler=SchedulerConfig(max_running=2, max_rows=max_rows),
                         max_len=96)
    engine.admission.new_controller = ControllerFactory(lambda _: _RowSpy(seen))
    for prompt in PROMPTS[:2]:
        engine.submit(prompt, max_new_tokens=24, eos_token_ids=())
    steps = []
    while engine.has_work:
        seen.clear()
        engine.step()
        prefilling = any(s.prompt_pending for s in engine.scheduler.running)
        if len(seen) == 2 and min(left for _, _, left, _ in seen) > 2 and not prefilling:
            steps.append([(spy, rows, gamma) for spy, rows, _, gamma in seen])
    assert len(steps) > 4
    return steps


def test_drafts_are_priced_in_turn_at_the_step_they_join(target, draft_model):
    # Drift fixed: every sequence priced its draft at the others' last drafts only; now the one drafting second
    # sees the first's draft of this step (its fed token and draft), the first sees the other's fed token and a
    # draft as long as its last. Who drafts first turns each step.
    steps = _rows_seen(target, draft_model, max_rows=8)
    for before, (first, second) in zip(steps, steps[1:]):
        assert second[1] == 1 + first[2]
        other_last = next(gamma for spy, _, gamma in before if spy is second[0])
        assert first[1] == 1 + other_last
    firsts = [step[0][0] for step in steps]
    assert all(a is not b for a, b in zip(firsts, firsts[1:]))


def test_the_room_left_for_drafts_goes_to_whose_turn_it_is(target, draft_model):
    steps = _rows_seen(target, draft_model, max_rows=3)  # one row of room: the first to draft takes it
    assert all(second[1] == 2 for _, second in steps)
    firsts = [step[0][0] for step in steps]
    assert all(a is not b for a, b in zip(firsts, firsts[1:]))


def test_the_budget_share_a_controller_sees_counts_the_draft_caches(target, draft_model):
    # Drift fixed: the batch engine priced memory pressure from the target's cache alone; one request alone
    # saw the draft caches too. Both now run this step, so the share counts every cache the budget covers.
    cache = CacheConfig(budget=1 << 30)
    engine = BatchEngine(target, new_drafter=lambda: DraftModelDrafter(draft_model, target, cache),
                         spec=SpeculativeConfig(gamma=3), cache=cache, scheduler=SchedulerConfig(max_running=2),
                         max_len=96)
    seen = []
    engine.admission.new_controller = ControllerFactory(lambda _: _FillSpy(engine, seen))
    engine.run(requests()[:3])
    assert seen and all(fill == pytest.approx(in_use) for fill, in_use, _ in seen)
    assert any(fill > target_only for fill, _, target_only in seen)


def test_batched_requests_report_their_step_cost_and_predicted_speedup(target):
    # Drift fixed: only a lone request measured its decode step, so a served one had no predicted speedup.
    results = BatchEngine(target, new_drafter=NgramDrafter, spec=SpeculativeConfig(gamma=3),
                          scheduler=SchedulerConfig(max_running=3), max_len=96).run(requests()[:4])
    for r in results:
        assert r.stats.decode_step_s is not None and r.stats.decode_step_s > 0
        assert r.stats.predicted_speedup is not None and r.stats.predicted_speedup > 0


def test_the_device_is_synchronised_after_every_timed_forward(target, monkeypatch):
    # Drift fixed: the batch engine read its timers without waiting for the device (wrong on a GPU, where
    # kernels run asynchronously); every step's forward and every timed forward now synchronises first.
    synced = []
    monkeypatch.setattr(target, "synchronize", lambda: synced.append(target.device))
    engine = BatchEngine(target, new_drafter=NgramDrafter, spec=SpeculativeConfig(gamma=3),
                         scheduler=SchedulerConfig(max_running=2), max_len=96)
    steps = 0
    for r in requests()[:2]:
        engine.submit(**r)
    while engine.has_work:
        engine.step()
        steps += 1
    forwards = len(synced)
    assert forwards >= steps and all(d == target.device for d in synced)
    with engine.verify_timer(PROMPTS[1]) as seconds:
        seconds(2)
    assert len(synced) == forwards + 1


def test_long_drafts_are_priced_with_the_step_costs_the_controllers_share():
    model = varied_model(0, dtype=torch.bfloat16)
    engine = BatchEngine(model, new_drafter=NgramDrafter, spec=SpeculativeConfig(gamma="adaptive"), max_len=96,
                         scheduler=SchedulerConfig(max_running=2))
    seq = engine.submit(list(range(20, 40)), max_new_tokens=4, eos_token_ids=())
    engine.step()
    assert isinstance(seq.controller, LongDrafts)
    assert seq.controller.costs is engine.admission.new_controller.shared.costs  # the batch's step, priced
