"""CPU tests for gemma4serve/engine/sampler.py: semantics against plain references, and
statistical losslessness."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from gemma4serve.engine.random_streams import uniform
from gemma4serve.engine.sampler import SamplingBatch, accept, choose, process_logits
from gemma4serve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def batch(params, seeds=None, outputs=None, prompts=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else list(range(n)),
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
    )


def run_accept(logits, drafts, params, num_drafts=None, first_position=None, **kw):
    """accept() with Python-list conveniences; logits [B, K+1, V]."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    B, K1, _ = logits.shape
    drafts = torch.as_tensor(drafts, dtype=torch.int64).view(B, K1 - 1)
    num_drafts = torch.as_tensor(
        num_drafts if num_drafts is not None else [K1 - 1] * B, dtype=torch.int64
    )
    first_position = torch.as_tensor(
        first_position if first_position is not None else [10] * B, dtype=torch.int64
    )
    return accept(logits, drafts, num_drafts, first_position, batch(params, **kw))


# --------------------------------------------------------------------------------------------------
# Plain references (float64, per-row Python), written straight from the definitions
# --------------------------------------------------------------------------------------------------


def ref_logits(logits, p: SamplingParams, output=(), prompt=()) -> np.ndarray:
    """Processed logits in HF order: penalties, temperature, top-k, top-p, min-p."""
    x = np.array(logits, dtype=np.float64)
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.temperature == 0:
        return x
    x /= p.temperature
    if p.top_k > 0:
        kth = np.sort(x)[::-1][min(p.top_k, len(x)) - 1]
        x[x < kth] = NEG_INF
    if p.top_p < 1:
        # Drop a token when the tokens strictly above it already hold top_p of the mass.
        probs = softmax(x)
        x[[probs[x > x[i]].sum() >= p.top_p for i in range(len(x))]] = NEG_INF
    if p.min_p > 0:
        probs = softmax(x)
        x[probs < p.min_p * probs.max()] = NEG_INF
    return x


def softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


# --------------------------------------------------------------------------------------------------
# Counter-based randomness
# --------------------------------------------------------------------------------------------------


def test_uniform_is_uniform_and_in_open_interval():
    n, cols = 4000, 64
    u = uniform(torch.arange(n) * 7919 - 5, torch.full((n,), 123), 0, cols)
    assert u.shape == (n, cols) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    counts = torch.histc(u, bins=64, min=0, max=1).numpy()
    assert stats.chisquare(counts).pvalue > 1e-3
    # Neighbouring columns, rows and streams must look independent.
    for a, b in [(u[:, :-1], u[:, 1:]), (u[:-1], u[1:])]:
        assert abs(np.corrcoef(a.flatten(), b.flatten())[0, 1]) < 0.01
    u1 = uniform(torch.arange(n) * 7919 - 5, torch.full((n,), 123), 1, cols)
    assert abs(np.corrcoef(u.flatten(), u1.flatten())[0, 1]) < 0.01


def test_uniform_is_a_pure_function_of_its_key():
    seed = torch.tensor([5, -1, 2**62, 5])
    pos = torch.tensor([0, 7, 7, 1])
    u = uniform(seed, pos, 3, 16)
    # Same key -> same values, whatever the batch around it; a column subset picks the same values.
    assert torch.equal(uniform(seed[[2]], pos[[2]], 3, 16), u[[2]])
    assert torch.equal(uniform(seed, pos, 3, torch.tensor([15, 0])), u[:, [15, 0]])
    # Seed high bits, position and stream all matter.
    assert not torch.equal(u[0], u[3])
    assert not torch.equal(uniform(seed + (1 << 40), pos, 3, 16), u)
    assert not torch.equal(uniform(seed, pos, 4, 16), u)


# --------------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------------

G = SamplingParams(temperature=0.0)


def test_greedy_ties_pick_lowest_id():
    out = run_accept([[[0.0, 3.0, 3.0, 1.0]], [[5.0, 5.0, 5.0, 5.0]]], [[], []], [G, G])
    assert out.tokens.tolist() == [[1], [0]]
    assert out.num_emitted.tolist() == [1, 1]
    # Also inside a mixed batch (the greedy row must not take the sampled path).
    out = run_accept(
        [[[0.0, 3.0, 3.0, 1.0]], [[0.0, 3.0, 3.0, 1.0]]], [[], []], [G, SamplingParams()]
    )
    assert out.tokens[0].tolist() == [1]


