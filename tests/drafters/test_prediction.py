"""The prediction drafter (``drafters/prediction.py``) and requests that carry a prediction: it follows the
prediction, finds its place again after an edit (by tokens, and by text where token boundaries differ),
hands over to the engine's drafter where the prediction has nothing, and never changes the output: greedy
tokens are plain decoding's alone and batched under every cache setting, sampled ones follow the target's
distribution."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batch_cases import CACHE_SETTINGS, requests
from copied_text import copied_tokens
from distribution_check import (ALPHA, NEW_TOKENS, PROMPT, SAMPLES, SETTINGS, VOCAB, chi_square_p_value, exact_joint,
                                next_probs, small_vocab_target)
from specdecode.batch.executor import BatchEngine
from specdecode.batch.scheduler import SchedulerConfig
from specdecode.batch.sequence import predicted
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.prediction import Prediction, PredictionDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.models.tokenizer import Tokenizer
from specdecode.sampling import SamplingParams
from tiny_models import varied_model

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams()


def _ids(ids) -> Prediction:
    return predicted(list(ids), None, 1000)


def _drafter(prediction: Prediction, prompt: list[int], fallback=None, tokenizer=None) -> PredictionDrafter:
    drafter = PredictionDrafter(prediction, fallback, tokenizer)
    drafter.reset(None, prompt)
    return drafter


def _propose(drafter: PredictionDrafter, seq: list[int], k: int) -> list[int]:
    return drafter.propose(seq, k, GREEDY, torch.Generator()).tokens


@pytest.fixture(scope="module")
def tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def test_follows_the_prediction_and_counts_what_was_kept():
    prompt, pred = [1, 2], list(range(100, 130))
    drafter = _drafter(_ids(pred), prompt)
    assert drafter.long_run() == 30 and _propose(drafter, prompt, 5) == pred[:5]
    seq = prompt + pred[:3] + [7]  # three accepted, then the target said 7: the output departs
    drafter.commit(seq)
    assert (drafter.drafted, drafter.accepted) == (5, 3)
    assert drafter.long_run() == 0 and _propose(drafter, seq, 5) == []  # lost: no fallback, nothing to draft


def test_finds_its_place_again_by_tokens_after_an_edit():
    prompt, pred = [1, 2], list(range(100, 140))
    drafter = _drafter(_ids(pred), prompt)
    seq = prompt + pred[:10] + [7, 8] + pred[13:16]  # tokens 10..12 replaced by 7, 8; then three of the original
    drafter.commit(seq)
    assert _propose(drafter, seq, 6) == pred[16:22] and drafter.long_run() == len(pred) - 16


def test_two_tokens_find_the_place_only_near_where_the_output_left_it():
    """Short tails match unrelated text too often: far from where the output left the prediction, MIN_TAIL
    tokens are needed; within NEAR of it (an edit is usually short), two."""
    prompt, pred = [1, 2], list(range(100, 200))
    drafter = _drafter(_ids(pred), prompt)
    drafter.commit(prompt + [7, 8, 170, 171])  # a prediction given as ids: a token's "end" is its index + 1
    assert drafter.long_run() == 0
    drafter = _drafter(_ids(pred), prompt)
    drafter.commit(prompt + pred[:10])
    seq = prompt + pred[:10] + [7] + pred[12:14]  # tokens 10 and 11 replaced by 7
    drafter.commit(seq)
    assert _propose(drafter, seq, 3) == pred[14:17]


def test_a_word_finds_the_place_near_where_the_output_left_it(tokenizer):
    text = "We harvested more then two hundred kilograms of vegetables this summer."
    prediction = Prediction.of(text, tokenizer)
    drafter = _drafter(prediction, [1], tokenizer=tokenizer)
    followed = tokenizer.encode("We harvested more")
    assert list(prediction.ids[:len(followed)]) == followed
    drafter.commit([1] + followed)
    seq = [1] + followed + tokenizer.encode(" than two")  # the typo fixed, then one word of the prediction
    drafter.commit(seq)
    assert tokenizer.decode(_propose(drafter, seq, 64)) == " hundred kilograms of vegetables this summer."


def test_a_long_draft_kept_in_part_moves_the_place_before_it_is_found_again():
    """The common case of long drafts: 10 of 20 kept, then an edit; the place is searched from there on."""
    prompt, pred = [1], list(range(100, 160))
    drafter = _drafter(_ids(pred), prompt)
    assert _propose(drafter, prompt, 20) == pred[:20]
    drafter.commit(prompt + pred[:10] + [7])  # ten kept, then the target said 7
    assert drafter.accepted == 10
    seq = prompt + pred[:10] + [7] + pred[12:14]  # the edit replaced tokens 10 and 11
    drafter.commit(seq)
    assert _propose(drafter, seq, 3) == pred[14:17]


def test_the_place_is_never_found_again_behind_where_the_output_got():
    block = [50, 51, 52]
    pred = block + list(range(60, 70)) + [80]
    drafter = _drafter(_ids(pred), [1])
    drafter.commit([1] + pred)  # followed to the end
    seq = [1] + pred + [9] + block  # the block again: it is behind the place, so not drafted from
    drafter.commit(seq)
    assert drafter.long_run() == 0 and _propose(drafter, seq, 4) == []


def test_without_a_place_the_fallbacks_long_run_counts():
    class Long(NgramDrafter):
        def long_run(self) -> int:
            return 5
    drafter = _drafter(_ids(range(100, 110)), [1], fallback=Long())
    assert drafter.long_run() == 10  # the prediction's own
    drafter.commit([1, 3, 4, 5, 6])  # departs; nothing found
    assert drafter.long_run() == 5


def test_prefers_the_occurrence_after_the_current_place():
    block = [50, 51, 52, 53]
    pred = [10] + block + [60, 61] + block + [70, 71]
    drafter = _drafter(_ids(pred), [1])
    drafter.commit([1] + pred[:7])  # followed through 61
    seq = [1] + pred[:7] + [9] + block  # then an edit, then the block again
    drafter.commit(seq)
    assert _propose(drafter, seq, 2) == [70, 71]


def test_hands_over_to_its_fallback_where_the_prediction_has_nothing():
    prompt = [5, 6, 7, 8, 5, 6]
    drafter = _drafter(_ids(range(100, 110)), prompt, fallback=NgramDrafter())
    drafter.commit(prompt + [3])  # departs at once
    assert drafter.long_run() == 0
    seq = prompt + [3, 5, 6]
    drafter.commit(seq)
    assert _propose(drafter, seq, 3) == NgramDrafter().propose(seq, 3, GREEDY, torch.Generator()).tokens == [3, 5, 6]
    assert drafter.name == "ngram" and drafter.signal_names == NgramDrafter.signal_names


def test_finds_its_place_by_text_where_token_boundaries_differ(tokenizer):
    text = "The quarterly report shows revenue of 4.2 million, up from 3.9 million last year."
    drafter = _drafter(Prediction.of(text, tokenizer), [1], tokenizer=tokenizer)
    # The output stops inside a word ("mil" of "million"): no tail of its tokens is a run of the prediction's.
    output = tokenizer.encode("Note: the quarterly report shows revenue of 4.2 mil")
    assert not any(output[-3:] == list(drafter.prediction.ids[i:i + 3]) for i in range(len(drafter.prediction.ids)))
    seq = [1] + output
    drafter.commit(seq)
    draft = _propose(drafter, seq, 64)
    assert draft and tokenizer.decode(draft) == "lion, up from 3.9 million last year."


def test_an_unrelated_prediction_is_dropped_and_not_found_again(tokenizer):
    text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor."
    drafter = _drafter(Prediction.of(text, tokenizer), [1], tokenizer=tokenizer)
    seq = [1]
    for word in tokenizer.encode("The meeting moved to Thursday at noon in the main hall, as agreed."):
        seq = seq + [word]
        drafter.commit(seq)
        assert drafter.long_run() == 0


def test_prediction_ids_are_checked():
    with pytest.raises(ValueError, match="prediction token ids must be in 0..999"):
        predicted([5, 1000], None, 1000)
    with pytest.raises(ValueError, match="a text prediction needs an engine with a tokenizer"):
        predicted("text", None, 1000)
    assert predicted("", None, 1000) is None and predicted([], None, 1000) is None


# ---------------------------------------------------------------------------------------------- in the engine

@pytest.fixture(scope="module")
def target():
    return varied_model(0)


def _edited(tokens: list[int]) -> list[int]:
    """Plain decoding's output with a few tokens changed and one dropped: what an edit's original looks like."""
    out = list(tokens)
    for i in range(3, len(out), 9):
        out[i] = (out[i] + 1) % 90
    return out[:5] + out[6:]


@pytest.mark.parametrize("setting", CACHE_SETTINGS)
@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_greedy_tokens_are_plain_decodings_with_any_prediction(target, setting, drafter):
    cache = CACHE_SETTINGS[setting]
    plain = [Engine(target, cache=cache).generate(**r).token_ids for r in requests()]
    new_drafter = (lambda: NgramDrafter()) if drafter == "ngram" else None
    kinds = [lambda p: p, _edited, lambda p: [(t * 7 + 3) % 90 for t in p]]  # exact, edited, unrelated
    cases = [dict(r, prediction=kinds[i % 3](p)) for i, (r, p) in enumerate(zip(requests(), plain))]
    solo = Engine(target, drafter=new_drafter() if new_drafter else None, spec=SpeculativeConfig(gamma=4), cache=cache)
    alone = [solo.generate(**c) for c in cases]
    assert [r.token_ids for r in alone] == plain, (setting, drafter, "alone")
    engine = BatchEngine(target, new_drafter=new_drafter, spec=SpeculativeConfig(gamma=4), cache=cache,
                         scheduler=SchedulerConfig(max_running=3), max_len=160)
    for _ in range(2):
        batched = engine.run(cases)
        assert [r.token_ids for r in batched] == plain, (setting, drafter, "batched")
    for results in (alone, batched):
        exact = [r.stats for i, r in enumerate(results) if i % 3 == 0]
        assert sum(s.prediction_accepted for s in exact) > 0.8 * sum(s.prediction_drafted for s in exact)
        assert all(r.stats.prediction_accepted <= r.stats.prediction_drafted for r in results)
    if setting == "auto":  # (compressed caches bound a step by their next compression)
        # Alone, an exact prediction is drafted past gamma (4): its drafts double while all of each is kept.
        assert max(len(r.stats.drafted_by_position) for r in alone) > 8
    assert engine.scheduler.slots.free == 3


def test_sampled_tokens_follow_the_targets_distribution_with_a_prediction():
    """A prediction of likely tokens, SAMPLES seeds batched 8 at a time: drafts are kept and rejected, and the
    first three tokens still follow the target's exact joint distribution."""
    target, sampling = small_vocab_target(), SETTINGS[0]
    first = int(next_probs(target, [PROMPT], sampling)[0].argmax())
    second = int(next_probs(target, [PROMPT + [first]], sampling)[0].argmax())
    engine = BatchEngine(target, spec=SpeculativeConfig(gamma=0),
                         scheduler=SchedulerConfig(max_running=8, max_waiting=SAMPLES), max_len=64)
    results = engine.run([dict(prompt=PROMPT, sampling=replace(sampling, seed=seed), max_new_tokens=NEW_TOKENS,
                               eos_token_ids=(), prediction=[first, second, 5, 9]) for seed in range(SAMPLES)])
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for r in results:
        counts[tuple(r.token_ids)] += 1
    p_value = chi_square_p_value(counts, exact_joint(target, sampling))
    assert p_value > ALPHA, f"chi-square p = {p_value:.2e}"
    drafted = sum(r.stats.prediction_drafted for r in results)
    accepted = sum(r.stats.prediction_accepted for r in results)
    assert drafted >= 100 and 0 < accepted < drafted, (drafted, accepted)


