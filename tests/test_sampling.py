"""Sampling with lookahead keeps the model's distribution exactly (chi-square tests with power)."""

import math
import random
from collections import Counter

import pytest
import torch
from tiny_models import tiny_model

from ladechat.engine.config import LookaheadConfig, SamplingConfig
from ladechat.engine.decode import Session, generate
from ladechat.engine.draft.store import AnswerStore
from ladechat.engine.layout import build_layout
from ladechat.engine.sampling import TokenPicker, inverse_cdf
from ladechat.engine.verify import batched_pick, verify

ALPHA_Z = 3.09  # one-sided z for significance 0.001: a correct rule fails about 1 run in 1000


def chi2_critical(dof: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at significance 0.001."""
    return dof * (1 - 2 / (9 * dof) + ALPHA_Z * math.sqrt(2 / (9 * dof))) ** 3


def chi2_two_samples(a: Counter, b: Counter) -> tuple[float, int]:
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 5]
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (a[k] - ea) ** 2 / ea + (b[k] - eb) ** 2 / eb
    return stat, max(1, len(keys) - 1)


def chi2_expected(observed: Counter, expected: dict) -> tuple[float, int]:
    n = sum(observed.values())
    keys = [k for k, p in expected.items() if p * n >= 5]
    stat = sum((observed[k] - expected[k] * n) ** 2 / (expected[k] * n) for k in keys)
    rest_obs = n - sum(observed[k] for k in keys)
    rest_exp = n - sum(expected[k] * n for k in keys)
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
    return stat, max(1, len(keys) - (0 if rest_exp >= 5 else 1))


# -- the verification rule itself, against the exact distribution ------------------------------
# A trie with candidates (1, 2) and (1, 3) and (4,), and fixed next-token distributions per row.
LAYOUT = build_layout([[0]], [((1, 2), "pool"), ((1, 3), "pool"), ((4,), "context")])
ROW = {tok: row for row, tok in enumerate(LAYOUT.tokens)}


def row_logits(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32).clamp_min(1e-30))


DISTS = {0: [0.0, 0.5, 0.1, 0.1, 0.3], ROW[1]: [0.2, 0.1, 0.4, 0.3, 0.0], ROW[4]: [0.1, 0.2, 0.3, 0.4, 0.0],
         ROW[2]: [0.25] * 4 + [0.0], ROW[3]: [0.25] * 4 + [0.0]}
LOGITS = {row: row_logits(p) for row, p in DISTS.items()}


def exact_first_two():
    out = {}
    for x0, p0 in enumerate(DISTS[0]):
        nxt = DISTS[ROW[x0]] if x0 in (1, 4) else None
        for x1 in range(5):
            if nxt is not None:
                out[(x0, x1)] = out.get((x0, x1), 0) + p0 * nxt[x1]
    return {k: v for k, v in out.items() if v > 0}


def sample_pairs(pick_factory, n=6000):
    pairs = Counter()
    for i in range(n):
        pick = pick_factory(i)
        accepted, _, _ = verify(LAYOUT, pick)
        if len(accepted) >= 2 and accepted[0] in (1, 4):
            pairs[tuple(accepted[:2])] += 1
        elif accepted[0] in (1, 4):
            pytest.fail("a matched candidate must yield a bonus token")
    return pairs


def test_verify_rule_matches_exact_distribution():
    picker = TokenPicker(SamplingConfig(temperature=1.0, seed=1))
    pairs = sample_pairs(lambda i: (lambda row, path: picker.pick(LOGITS[row], path)))
    exact = exact_first_two()
    total = sum(exact.values())
    stat, dof = chi2_expected(pairs, {k: v / total for k, v in exact.items()})
    assert stat < chi2_critical(dof), (stat, dof)


@pytest.mark.slow
def test_batched_verification_matches_exact_distribution():
    """The GPU path: every row the trie could visit penalized and sampled at once (one uniform
    draw per depth), then walked."""
    picker = TokenPicker(SamplingConfig(temperature=1.0, seed=3))
    logits = torch.stack([LOGITS.get(row, torch.zeros(5)) for row in range(LAYOUT.size)])
    pairs = sample_pairs(lambda i: batched_pick(LAYOUT, logits, picker, []))
    exact = exact_first_two()
    total = sum(exact.values())
    stat, dof = chi2_expected(pairs, {k: v / total for k, v in exact.items()})
    assert stat < chi2_critical(dof), (stat, dof)


@pytest.mark.parametrize("cfg", [dict(temperature=0.0, repetition_penalty=1.5),
                                 dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3)])
@pytest.mark.slow
def test_batched_rows_see_the_same_penalties_as_rows_one_at_a_time(cfg):
    """Each row's repetition penalty covers the history and its own path through the trie, as
    when rows are chosen one at a time: greedy picks are equal, sampled ones share a distribution."""
    torch.manual_seed(0)
    layout = build_layout([[7, 8], [9, 10]], [((3, 4, 5), "pool"), ((3, 6), "context"), ((11, 4), "pool")])
    logits = torch.randn(layout.size, 16) * 3
    history = [1, 2, 3, 12]
    one_at_a_time = TokenPicker(SamplingConfig(**cfg, seed=5))
    batched = TokenPicker(SamplingConfig(**cfg, seed=5))
    rows = [0, *range(layout.window_rows, layout.size)]
    paths = {0: []}
    for row in rows[1:]:
        paths[row] = paths[layout.parents[row]] + [layout.tokens[row]]
    if cfg["temperature"] == 0.0:
        chosen = batched_pick(layout, logits, batched, history)
        assert [chosen(r, paths[r]) for r in rows] == [one_at_a_time.pick(logits[r], history + paths[r]) for r in rows]
        return
    for row in rows:
        expected = one_at_a_time.probabilities(_penalized(logits[row], history + paths[row], 1.3))
        counts = Counter(batched_pick(layout, logits, batched, history)(row, paths[row]) for _ in range(3000))
        stat, dof = chi2_expected(counts, {tok: float(p) for tok, p in enumerate(expected) if p > 0})
        assert stat < chi2_critical(dof), (row, stat, dof)


def _penalized(scores, history, penalty):
    seen = torch.tensor(sorted(set(history)))
    scores = scores.clone()
    picked = scores[seen]
    scores[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores


def test_inverse_cdf_never_draws_a_filtered_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.3, 0.5, 0.0]])
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))  # the largest uniform draw
    assert inverse_cdf(probs, torch.stack([below_one, below_one])).tolist() == [2, 3]
    assert inverse_cdf(probs, torch.zeros(2)).tolist() == [1, 0]
    assert inverse_cdf(probs, torch.tensor([0.49, 0.25])).tolist() == [1, 2]


def test_wrong_rule_is_detected():
    """Accepting a draft whenever the model allows it (instead of sampling) must fail the test."""
    picker = TokenPicker(SamplingConfig(temperature=1.0, seed=2))

    def greedy_for_drafts(row, path):
        children = LAYOUT.children[row]
        allowed = [tok for tok in children if DISTS[row][tok] > 0]
        return allowed[0] if allowed else picker.pick(LOGITS[row], path)

    pairs = sample_pairs(lambda i: greedy_for_drafts)
    exact = exact_first_two()
    total = sum(exact.values())
    stat, dof = chi2_expected(pairs, {k: v / total for k, v in exact.items()})
    assert stat > chi2_critical(dof)


# -- end to end on a tiny model: lookahead sampling vs plain sampling ---------------------------
def draw(model, prompt, la, cfg, n):
    seqs = Counter()
    session = Session(model, la, store=AnswerStore())  # the store fills with the samples drawn
    for i in range(n):
        session.reset()
        sampling = SamplingConfig(**{**cfg, "seed": 10_000 + i, "max_new_tokens": 2})
        events = list(generate(session, prompt, sampling, frozenset()))
        seqs[tuple(events[-1].text_tokens)] += 1
    return seqs


SETTINGS = [
    ({"temperature": 1.0, "top_k": 3}, dict(window=3, ngram=3, candidates=3)),
    ({"temperature": 0.7, "top_p": 0.8, "top_k": 4}, dict(window=2, ngram=4, candidates=2)),
    ({"temperature": 1.2, "top_k": 3, "repetition_penalty": 1.3}, dict(window=4, ngram=2, candidates=4)),
    ({"temperature": 1.0, "top_k": 5, "min_p": 0.1}, dict(window=1, ngram=3, candidates=5)),
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg,la", SETTINGS)
def test_lookahead_sampling_matches_plain_sampling(cfg, la):
    model = tiny_model("llama", seed=3)
    rng = random.Random(5)
    motif = [rng.randrange(96) for _ in range(3)]
    prompt = motif * 6  # repetitive: the first step has candidates to verify
    n = 800
    ours = draw(model, prompt, LookaheadConfig(**la), cfg, n)
    plain = draw(model, prompt, LookaheadConfig(enabled=False), cfg, n)
    stat, dof = chi2_two_samples(ours, plain)
    assert stat < chi2_critical(dof), (stat, dof, ours.most_common(5), plain.most_common(5))


def test_same_seed_same_output_and_zero_temperature_is_greedy():
    model = tiny_model("qwen2", seed=4)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    la = LookaheadConfig(window=3, ngram=3, candidates=3)

    def run(cfg):
        return list(generate(Session(model, la), prompt, cfg, frozenset()))[-1].text_tokens

    sampled = SamplingConfig(temperature=0.9, top_k=20, seed=123, max_new_tokens=30)
    assert run(sampled) == run(sampled)
    greedy = run(SamplingConfig(max_new_tokens=30))
    assert run(SamplingConfig(temperature=1e-4, seed=1, max_new_tokens=30)) == greedy
    assert run(SamplingConfig(temperature=0.0, seed=7, max_new_tokens=30)) == greedy