def onehot_rows(argmaxes, V=6):
    """[K+1, V] logits whose row j has its maximum at argmaxes[j]."""
    x = torch.zeros(len(argmaxes), V)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 4.0
    return x


@pytest.mark.parametrize(
    "drafts, num_drafts, expected",
    [
        ([1, 2, 3], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 5], 3, [1, 2, 3, -1]),  # third rejected: correction s_2
        ([0, 2, 3], 3, [1, -1, -1, -1]),  # first rejected
        ([1, 2, 3], 2, [1, 2, 3, -1]),  # d3 matches but is padding: s_2 is the bonus
        ([1, 2, -1], 2, [1, 2, 3, -1]),
        ([1, -1, -1], 1, [1, 2, -1, -1]),
        ([-1, -1, -1], 0, [1, -1, -1, -1]),  # no drafts
    ],
)
def test_greedy_acceptance(drafts, num_drafts, expected):
    logits = onehot_rows([1, 2, 3, 4])[None]
    out = run_accept(logits, [drafts], [G], num_drafts=[num_drafts])
    assert out.tokens[0].tolist() == expected
    assert out.num_emitted.tolist() == [sum(t >= 0 for t in expected)]


def test_padding_rows_are_ignored_even_if_garbage():
    logits = onehot_rows([1, 2, 3, 4])[None].repeat(2, 1, 1)
    logits[0, 2:] = float("nan")
    params = [G, SamplingParams(temperature=0.5, top_p=0.9, repetition_penalty=1.2)]
    out = run_accept(logits, [[1, 2, 3], [1, 2, 3]], params, num_drafts=[1, 3])
    assert out.tokens[0].tolist() == [1, 2, -1, -1]


def test_greedy_uses_penalised_logits_with_drafts_in_history():
    logits = torch.tensor([[[0.0, 2.0, 1.5], [0.0, 2.0, 1.5]]])
    # Row 1's history holds d1 = 1 (not yet in output_tokens): 2 - 2 = 0 < 1.5, so it picks 2.
    out = run_accept(logits, [[1]], [SamplingParams(temperature=0.0, frequency_penalty=2.0)])
    assert out.tokens[0].tolist() == [1, 2]
    # Repetition counts the prompt: 2 / 2 = 1 < 1.5 already at row 0, so d1 = 1 is rejected.
    out = run_accept(
        logits, [[1]], [SamplingParams(temperature=0.0, repetition_penalty=2.0)], prompts=[[1]]
    )
    assert out.tokens[0].tolist() == [2, -1]


# --------------------------------------------------------------------------------------------------
# Processing semantics
# --------------------------------------------------------------------------------------------------


def process(logits, p, output=(), prompt=(), extra=()):
    logits = torch.tensor([logits], dtype=torch.float32)
    sampling = batch([p], outputs=[list(output)], prompts=[list(prompt)])
    extra = torch.tensor([list(extra)], dtype=torch.int64).view(1, len(extra))
    return process_logits(logits, sampling, torch.zeros(1, dtype=torch.int64), extra)[0]


def kept(x):
    return torch.isfinite(x).nonzero().flatten().tolist()


def test_penalties_by_hand():
    p = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    x = process([2.0, -1.0, 0.5, 3.0], p, output=[0, 3], prompt=[1], extra=[0])
    # 0: seen, positive -> 1.0, count 2 -> 1.0 - 1.0 - 0.25; 1: prompt only, negative -> -2;
    # 2: untouched; 3: 1.5 - 0.5 - 0.25.
    assert torch.allclose(x, torch.tensor([-0.25, -2.0, 0.5, 0.75]))


