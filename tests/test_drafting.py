"""Drafter and draft-length policy on plain lists of token ids (no model, no torch)."""

from __future__ import annotations

import random

import pytest

from parrot.drafting import (
    AcceptanceStats,
    Draft,
    DrafterSettings,
    DraftLengthPolicy,
    DraftSlot,
    NGramDrafter,
    NGramModel,
    SuffixDrafter,
    drafter_methods,
    expected_yield,
    new_drafter,
    register_drafter,
)

EOS = 2

# (live tokens, context documents, max_len, expected proposal, the wrong answer it guards against)
SUFFIX_TABLE = [
    # The docstring's worked example: the most recent occurrence of the longest match wins.
    ([5, 6, 7, 9, 5, 6, 7, 8, 5, 6], [], 4, [7, 8, 5, 6]),  # not [7, 9, ...] (oldest occurrence)
    # A longer match beats a more recent shorter one.
    ([1, 2, 3, 4, 9, 3, 5, 1, 2, 3], [], 2, [4, 9]),  # not [5, 1] (most recent 1-gram "3")
    # No earlier occurrence of any suffix: no draft, as the empty list.
    ([1, 2, 3, 4], [], 3, []),  # not None, not the input handed back
    # The sequence's own suffix is not a match for itself.
    ([7, 8, 9], [], 3, []),  # not [] by accident of max_len: [9] must not match at the end
    # Overlapping continuation of a repetition runs up to the end of the sequence.
    ([1, 2, 1, 2, 1, 2], [], 8, [1, 2]),  # not [1, 2, 1, 2] (reads past the end)
    # Never drafts past EOS: the proposal ends with the EOS token.
    ([4, 5, EOS, 6, 7, 4, 5], [], 5, [EOS]),  # not [EOS, 6, 7]
    # Extra context wins a tie against the live sequence (Predicted Outputs rule).
    ([3, 4, 10, 3, 4], [[3, 4, 20, 21]], 2, [20, 21]),  # not [10, 3] from the prompt
    # ... but a longer match in the live sequence beats a shorter one in the context.
    ([1, 3, 4, 10, 1, 3, 4], [[3, 4, 20]], 1, [10]),  # not [20] (2-gram match vs 3-gram)
    # max_len caps the proposal, and 0 means no draft.
    ([1, 2, 3, 1, 2], [], 1, [3]),
    ([1, 2, 3, 1, 2], [], 0, []),
]


@pytest.mark.parametrize("live, contexts, max_len, expected", SUFFIX_TABLE)
def test_suffix_drafter_table(live, contexts, max_len, expected):
    drafter = SuffixDrafter(min_n=1, max_n=3, stop_token_ids=[EOS])
    for doc in contexts:
        drafter.add_context(doc)
    drafter.extend(live)
    assert drafter.propose(max_len).tokens == expected


def test_suffix_drafter_min_n_rejects_short_matches():
    drafter = SuffixDrafter([1, 2, 3, 9, 3], min_n=2, max_n=4)
    assert drafter.propose(3).tokens == []  # a 1-gram match ("3") is below min_n


def test_suffix_drafter_follows_a_confirmed_match_instead_of_jumping():
    # The phrase [1, 2, 3] occurs twice in the document; while copying its first occurrence the
    # drafter must keep following it, not jump to the most recent occurrence of the suffix.
    doc = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8]
    drafter = SuffixDrafter(min_n=1, max_n=3)
    drafter.add_context(doc)
    drafter.extend([0, 1, 2, 3])
    assert drafter.propose(2).tokens == [7, 8]  # fresh lookup: most recent occurrence of [1, 2, 3]
    drafter = SuffixDrafter(min_n=1, max_n=3)
    drafter.add_context(doc)
    drafter.extend([0, 1])
    assert drafter.propose(2).tokens == [2, 3]  # 1-gram [1]: most recent occurrence, position 7
    drafter = SuffixDrafter(min_n=1, max_n=3)
    drafter.add_context(doc)
    drafter.extend([9, 3])
    assert drafter.propose(1).tokens == [7]  # most recent "3" is at position 8
    drafter.extend([4])  # the model wrote 4, the followed match broke
    drafter.extend([5])
    assert drafter.propose(3).tokens == [6, 1, 2]  # lookup of [4, 5] -> first occurrence region
    drafter.extend([6, 1, 2, 3])  # confirmed through the second [1, 2, 3]...
    assert drafter.propose(2).tokens == [7, 8]