def test_an_edit_with_its_original_as_the_prediction_on_smollm2(smollm2):
    """Real text: the output is plain decoding's, and at least half of what it copies from the original came from
    the prediction (how much it copies depends on the kernel path: ``copied_text.py``)."""
    model, tok = smollm2.model, smollm2.tokenizer
    original = ("def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
                "    return total / len(values)"
                "\n\n\ndef largest(numbers):\n    best = numbers[0]\n    for n in numbers:\n        if n > best:\n"
                "            best = n\n    return best\n")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": (
        "Rename the variable `total` to `acc` in this Python code. Return only the whole updated code, no "
        f"explanation.\n\n```python\n{original}```")}]))
    engine = Engine(model, tok, NgramDrafter())
    plain = Engine(model, tok).generate(prompt, max_new_tokens=60)
    with_prediction = engine.generate(prompt, max_new_tokens=60, prediction=original)
    unrelated = engine.generate(prompt, max_new_tokens=60, prediction="The weather in Lisbon is mild in May. " * 5)
    assert with_prediction.token_ids == plain.token_ids == unrelated.token_ids
    copied = copied_tokens(plain.token_ids, tok.encode(original))
    assert copied >= 6, tok.decode(plain.token_ids)  # the answer follows the original somewhere
    stats = with_prediction.stats
    assert stats.prediction_accepted >= copied // 2, (copied, stats)
    assert stats.target_forwards <= len(plain.token_ids) - stats.prediction_accepted + 1, stats