def test_truncation_by_hand():
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = np.log(probs).tolist()
    assert kept(process([2.0, 1.0, 1.0, 0.0], SamplingParams(top_k=2))) == [
        0,
        1,
        2,
    ]  # ties at the k-th kept
    assert kept(process(logits, SamplingParams(top_k=1))) == [0]
    assert kept(process(logits, SamplingParams(top_p=0.45))) == [0]
    assert kept(process(logits, SamplingParams(top_p=0.55))) == [0, 1]
    assert kept(process(logits, SamplingParams(top_p=0.9))) == [0, 1, 2]
    assert kept(process(logits, SamplingParams(top_p=1.0))) == [0, 1, 2, 3]
    assert kept(process(logits, SamplingParams(min_p=0.25))) == [0, 1, 2]
    assert kept(process(logits, SamplingParams(min_p=0.5))) == [0, 1]
    # top-p acts on the top-k-renormalised distribution: within {0, 1}, token 0 has 0.625 >= 0.6.
    assert kept(process(logits, SamplingParams(top_k=2, top_p=0.6))) == [0]
    # Ties at the top-p cut-off are kept together, whatever a sort would do with them.
    assert kept(process([1.0, 0.0, 1.0, -1.0], SamplingParams(top_p=0.3))) == [0, 2]
    # Ties with the k-th logit beyond the top-k window still count in top-p's normaliser:
    # p = [e^3, 4 x e^1] / Z -> 0.649 for token 0 (0.88 if only two of the ties were counted).
    ties = [3.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert kept(process(ties, SamplingParams(top_k=2, top_p=0.85))) == [0, 1, 2, 3, 4]
    assert kept(process(ties, SamplingParams(top_k=2, top_p=0.6))) == [0]
    x = process(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(x, torch.tensor(logits) / 0.5)
    # Greedy rows keep everything (only penalties apply).
    assert kept(
        process(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9))
    ) == [0, 1, 2, 3]


def test_partial_sort_window_leaves_other_rows_alone():
    """With top-k on every truncating row only the largest top_k logits are sorted; rows without
    top-k / top-p (temperature only, greedy) must still keep the whole vocabulary."""
    params = [
        SamplingParams(top_k=2),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=3, top_p=0.5, min_p=0.3),
        SamplingParams(temperature=0.0, top_k=1),
    ]
    logits = torch.tensor(np.random.default_rng(5).normal(0, 1, (4, 10)), dtype=torch.float32)
    sampling = batch(params)
    assert sampling.sort_width == 3
    got = process_logits(logits, sampling, torch.arange(4), torch.empty(4, 0, dtype=torch.long))
    for r, p in enumerate(params):
        want = ref_logits(logits[r].numpy(), p)
        assert kept(got[r]) == np.isfinite(want).nonzero()[0].tolist()
    assert batch([SamplingParams(top_k=2), SamplingParams(top_p=0.9)]).sort_width == -1
    assert batch([SamplingParams(), SamplingParams(temperature=0.0, top_p=0.9)]).sort_width == 0
    assert not batch([SamplingParams(), SamplingParams(temperature=0.0, min_p=0.9)]).any_truncation
    assert batch([SamplingParams(min_p=0.1)]).any_truncation


def random_params(rng, i):
    return SamplingParams(
        temperature=[0.0, 0.6, 1.0, 1.7][i % 4],
        top_k=int(rng.choice([0, 1, 3, 10])),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.05, 0.3])),
        presence_penalty=float(rng.choice([0.0, 0.7, -0.4])),
        frequency_penalty=float(rng.choice([0.0, 0.3, -1.1])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
    )


def test_process_logits_matches_reference_on_random_rows():
    rng = np.random.default_rng(0)
    R, V, J = 64, 24, 3
    params = [random_params(rng, i) for i in range(R)]
    outputs = [rng.integers(0, V, rng.integers(0, 9)).tolist() for _ in range(R)]
    prompts = [rng.integers(0, V, rng.integers(0, 6)).tolist() for _ in range(R)]
    extras = [rng.integers(0, V, rng.integers(0, J + 1)).tolist() for _ in range(R)]
    logits = torch.tensor(rng.normal(0, 2, (R, V)), dtype=torch.float32)
    sampling = batch(params, outputs=outputs, prompts=prompts)
    # Rows in a shuffled order, pointing back to their sequence.
    row_seq = torch.tensor(rng.permutation(R))
    extra = torch.tensor([extras[s] + [-1] * (J - len(extras[s])) for s in row_seq.tolist()])
    got = process_logits(logits[row_seq], sampling, row_seq, extra)
    for r, s in enumerate(row_seq.tolist()):
        want = ref_logits(logits[s].numpy(), params[s], outputs[s] + extras[s], prompts[s])
        assert kept(got[r]) == np.isfinite(want).nonzero()[0].tolist(), (s, params[s])
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[r].numpy()[fin], want[fin], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Reproducibility
# --------------------------------------------------------------------------------------------------