def test_suffix_drafter_follow_keeps_position_in_repeated_phrase():
    doc = [1, 2, 3, 4, 1, 2, 3, 5]
    drafter = SuffixDrafter(min_n=1, max_n=2)
    drafter.add_context(doc)
    drafter.extend([0, 9, 1, 2, 3, 4])
    # Lookup of [3, 4] -> continuation at 4; follow [1, 2, 3] from there.
    assert drafter.propose(3).tokens == [1, 2, 3]
    drafter.extend([1, 2])
    # The followed run (length >= 4) beats the fresh 2-gram lookup of [1, 2] (most recent at 5).
    assert drafter.propose(2).tokens == [3, 5]


def test_suffix_drafter_prefers_the_occurrence_after_the_last_confirmed_copy():
    # The docstring's example of rule 2's cursor: a copy of [2, 3] confirmed up to position 3,
    # then a 1-token match of [1] with continuations at 1, 5 and 8: the first after 3 wins.
    drafter = SuffixDrafter([1, 2, 3, 4, 1, 5, 9, 1, 6, 0, 2], min_n=1, max_n=3)
    assert drafter.propose(2).tokens == [3, 4]
    drafter.extend([3, 8, 1])
    assert drafter.propose(2).tokens == [5, 9]  # not [6, 0] (the most recent occurrence)
    # Without a confirmed copy, the most recent occurrence.
    drafter = SuffixDrafter([1, 2, 3, 4, 1, 5, 9, 1, 6, 0, 2, 7, 8, 1], min_n=1, max_n=3)
    assert drafter.propose(2).tokens == [6, 0]
    # No occurrence after the cursor: the most recent again.
    drafter = SuffixDrafter([1, 5, 1, 6, 2, 3, 4, 0, 2], min_n=1, max_n=3)
    assert drafter.propose(1).tokens == [3]
    drafter.extend([3, 8, 1])
    assert drafter.propose(1).tokens == [6]


def test_suffix_drafter_cursor_in_a_context_document():
    # The copy being confirmed is from the context document: its next match is taken after it
    # there, and a cursor in one document does not steer lookups in another.
    doc = [7, 1, 2, 3, 4, 1, 5, 6, 1, 9]
    drafter = SuffixDrafter(min_n=1, max_n=2)
    drafter.add_context(doc)
    drafter.extend([0, 7])
    assert drafter.propose(2).tokens == [1, 2]
    drafter.extend([1, 2, 8, 1])  # confirmed [1, 2] (cursor at 3), then wrote 8
    assert drafter.propose(1).tokens == [5]  # [1]'s continuations 2, 6, 9: the first after 3
    other = SuffixDrafter(min_n=1, max_n=2)
    other.add_context([1, 4])
    other.add_context(doc)
    other.extend([0, 7])
    other.propose(2)
    other.extend([1, 2, 8, 1])
    assert other.propose(1).tokens == [5]  # the first document's [1] is before the cursor's document


def test_incremental_suffix_index_equals_rebuilt_index():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(400)]
    context = [rng.randrange(6) for _ in range(50)]
    incremental = SuffixDrafter(min_n=1, max_n=4)
    incremental.add_context(context)
    pos = 0
    while pos < len(tokens):
        step = rng.randrange(1, 6)
        incremental.extend(tokens[pos : pos + step])
        pos += step
        rebuilt = SuffixDrafter(min_n=1, max_n=4)
        rebuilt.add_context(context)
        rebuilt.extend(tokens[:pos])
        assert incremental._live_index == rebuilt._live_index
        assert incremental._context_index == rebuilt._context_index
        # Fresh lookups agree (the followed match is per-history state, compared separately).
        assert incremental._lookup() == rebuilt._lookup()


def test_suffix_draft_reports_the_length_of_its_match():
    drafter = SuffixDrafter([5, 6, 7, 9, 5, 6, 7, 8, 5, 6], min_n=1, max_n=3)
    assert drafter.propose(4) == Draft([7, 8, 5, 6], 2)  # the docstring's example: [5, 6] matched
    assert drafter.propose(2, after=[7, 8]) == Draft([5, 6], 3)  # [6, 7, 8] matched, after the forced tokens
    assert SuffixDrafter([1, 2, 3, 4], min_n=1, max_n=3).propose(3) == Draft([], 0)  # no draft: no match length


