"""Head training on a tiny model: the loss falls, a trained head drafts what the target says (so the
targets are aligned with drafting), and a resumed run ends with the same weights as an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from specdecode.drafters import EagleDrafter, MedusaDrafter
from specdecode.engine import Engine, SpeculativeConfig
from specdecode.heads.data import DISTILLED, Features, answer_batch, target_features
from specdecode.heads.train import TrainConfig, Trainer, batches, split
from specdecode.heads.vocab import VocabHead, draft_ids, frequency_ranking
from specdecode.kv.cache import CacheConfig
from tiny_models import varied_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[3, 7, 11, 5], [20, 4, 9], [33, 2, 40, 41, 8], [60, 61], [12, 13, 14, 15, 16, 17]]
FUSED = (1, 2, 4)  # an EAGLE-3 head's layers of the 4-layer target


@pytest.fixture(scope="module")
def target():
    return varied_model(0)


@pytest.fixture(scope="module")
def data(target) -> Features:
    """The target's greedy answers to PROMPTS, with its features (the normed final state, and the FUSED layers)
    and guesses, as ``build_features`` stores them."""
    answers = answer_batch(target, PROMPTS, 24, frozenset())
    seqs = [p + a for p, a in zip(PROMPTS, answers)]
    parts = [target_features(target, s, FUSED) for s in seqs]
    lengths = torch.tensor([len(s) for s in seqs])
    return Features(tokens=torch.tensor([t for s in seqs for t in s]), labels=torch.cat([p[0] for p in parts]),
                    features=torch.cat([p[1] for p in parts]),
                    offsets=torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))),
                    kinds=torch.full((len(seqs),), DISTILLED), answer_starts=torch.tensor(list(map(len, PROMPTS))),
                    layers=torch.cat([p[2] for p in parts]), layer_ids=torch.tensor(FUSED))


def test_answer_batch_matches_decoding_each_prompt_alone(target):
    answers = answer_batch(target, PROMPTS[:3], 10, frozenset())
    for prompt, answer in zip(PROMPTS[:3], answers):
        assert Engine(target).generate(prompt, max_new_tokens=10, eos_token_ids=()).token_ids == answer
    sampled = answer_batch(target, PROMPTS[:3], 10, frozenset(), temperature=1.0, seed=3)
    assert sampled == answer_batch(target, PROMPTS[:3], 10, frozenset(), temperature=1.0, seed=3) != answers


def test_labels_are_the_targets_next_token_guesses(target, data):
    """In an answer, the target's guess at position j is the answer's token j + 1 (greedy self-distillation)."""
    tokens, labels, _ = data.sequence(0)
    start = len(PROMPTS[0])
    assert torch.equal(labels[start - 1:-1], tokens[start:])


def _trained(target, data, kind, epochs, **overrides) -> Trainer:
    config = TrainConfig(kind=kind, epochs=epochs, lr=3e-3, batch_tokens=64, draft_vocab=0, held_out=0.2,
                         eval_sequences=1, warmup=5, **overrides)
    trainer = Trainer(target, data, config)
    trainer.train_seqs = list(range(len(data)))  # memorise every sequence (the tests draft on them)
    while trainer.epoch < epochs:
        trainer.train_epoch()
    return trainer


EAGLE3 = dict(fuse_layers=FUSED, soft_labels=True, regress=0.0, ce_weight=1.0)


def test_features_of_fused_layers_are_the_targets_layer_outputs(target, data):
    """The cached layers are what the target's forward hands a drafter, and the normed final state is the
    last of them."""
    tokens, _, normed = data.sequence(2)
    fused = data.fused(2, FUSED)
    again = target(tokens[None], target.new_cache(CacheConfig(max_len=64)), features=FUSED).features
    assert torch.equal(fused, again[0].to(fused.dtype))
    assert torch.equal(fused[:, -normed.shape[1]:], normed)
    with pytest.raises(ValueError, match=r"hold layers \[1, 2, 4\], the head reads layers \[0, 4\]"):
        data.fused(2, (0, 4))


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_a_few_steps_lower_the_loss(target, data, kind):
    trainer = _trained(target, data, "eagle", 0, **EAGLE3) if kind == "eagle3" else _trained(target, data, kind, 0)
    everything = list(range(len(data)))
    before = trainer.loss(everything, None)[0].item()
    for _ in range(15):
        trainer.train_epoch()
    after = trainer.loss(everything, None)[0].item()
    assert after < (0.7 if kind == "eagle" else 0.85) * before, (before, after)  # without gradients: equal


@pytest.mark.parametrize("recipe", ["eagle1", "eagle3"])
def test_a_trained_eagle_head_drafts_what_the_target_says(target, data, recipe):
    """Memorising the target's answers must make the engine accept the head's drafts: a head trained on
    targets one position off (or reading other layers than it is handed) would draft the wrong tokens."""
    trainer = _trained(target, data, "eagle", 60, **(EAGLE3 if recipe == "eagle3" else {}))
    head = trainer.head.eval().requires_grad_(False)
    drafter = EagleDrafter(target, head, VocabHead(target, trainer.vocab))
    engine = Engine(target, drafter=drafter, spec=SpeculativeConfig(gamma=4))
    plain = Engine(target)
    taus = []
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=24, eos_token_ids=())
        assert result.token_ids == plain.generate(prompt, max_new_tokens=24, eos_token_ids=()).token_ids
        taus.append(result.stats.mean_accepted_length)
    assert sum(taus) / len(taus) > 2.5, taus
    # soft labels spread the head's mass where the target hesitates; misaligned targets give ~1
    assert trainer.held_out_tau() > (2.5 if recipe == "eagle1" else 2.2)


def test_a_trained_medusa_head_drafts_what_the_target_says(target, data):
    trainer = _trained(target, data, "medusa", 60, medusa_heads=3)
    drafter = MedusaDrafter(target, trainer.head.eval().requires_grad_(False), VocabHead(target, trainer.vocab))
    engine = Engine(target, drafter=drafter, spec=SpeculativeConfig(gamma=3))
    result = engine.generate(PROMPTS[0], max_new_tokens=24, eos_token_ids=())
    assert result.token_ids == Engine(target).generate(PROMPTS[0], max_new_tokens=24, eos_token_ids=()).token_ids
    assert result.stats.mean_accepted_length > 1.8


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_resuming_from_a_checkpoint_gives_the_uninterrupted_weights(target, data, kind):
    extra = EAGLE3 if kind == "eagle3" else {}
    kind = kind.removesuffix("3")
    straight = _trained(target, data, kind, 3, **extra)
    first = _trained(target, data, kind, 1, **extra)
    state = first.state()
    config = first.config
    resumed = Trainer(target, data, TrainConfig(**{**config.__dict__, "epochs": 3}))
    resumed.train_seqs = first.train_seqs
    with pytest.raises(ValueError, match="other training settings"):
        resumed.load_state(state)  # epochs differ: a different run
    resumed = Trainer(target, data, config)
    resumed.train_seqs = first.train_seqs
    resumed.load_state(state)
    resumed.config = straight.config  # the same run, continued to 3 epochs
    resumed.total_steps = straight.total_steps
    while resumed.epoch < 3:
        resumed.train_epoch()
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values()):
        assert torch.equal(a, b), name


def test_batches_keep_sequences_whole_and_within_budget(data):
    seqs = list(range(len(data)))
    groups = batches(data, seqs, 64, seed=1)
    assert sorted(s for g in groups for s in g) == seqs
    for g in groups:
        longest = max(int(data.offsets[s + 1] - data.offsets[s]) for s in g)
        assert len(g) == 1 or longest * len(g) <= 64
    assert groups == batches(data, seqs, 64, seed=1) != batches(data, seqs, 64, seed=2)


def test_draft_vocabulary_is_the_most_frequent_tokens_with_the_forced_ids_first():
    counts = torch.tensor([5, 0, 9, 9, 1, 0])
    ranking = frequency_ranking(counts, always=[5])
    assert ranking.tolist() == [5, 2, 3, 0, 4, 1]  # forced, then by count, ties by id
    assert draft_ids(ranking, 3).tolist() == [2, 3, 5]  # sorted by id
    assert draft_ids(ranking, 0).tolist() == draft_ids(ranking, 99).tolist() == list(range(6))


def test_held_out_answers_share_no_prompt_with_training_answers(target):
    """Two answers per prompt: a prompt's answers are held out together or trained on together."""
    prompts = PROMPTS * 2
    answers = answer_batch(target, PROMPTS, 6, frozenset()) + answer_batch(target, PROMPTS, 6, frozenset(), 1.0, 7)
    seqs = [p + a for p, a in zip(prompts, answers)]
    lengths = torch.tensor([len(s) for s in seqs])
    data = Features(tokens=torch.tensor([t for s in seqs for t in s]), labels=torch.zeros(int(lengths.sum()), dtype=torch.int64),
                    features=torch.zeros(int(lengths.sum()), 4),
                    offsets=torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))),
                    kinds=torch.full((len(seqs),), DISTILLED), answer_starts=torch.tensor([len(p) for p in prompts]))
    train, held = split(data, 0.4, seed=0)
    assert held and sorted(train + held) == list(range(len(seqs)))
    held_prompts = {tuple(prompts[s]) for s in held}
    assert not held_prompts & {tuple(prompts[s]) for s in train}
    assert len(held) == 2 * len(held_prompts)


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_default(target, data):
    first = _trained(target, data, "eagle", 1)
    state = first.state()
    for name in ("regress", "soft_labels", "fuse_layers"):  # settings later than such a checkpoint
        del state["config"][name]
    resumed = Trainer(target, data, first.config)
    resumed.load_state(state)
    assert resumed.epoch == 1
    state["config"]["unroll"] = 3
    with pytest.raises(ValueError, match="other training settings"):
        resumed.load_state(state)