def test_seed_reproducible_across_batch_composition_and_order():
    rng = np.random.default_rng(1)
    V, K = 50, 2
    logits = torch.tensor(rng.normal(0, 1, (6, K + 1, V)), dtype=torch.float32)
    drafts = torch.tensor(rng.integers(0, V, (6, K)))
    params = [
        SamplingParams(temperature=1.0, top_k=[0, 20][i % 2], frequency_penalty=0.1 * i)
        for i in range(6)
    ]
    seeds = [11, 22, 33, 44, 55, 66]
    outputs = [rng.integers(0, V, i).tolist() for i in range(6)]
    pos = torch.arange(6) * 3 + 100

    def step(rows):
        sampling = batch(
            [params[i] for i in rows], [seeds[i] for i in rows], [outputs[i] for i in rows]
        )
        out = accept(logits[rows], drafts[rows], torch.full((len(rows),), K), pos[rows], sampling)
        return {i: out.tokens[n].tolist() for n, i in enumerate(rows)}

    a, b = step([0, 1, 2, 3]), step([3, 5, 0])
    assert a[0] == b[0] and a[3] == b[3]
    # Different seeds do give different draws (over many positions).
    logits1 = logits[:1, :1].expand(200, 1, V)
    sampling = batch([params[0]] * 200, [1] * 100 + [2] * 100)
    out = accept(
        logits1,
        torch.empty(200, 0, dtype=torch.long),
        torch.zeros(200, dtype=torch.long),
        torch.arange(200) % 100,
        sampling,
    )
    assert not torch.equal(out.tokens[:100], out.tokens[100:])


def test_speculation_does_not_change_seeded_output():
    """The Gumbel-max coupling: with or without drafts, a seed yields the same tokens (penalties
    included)."""
    rng = np.random.default_rng(2)
    V, N, K, P0 = 12, 24, 3, 5
    table = torch.tensor(
        rng.normal(0, 1.5, (P0 + N + 1, V)), dtype=torch.float32
    )  # a "model": logits by position
    p = SamplingParams(
        temperature=0.9, top_k=8, top_p=0.95, frequency_penalty=0.4, repetition_penalty=1.3
    )
    prompt, seed = [3, 3, 7, 1, 0], 1234

    def step(output, drafts):
        first = P0 + len(output) - 1  # position of the last committed token
        k = len(drafts)
        out = accept(
            table[first : first + k + 1][None],
            torch.tensor([drafts]),
            torch.tensor([k]),
            torch.tensor([first]),
            batch([p], [seed], [output], [prompt]),
        )
        return out.tokens[0, : out.num_emitted[0]].tolist()

    plain = []
    while len(plain) < N:
        plain += step(plain, [])
    spec, steps = [], 0
    while len(spec) < N:
        # Drafts: mostly right, sometimes wrong, so both acceptance and rejection paths run.
        truth = plain[len(spec) : len(spec) + K]
        drafts = [t if rng.random() < 0.7 else (t + 1) % V for t in truth]
        spec += step(spec, drafts)
        steps += 1
    assert spec[:N] == plain
    assert steps < N  # some drafts were accepted


# --------------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------------