@pytest.mark.parametrize("method", drafter_methods())
def test_every_registered_drafter_keeps_the_drafter_contract(method):
    """The points of the ``Drafter`` docstring, on random sequences with repetitions and EOS, for
    every drafter the registry has (a new one is checked by being registered)."""
    rng = random.Random(7)
    settings = DrafterSettings(min_n=1, max_n=3, threshold=0.1, stop_token_ids=frozenset({EOS}))
    drafted = ended_at_eos = 0
    for _ in range(30):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 40))]
        context = [rng.randrange(6) for _ in range(rng.randrange(0, 20))]
        twins = [new_drafter(method, settings) for _ in range(2)]
        drafts: list[list[Draft]] = []
        for drafter in twins:
            drafter.add_context(context)
            made = []
            for i in range(0, len(tokens) + 1, 5):
                drafter.extend(tokens[i : i + 5])
                max_len = i % 9 - 1  # -1 .. 7, the same calls for both twins
                made.append(drafter.propose(max_len, after=tokens[:1] if i % 2 else ()))
                assert isinstance(made[-1], Draft) and isinstance(made[-1].tokens, list)
                assert len(made[-1].tokens) <= max(max_len, 0)  # max_len caps; <= 0 gives Draft([])
                assert EOS not in made[-1].tokens[:-1]  # never past a stop token
                assert made[-1].tokens or made[-1].match_length == 0
            drafts.append(made)
        assert drafts[0] == drafts[1]  # deterministic
        drafted += sum(bool(d.tokens) for d in drafts[0])
        ended_at_eos += sum(d.tokens[-1:] == [EOS] for d in drafts[0])
    assert drafted > 30 and ended_at_eos > 0  # not vacuous: drafts were made, some stopped at EOS


def test_registry_builds_registered_drafters_and_refuses_unknown_or_duplicate_methods():
    assert {"suffix", "ngram"} <= set(drafter_methods())
    assert isinstance(new_drafter("suffix", DrafterSettings(max_n=4)), SuffixDrafter)
    assert new_drafter("ngram", DrafterSettings(max_n=5)).model.n == 5  # ngram's n is drafting.max_n
    with pytest.raises(ValueError, match="unknown drafting method 'nope'"):
        new_drafter("nope", DrafterSettings())
    with pytest.raises(ValueError, match="already registered"):
        register_drafter("suffix")(lambda settings: SuffixDrafter())


