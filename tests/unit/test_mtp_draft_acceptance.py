"""#67: the draft's expected acceptance (``engines/hf/draft.py`` :func:`acceptance`): one minus the
total variation distance between the target's and the draft's distributions, what speculative
sampling accepts on average, on hand-made distributions and against rejection sampling itself; and
the HF engine's ``draft_acceptance`` over sequences, each drafted position checked against an
incremental decode (the draft and the model fed the sequence up to that position only)."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.engines.hf.draft import acceptance


def test_identical_distributions_accept_every_draft():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    expected, greedy = acceptance(logits, logits.clone())
    assert torch.allclose(expected, torch.ones(3, 5), atol=1e-6) and expected.max() <= 1.0
    assert greedy.eq(1.0).all()


def test_disjoint_supports_accept_none():
    inf = float("inf")
    target = torch.tensor([[0.0, 1.0, -inf, -inf]])
    draft = torch.tensor([[-inf, -inf, 2.0, 0.0]])
    expected, greedy = acceptance(target, draft)
    assert expected.tolist() == [0.0] and greedy.tolist() == [0.0]


def test_a_mixed_case_is_the_sum_of_the_minima_and_what_rejection_sampling_accepts():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    expected, greedy = acceptance(p.log(), q.log())
    assert expected.item() == pytest.approx(0.2 + 0.3 + 0.2, abs=1e-6) and greedy.item() == 0.0
    assert acceptance((p * 7).log(), q.log())[0].item() == pytest.approx(0.7, abs=1e-6)  # logits, not probabilities
    # speculative sampling: draft x ~ q, accept it with probability min(1, p(x) / q(x))
    g = torch.Generator().manual_seed(1)
    x = torch.multinomial(q, 200_000, replacement=True, generator=g)
    accepted = torch.rand(x.shape, generator=g) < (p[x] / q[x]).clamp(max=1.0)
    assert accepted.float().mean().item() == pytest.approx(expected.item(), abs=0.005)


@pytest.fixture(scope="module")
def engine():
    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage

    torch.manual_seed(0)
    storage = HFStorage.from_config(hf_config("deepseek-v3", num_nextn_predict_layers=1), draft=True)
    storage.draft.apply(storage.model._init_weights)  # allocated, not initialised: a refit fills them
    with torch.no_grad():
        storage.model.lm_head.weight.mul_(30.0)  # sharper distributions: acceptance differs by position
    storage.set_state("ready", 4)
    return storage


def _by_hand(storage, sequence: list[int], start: int) -> tuple[list[float], list[float]]:
    """Each drafted position as a decoder reaches it: the model and its draft fed the tokens
    before it only."""
    model = storage.model
    expected, greedy = [], []
    for j in range(start, len(sequence)):
        tokens = torch.tensor([sequence[:j]])
        hidden = model.model(tokens).last_hidden_state
        target = model.lm_head(hidden)[:, -1]  # the model's distribution for token j
        proposal = storage.draft.logits(model, tokens, hidden)[:, -1]  # from hidden j - 2 and token j - 1
        each, agree = acceptance(target, proposal)
        expected.append(each.item())
        greedy.append(agree.item())
    return expected, greedy


def test_the_engine_averages_each_drafted_position_as_a_decoder_meets_it(engine):
    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (8, 8, 6)]  # two lengths: two forwards
    out = engine.draft_acceptance(sequences, start=3)
    expected, greedy = [], []
    for sequence in sequences:
        e, a = _by_hand(engine, sequence, 3)
        expected += e
        greedy += a
    assert out["positions"] == len(expected) == 5 + 5 + 3 and out["version"] == 4
    assert out["expected"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert out["greedy"] == pytest.approx(sum(greedy) / len(greedy), abs=1e-9)
    assert 0.0 < out["expected"] < 1.0 and len({round(e, 4) for e in expected}) > 1  # not one value everywhere
    # a tensor of sequences is read the same way
    tensor = torch.tensor(sequences[:2])
    assert engine.draft_acceptance(tensor, start=3)["positions"] == 10


def test_the_engine_refuses_without_a_draft_or_with_positions_it_cannot_draft(engine):
    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage

    plain = HFStorage.from_config(hf_config("deepseek-v3", num_nextn_predict_layers=1))
    plain.set_state("ready", 1)
    with pytest.raises(RuntimeError, match=r"draft_acceptance needs the engine's speculative draft, and this engine "
                                           r"holds none"):
        plain.draft_acceptance([[1, 2, 3, 4]], start=2)
    with pytest.raises(ValueError, match=r"the draft proposes tokens from position 2 on, and start=1 must be"):
        engine.draft_acceptance([[1, 2, 3, 4]], start=1)
    with pytest.raises(ValueError, match=r"start=4 must be a position of every sequence, one at least \(lengths "
                                         r"\[4, 6\]\)"):
        engine.draft_acceptance([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4]], start=4)
    with pytest.raises(ValueError, match=r"one at least \(lengths \[\]\)"):
        engine.draft_acceptance([], start=2)