def test_logprobs_are_raw():
    rng = np.random.default_rng(3)
    logits = torch.tensor(rng.normal(0, 1, (2, 3, 10)), dtype=torch.float32)
    params = [
        SamplingParams(temperature=0.5, top_k=2, logprobs=3, repetition_penalty=1.5),
        SamplingParams(logprobs=1),
    ]
    out = run_accept(logits, [[1, 2], [3, 4]], params, outputs=[[1, 5], []], prompts=[[2], []])
    raw = torch.log_softmax(logits, -1)
    assert out.top_ids.shape == (2, 3, 3) and out.top_logprobs.shape == (2, 3, 3)
    assert torch.allclose(out.logprobs[:, 0], raw[:, 0].gather(1, out.tokens[:, :1]).flatten())
    top = raw.topk(3, -1)
    assert torch.equal(out.top_ids, top.indices) and torch.allclose(out.top_logprobs, top.values)
    assert run_accept(logits, [[1, 2], [3, 4]], [SamplingParams()] * 2).logprobs is None
    zero = run_accept(logits, [[1, 2], [3, 4]], [SamplingParams(logprobs=0)] * 2)
    assert zero.top_ids.shape == (2, 3, 0) and zero.logprobs.shape == (2, 3)


# --------------------------------------------------------------------------------------------------
# Statistical losslessness
# --------------------------------------------------------------------------------------------------

V, K, N = 8, 2, 20000
TARGET = torch.tensor(np.random.default_rng(4).normal(0, 0.8, (K + 1, V)), dtype=torch.float32)
HISTORY, PROMPT = [2, 5], [1, 2]

SETTINGS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=1.3, top_k=3),
    "top_p": SamplingParams(top_p=0.8),
    "min_p_top_k": SamplingParams(temperature=1.1, top_k=5, min_p=0.15),
    "penalties": SamplingParams(
        temperature=0.9, frequency_penalty=0.8, repetition_penalty=1.5, presence_penalty=0.3
    ),
}


def target_probs(p: SamplingParams, drafts) -> list[np.ndarray]:
    """Plain-sampling distribution of row j, whose history ends with d_1..d_j."""
    return [
        softmax(ref_logits(TARGET[j].numpy(), p, HISTORY + list(drafts[:j]), PROMPT))
        for j in range(K + 1)
    ]


def pick_draft(probs, kind) -> int:
    """'likely': the argmax; 'unlikely': the least likely allowed token; 'masked': a filtered-out
    one if any."""
    if kind == "likely":
        return int(np.argmax(probs))
    pool = np.where(probs > 0)[0] if kind == "unlikely" else np.where(probs == 0)[0]
    pool = pool if len(pool) else np.arange(V)
    return int(pool[np.argmin(probs[pool])])


def drafts_for(p: SamplingParams, kind) -> list[int]:
    d1 = pick_draft(target_probs(p, [])[0], kind)
    return [d1, pick_draft(target_probs(p, [d1])[1], kind)]


def expected_sequences(probs, drafts) -> dict[tuple, float]:
    """Distribution of what one verify step emits under plain sampling: tokens until the first
    non-draft."""
    out, prefix_prob = {}, 1.0
    for j in range(K + 1):
        for t in range(V):
            if j < K and t == drafts[j]:
                continue
            out[tuple(drafts[:j]) + (t,)] = prefix_prob * probs[j][t]
        if j < K:
            prefix_prob *= probs[j][drafts[j]]
    return out


def chi2_pvalue(observed: Counter, expected: dict, n: int) -> float:
    """Pearson chi-square; cells with expected count < 5 pooled; impossible cells must be empty."""
    assert sum(observed[c] for c in observed if expected.get(c, 0.0) == 0.0) == 0, (
        "an impossible outcome occurred"
    )
    big = [c for c, pr in expected.items() if pr * n >= 5]
    small = [c for c, pr in expected.items() if 0 < pr * n < 5]
    obs = [observed[c] for c in big] + ([sum(observed[c] for c in small)] if small else [])
    exp = [expected[c] * n for c in big] + ([sum(expected[c] * n for c in small)] if small else [])
    exp = np.array(exp) * sum(obs) / sum(exp)  # exact totals for scipy
    return stats.chisquare(obs, exp).pvalue if len(obs) > 1 else 1.0


def step_outcomes(tokens: torch.Tensor) -> tuple[Counter, Counter]:
    seqs = Counter(tuple(t for t in row if t >= 0) for row in tokens.tolist())
    first = Counter()
    for s, c in seqs.items():
        first[s[0]] += c
    return first, seqs