def test_ngram_model_worked_example():
    model = NGramModel(3, [1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert model.next_token([1, 2]) == (3, pytest.approx(2 / 3))
    assert model.suggest([9, 1, 2], threshold=0.5) == [3, 1, 2]  # stops when 4/9 < 0.5
    assert model.suggest([9, 1, 2], threshold=0.4) == [3, 1, 2, 3, 1, 2]  # (2/3)^3 < 0.4 stops
    assert model.suggest([9, 1, 2], threshold=0.9) == []  # first token already below


def test_ngram_model_backs_off_to_shorter_histories():
    model = NGramModel(3, [1, 2, 3])
    assert model.next_token([7, 2]) == (3, 1.0)  # (7, 2) unseen -> history (2,)
    assert model.next_token([7, 8]) == (1, pytest.approx(1 / 3))  # unigram: first to reach 1


def test_ngram_model_incremental_equals_rebuilt():
    rng = random.Random(1)
    tokens = [rng.randrange(5) for _ in range(300)]
    incremental = NGramModel(4)
    for i in range(0, 300, 7):
        incremental.update(tokens[i : i + 7])
    rebuilt = NGramModel(4, tokens)
    for k in range(4):
        assert {h: f.counts for h, f in incremental._tables[k].items()} == {
            h: f.counts for h, f in rebuilt._tables[k].items()
        }
    for i in range(50):
        ctx = tokens[: rng.randrange(1, 300)]
        assert incremental.suggest(ctx, 0.2) == rebuilt.suggest(ctx, 0.2)


def test_ngram_drafter_stops_after_eos_and_keeps_context_separate():
    drafter = NGramDrafter([5, 6, EOS, 7], n=3, threshold=0.5, stop_token_ids=[EOS])
    drafter.extend([5])
    assert drafter.propose(5).tokens == [6, EOS]  # never past EOS
    drafter.add_context([8, 9, 10])
    drafter.extend([8])
    assert drafter.propose(2).tokens == [9, 10]
    assert drafter.tokens == [5, 6, EOS, 7, 5, 8]  # context is indexed, never part of the sequence


def test_policy_drafts_nothing_when_drafts_do_not_pay():
    cost = [0.0, 1.0, 1.5, 2.0, 2.5]  # each extra token costs half a step
    policy = DraftLengthPolicy(cost)
    assert policy.choose(3, a1=0.2, an=0.2) == 0  # 1.2 / 1.5 < 1
    assert policy.choose(3, a1=0.99, an=0.99) == 3
    assert policy.choose(0, a1=0.99, an=0.99) == 0


def test_policy_draft_length_grows_with_acceptance_on_a_flat_curve():
    cost = [0.0] + [1.0 + 0.03 * t for t in range(17)]
    policy = DraftLengthPolicy(cost)
    lengths = [policy.choose(16, a, a) for a in (0.01, 0.1, 0.3, 0.6, 0.9, 0.99)]
    assert lengths == sorted(lengths)
    assert lengths[0] == 0 and lengths[-1] == 16


def test_policy_choice_is_the_best_expected_rate():
    cost = [0.0, 1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
    policy = DraftLengthPolicy(cost)
    for a1 in (0.1, 0.4, 0.7, 0.95):
        for an in (0.3, 0.8, 0.99):
            k = policy.choose(5, a1, an)
            rates = [expected_yield(j, a1, an) / cost[j + 1] for j in range(6)]
            assert rates[k] == max(rates)


def test_policy_batch_allocation_is_the_best_expected_rate_of_the_pass():
    """Brute force over every combination of draft lengths for three requests."""
    import itertools

    cost = [0.0, 1.0, 1.1, 1.25, 1.45, 1.7, 2.0, 2.35]
    policy = DraftLengthPolicy(cost)
    requests = [(1, 1.0, 0.9, 0.8, 3), (2, 2.0, 0.3, 0.9, 2), (1, 1.0, 0.6, 0.5, 3)]  # rows, tokens, a1, an, max_len
    best = max(
        itertools.product(*(range(r[4] + 1) for r in requests)),
        key=lambda ks: sum(r[1] + expected_yield(k, r[2], r[3]) - 1 for r, k in zip(requests, ks))
        / policy.cost_at(sum(r[0] + k for r, k in zip(requests, ks))),
    )
    lengths = policy.allocate(requests)
    rate = lambda ks: sum(r[1] + expected_yield(k, r[2], r[3]) - 1 for r, k in zip(requests, ks)) / policy.cost_at(  # noqa: E731
        sum(r[0] + k for r, k in zip(requests, ks)))
    assert rate(lengths) == pytest.approx(rate(best))
    assert sum(lengths) > 0


def test_policy_drafts_less_per_request_in_a_batch():
    # A steep curve (every row costs the same past the first): a likely draft pays alone but not
    # when eight requests already fill the pass, where it must pay for its row like a whole request.
    cost = [0.0] + [1.0 + 0.2 * (t - 1) for t in range(1, 18)]
    policy = DraftLengthPolicy(cost)
    alone = policy.choose(8, a1=0.5, an=0.7)
    batch = policy.allocate([(1, 1.0, 0.5, 0.7, 8)] * 8)
    assert alone > 0
    assert batch == [0] * 8
    sure = policy.allocate([(1, 1.0, 0.99, 0.99, 8)] * 8)  # near-certain drafts still pay
    assert all(k > 0 for k in sure)


def test_policy_as_draft_sizer_allocates_over_the_slots_of_a_pass():
    policy = DraftLengthPolicy([0.0] + [1.0 + 0.2 * (t - 1) for t in range(1, 18)])
    stats = AcceptanceStats()
    for _ in range(30):
        stats.observe(bucket=4, num_drafted=8, num_accepted=8)
    slots = [DraftSlot(rows=1, draft=[5] * 8, position=10, acceptance=stats, bucket=bucket) for bucket in (4, 1)]
    lengths = policy.size(slots)
    a = [(stats.first_accept(b), stats.next_accept(b)) for b in (4, 1)]
    assert lengths == policy.allocate([(1, 1.0, a1, an, 8) for a1, an in a])
    assert lengths[0] > lengths[1]  # the bucket that kept being accepted drafts more


def test_policy_cost_beyond_the_measured_curve_is_linear():
    cost = [0.0] + [1.0 + 0.1 * (t - 1) for t in range(1, 18)]
    policy = DraftLengthPolicy(cost)
    assert policy.cost_at(17) == pytest.approx(2.6)
    assert policy.cost_at(27) == pytest.approx(3.6)
    assert policy.cost_at(0) == cost[1]


def test_policy_cost_curve_follows_the_passes_it_observes():
    """A curve measured under load (multi-token passes made to look three times as dear): the
    passes the server runs bring it back, through lengths never observed too, and drafting resumes."""
    true = [0.0] + [1.0 + 0.1 * (t - 1) for t in range(1, 18)]
    startup = [0.0] + [c * (1.0 if t == 1 else 3.0) for t, c in enumerate(true[1:], 1)]
    policy = DraftLengthPolicy(startup)
    assert policy.choose(16, a1=0.8, an=0.8) == 0  # every draft looks dear
    for _ in range(DraftLengthPolicy.SEEN - 1):
        policy.observe(2, true[2])
        assert policy.cost == startup  # not before SEEN passes of a length
    policy.observe(2, true[2])
    assert policy.cost[2] == pytest.approx(true[2])
    # With one length seen, its ratio (here a third) is held on both sides: the same shape.
    assert policy.cost[1] == pytest.approx(startup[1] / 3) and policy.cost[8] == pytest.approx(startup[8] / 3)
    assert policy.choose(16, a1=0.8, an=0.8) == 0
    for _ in range(DraftLengthPolicy.SEEN):
        policy.observe(1, true[1])
    assert policy.cost[1] == pytest.approx(true[1]) and policy.cost[8] == pytest.approx(true[8])
    assert policy.choose(16, a1=0.8, an=0.8) > 0
    for _ in range(DraftLengthPolicy.SEEN):
        policy.observe(17, startup[17] / 2)
    w = (8 - 2) / (17 - 2)  # between two lengths seen, the ratio is interpolated
    assert policy.cost[8] == pytest.approx(startup[8] * ((1 - w) / 3 + w / 2))
    assert all(a <= b for a, b in zip(policy.cost[1:], policy.cost[2:]))


def test_policy_tries_a_length_the_start_up_made_dear():
    """Start-up measured 3 tokens and more 1.5x dear, 1 and 2 right (a steep curve, where that
    makes one draft a pass look best for good): past the lengths seen the curve follows the line
    through the two longest, so longer drafts get tried; once seen, their real cost holds."""
    true = [0.0, 1.0, 1.1, 1.4, 1.7, 2.0, 2.3, 2.6, 2.9, 3.2]
    startup = [0.0, 1.0, 1.1] + [c * 1.5 for c in true[3:]]
    policy = DraftLengthPolicy(startup)
    assert policy.choose(8, a1=0.95, an=0.95) == 1
    for _ in range(DraftLengthPolicy.SEEN):
        policy.observe(1, true[1])
        policy.observe(2, true[2])
    assert policy.cost[5] == pytest.approx(1.1 + 3 * 0.1)  # the line through 1 and 2 tokens
    assert policy.choose(8, a1=0.95, an=0.95) > 1
    for _ in range(DraftLengthPolicy.SEEN):
        policy.observe(5, true[5])
    assert policy.cost[5] == pytest.approx(true[5]) and policy.cost[3] > true[2]
    assert policy.cost[9] == pytest.approx(true[5] + 4 * (true[5] - true[2]) / 3)


def test_policy_cost_tracks_a_low_quantile():
    """Once seen, a length's estimate drops fast to a faster pass and rises slowly to slower ones
    (a neighbour's burst), and follows a lasting change."""
    policy = DraftLengthPolicy([0.0, 1.0, 1.2])
    for _ in range(DraftLengthPolicy.SEEN):
        policy.observe(1, 1.0)
    policy.observe(1, 3.0)  # one pass slowed by a neighbour
    assert policy.cost[1] < 1.1
    for _ in range(100):  # every pass 1.5x slower for good
        policy.observe(1, 1.5)
    assert policy.cost[1] == pytest.approx(1.5, rel=0.05)
    policy.observe(1, 1.0)  # faster: a quarter of the way at once
    assert policy.cost[1] == pytest.approx(1.5 - 0.25 * 0.5, rel=0.05)
    policy.observe(0, 1.0)
    policy.observe(3, 1.0)  # beyond the curve: ignored
    policy.observe(2, 0.0)
    assert policy.observed_passes == DraftLengthPolicy.SEEN + 102


def test_acceptance_stats_follow_observations():
    stats = AcceptanceStats()
    for _ in range(30):
        stats.observe(bucket=4, num_drafted=8, num_accepted=8)
        stats.observe(bucket=1, num_drafted=2, num_accepted=0)
    assert stats.first_accept(4) > 0.9
    assert stats.first_accept(1) < 0.1
    assert stats.next.mean > 0.9 and stats.next_accept(4) > 0.9
    assert stats.first_accept(3) == 0.5  # unseen bucket: the uniform prior
    assert stats.next_accept(3) == stats.next.mean  # no continuation seen there yet: all buckets'
    for _ in range(30):
        stats.observe(bucket=2, num_drafted=4, num_accepted=1)  # first kept, the next one never
    assert stats.next_accept(2) < 0.1 < 0.5 < stats.next_accept(4)