def lossless_pvalues(tokens, probs, drafts) -> tuple[float, float]:
    """Chi-square p-values of the first token and of the whole emitted run against plain
    sampling."""
    first, seqs = step_outcomes(tokens)
    p_first = chi2_pvalue(first, {t: probs[0][t] for t in range(V)}, N)
    p_seq = chi2_pvalue(seqs, expected_sequences(probs, drafts), N)
    return p_first, p_seq


def sampler_tokens(p: SamplingParams, drafts) -> torch.Tensor:
    sampling = SamplingBatch.build(
        [p] * N, [1_000_003 * i + 17 for i in range(N)], [HISTORY] * N, [PROMPT] * N
    )
    out = accept(
        TARGET.expand(N, K + 1, V),
        torch.tensor([drafts] * N),
        torch.full((N,), K),
        torch.full((N,), 40),
        sampling,
    )
    return out.tokens


TRUNCATING = ["top_k", "top_p", "min_p_top_k"]  # settings with filtered-out tokens to draft


@pytest.mark.parametrize(
    "setting, kind",
    [(s, k) for s in SETTINGS for k in ["likely", "unlikely"]]
    + [(s, "masked") for s in TRUNCATING],
)
def test_sampled_verification_is_lossless(setting, kind):
    p = SETTINGS[setting]
    drafts = drafts_for(p, kind)
    probs = target_probs(p, drafts)
    p_first, p_seq = lossless_pvalues(sampler_tokens(p, drafts), probs, drafts)
    assert p_first > 1e-3 and p_seq > 1e-3, (drafts, p_first, p_seq)


def leviathan_tokens(p: SamplingParams, drafts, q_rows) -> torch.Tensor:
    """Reference rejection sampler (Leviathan et al.) with proposal q: accept d with
    min(1, p(d)/q(d)), resample from norm(max(p - q, 0)), bonus from p_K. q one-hot = the lossless
    rule; q softmax = HF's."""
    probs = [torch.tensor(pr, dtype=torch.float64) for pr in target_probs(p, drafts)]
    seeds = torch.tensor([1_000_003 * i + 17 for i in range(N)])
    tokens = torch.full((N, K + 1), -1)
    alive = torch.ones(N, dtype=torch.bool)
    for j in range(K + 1):
        pos = torch.full((N,), 40 + j + 1)
        inv_cdf = uniform(seeds, pos, 12, 1)
        if j == K:
            dist = probs[j]
            accepted = torch.zeros(N, dtype=torch.bool)
        else:
            d, q = drafts[j], q_rows[j]
            accepted = uniform(seeds, pos, 11, 1)[:, 0].double() < min(
                1.0, float(probs[j][d] / q[d])
            )
            dist = (probs[j] - q).clamp(min=0)
        cdf = torch.cumsum(dist / dist.sum(), 0)
        sample = torch.searchsorted(cdf, inv_cdf.double().expand(N, 1).contiguous()).clamp(
            max=V - 1
        )[:, 0]
        tokens[:, j] = torch.where(
            alive, torch.where(accepted, drafts[j] if j < K else -1, sample), -1
        )
        alive &= accepted
    return tokens


def test_test_has_power():
    """Positive control: the textbook rule with q = one-hot passes. Negative control: HF's rule
    with a softmax q (q(d) < 1, so it over-accepts drafts) must fail the same test."""
    p = SETTINGS["top_p"]
    for kind in ["likely", "unlikely"]:
        drafts = drafts_for(p, kind)
        probs = target_probs(p, drafts)
        onehot = [torch.nn.functional.one_hot(torch.tensor(d), V).double() for d in drafts]
        assert min(lossless_pvalues(leviathan_tokens(p, drafts, onehot), probs, drafts)) > 1e-3
        # A drafter fairly sure of its argmax: q(d) = 0.5, the other half spread evenly.
        soft = [
            torch.softmax(
                math.log(V - 1) * torch.nn.functional.one_hot(torch.tensor(d), V).double(), 0
            )
            for d in drafts
        ]
        p_first, p_seq = lossless_pvalues(leviathan_tokens(p, drafts, soft), probs, drafts)
        assert p_first < 1e-6 and p_seq < 1e-6, (kind, p_first, p_seq)


# --------------------------------------------------------------------------------------------------
# Graph safety: no host syncs or data-dependent shapes in the step
# --------------------------------------------------------------------------------------------------


def test_accept_traces_as_one_graph():
    torch._dynamo.reset()
    params = [
        SamplingParams(
            temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2, logprobs=2
        ),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
    ]
    sampling = batch(params, outputs=[[1, 2], [3]], prompts=[[4], [5, 6]])
    logits = torch.randn(2, 4, 16)
    args = (
        logits,
        torch.tensor([[1, 2, 3], [4, -1, -1]]),
        torch.tensor([3, 1]),
        torch.tensor([7, 9]),
        sampling,
    )
    compiled = torch.compile(
        accept, fullgraph=True, backend="eager"
    )  # raises on a graph break (.item(), ...)
    want, got = accept(*args), compiled(*args)
    assert torch.equal(want.tokens, got.tokens) and torch.equal(want.num_emitted, got.num_emitted)


# --------------------------------------------------------------------------------------------------
# Settings at the edge of float32
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("tiny", [1e-50, 1e-40, 1.2e-38])
def test_the_top_token_survives_any_top_p_and_min_p(top_k, tiny):
    """top_p 1e-50 is 0 in the sampler's float32: the cut-off must still keep the argmax (it once
    kept nothing, and the all -inf row sampled token 0, <pad>)."""
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0, 2.0, 0.1]] * 4)
    settings = SamplingParams(temperature=1.0, top_k=top_k, top_p=0.5, min_p=0.5)
    settings.top_p = tiny  # past validation: what the sampler does with what reaches it
    for seed in range(4):
        sampling = batch([settings], seeds=[seed])
        row_seq = torch.zeros(4, dtype=torch.int64)
        processed = process_logits(logits, sampling, row_seq, torch.full((4, 0), -1))
        assert torch.isfinite(processed[:, 1]).all()
        assert torch.isinf(processed[:, [0, 2, 3, 4, 5]]).all()
        position = torch.arange(4, dtype=torch.int64)
        assert choose(processed, sampling, row_seq, position).tolist() == [1] * 4


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_p", 1e-50),
        ("min_p", 1e-300),
        ("temperature", 1e-45),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 5e-324),
        ("presence_penalty", 1e-320),
        ("temperature", 1e39),
        ("repetition_penalty", 1e300),
    ],
)
def test_values_float32_cannot_hold_are_refused(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be 0 or of magnitude"):
        SamplingParams(**{field: value})


def test_float32_edges_are_accepted():
    for field in ("top_p", "min_p", "temperature", "repetition_penalty", "presence_penalty"):
        SamplingParams(**{field: 1.2e-38})
    SamplingParams(temperature=3e38, repetition_penalty=3e38)


def test_token_rules_on_verify_rows_read_the_drafts_ahead():
    """Row j of a verify sees the drafts d1..dj as output: a two-token bad word (3, 4) bans 4 on
    the row after a draft 3, and min_tokens bans the end token by position, row by row."""
    from gemma4serve.engine.sampler import TokenRules

    V = 8
    rules = TokenRules(
        bias={6: 5.0}, allowed=None, bad_sequences=[[3, 4]], end_ids=[1], min_tokens_position=12
    )
    params = [SamplingParams(temperature=0.0)]
    sampling = SamplingBatch.build(params, [0], [[2]], [[0] * 10], [rules])
    logits = torch.zeros(3, V)
    logits[:, 4] = 10.0  # the model's favourite
    logits[:, 1] = 9.0
    drafts = torch.tensor([[3, 5]])
    extra = torch.where(torch.arange(2) < torch.arange(3)[:, None], drafts, -1)  # [3, 2]
    position = torch.tensor([11, 12, 13])  # the positions the rows produce
    out = process_logits(logits, sampling, torch.zeros(3, dtype=torch.long), extra, position)
    assert out[0, 4] == 10.0 and out[0, 1] == NEG_INF  # before min_tokens: no end token
    assert out[1, 4] == NEG_INF and out[1, 1] == 9.0  # after draft 3: 4 is banned
    assert out[2, 4] == 10.0  # after 3, 5: allowed again
    assert (out[:, 6] == 5.0).all()  # logit_bias on every row
    assert (logits[:, 1] == 9.0).all()  # the raw logits are untouched (logprobs read them)
