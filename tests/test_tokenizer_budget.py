"""Every budgeting operation agrees with a full re-encode by the served (fixed) tokenizer, on
random and adversarial text: unicode of every width, emoji, combining marks, digit and
whitespace runs, added tokens written in the text, bytes without a token, and inputs with no
pre-token split at all (``'a' * n``). Each property runs with the default budget and with one
that sends every piece over 4 characters through the linear tables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parrot.tokenizer import AppendingEncoder, IntervalCounter

FRAGMENTS = st.one_of(
    st.sampled_from(
        [
            "a", "Z", " ", "  ", "\n", "\n\n", "\t", " \n", "'s", "'re", "'", "1", "2024", "٣", "²", "Ⅻ",
            "é", "e\u0301", "\u0301", "中文", "ß", "Ж", "😀", "👍🏽", "👨\u200d👩\u200d👧", "\U0001f600\U0001f600",
            "!", "...", "-", "<", "|", ">", "<|im_end|>", "<|im_start|>", "<|im_", "_end|>", "\u3000", "\xa0",
            "\x04", "\x1d", "\U00040000", "\U0010fffd", " word", "word",
        ]
    ),
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=3),
    st.builds(lambda ch, n: ch * n, st.sampled_from(["a", " ", "\n", "!", "é", "1", "ab", " a", "😀"]), st.integers(1, 40)),
)
TEXTS = st.lists(FRAGMENTS, max_size=12).map("".join)
SHORT_TEXTS = st.lists(FRAGMENTS, max_size=6).map("".join).filter(lambda t: len(t) <= 40)
EXAMPLES = settings(max_examples=120, deadline=None)


@pytest.fixture(scope="module", params=["default", "small_pieces"])
def budget(request, token_budget, small_piece_budget):
    return token_budget if request.param == "default" else small_piece_budget


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text))


@EXAMPLES
@given(text=TEXTS)
def test_encode_and_count_equal_a_full_encode(budget, embedded_tokenizer, text):
    assert budget.encode(text) == embedded_tokenizer.encode(text)
    assert budget.count(text) == n_tokens(embedded_tokenizer, text)


@EXAMPLES
@given(text=TEXTS, limit=st.integers(0, 60))
def test_count_till_limit_is_the_count_or_none(budget, embedded_tokenizer, text, limit):
    count = n_tokens(embedded_tokenizer, text)
    assert budget.count_till_limit(text, limit) == (count if count <= limit else None)


@EXAMPLES
@given(text=SHORT_TEXTS, n=st.integers(0, 20))
def test_split_at_tokens_is_the_longest_prefix_that_fits(budget, embedded_tokenizer, text, n):
    prefix = budget.split_at_tokens(text, n)
    assert text.startswith(prefix)
    # Longest over all prefixes, not just "one more character does not fit": counts are not
    # monotonic, so a later prefix could fit again.
    longest = max(i for i in range(len(text) + 1) if n_tokens(embedded_tokenizer, text[:i]) <= n)
    assert len(prefix) == longest


@EXAMPLES
@given(text=TEXTS, n=st.integers(0, 80))
def test_split_at_tokens_fits_and_one_more_character_does_not(budget, embedded_tokenizer, text, n):
    prefix = budget.split_at_tokens(text, n)
    assert n_tokens(embedded_tokenizer, prefix) <= n
    if len(prefix) < len(text):
        assert n_tokens(embedded_tokenizer, text[: len(prefix) + 1]) > n


def test_split_at_tokens_is_not_the_first_n_tokens_of_the_full_encoding(token_budget, embedded_tokenizer):
    # A whitespace run before a letter ends one character early, so the full encoding's first
    # two tokens cover "x  " while the prefix "x   " is also two tokens (x, ĠĠĠ).
    text = "x   y"
    full = embedded_tokenizer.encode(text)  # x, ĠĠ, Ġy
    naive = embedded_tokenizer.decode(full[:2])  # "x  "
    prefix = token_budget.split_at_tokens(text, 2)
    assert n_tokens(embedded_tokenizer, prefix) <= 2
    assert len(prefix) > len(naive)  # "x   " (x, ĠĠĠ) fits: the naive cut loses a character


@EXAMPLES
@given(text=SHORT_TEXTS, n=st.integers(0, 20), side=st.sampled_from(["left", "right"]))
def test_truncate_keeps_the_longest_end_that_fits(budget, embedded_tokenizer, text, n, side):
    result = budget.truncate(text, n, side)
    if side == "right":
        assert result.text == text[: result.offset]
        best = max(i for i in range(len(text) + 1) if n_tokens(embedded_tokenizer, text[:i]) <= n)
    else:
        assert result.text == text[result.offset :]
        best = min(i for i in range(len(text) + 1) if n_tokens(embedded_tokenizer, text[i:]) <= n)
    assert result.offset == best
    assert result.count == n_tokens(embedded_tokenizer, result.text) <= n
    assert result.truncated == (result.text != text)


@EXAMPLES
@given(text=TEXTS, max_tokens=st.integers(4, 40))
def test_chunks_cover_the_text_each_within_budget_and_maximal(budget, embedded_tokenizer, text, max_tokens):
    chunks = budget.chunk(text, max_tokens)
    assert "".join(c.text for c in chunks) == text
    position = 0
    for c in chunks:
        assert (c.start, c.end) == (position, position + len(c.text))
        assert c.count == n_tokens(embedded_tokenizer, c.text) <= max_tokens
        if c.end < len(text):
            assert n_tokens(embedded_tokenizer, text[c.start : c.end + 1]) > max_tokens
        position = c.end


def test_chunk_refuses_a_character_that_needs_more_tokens_than_the_budget(token_budget):
    with pytest.raises(ValueError):
        token_budget.chunk("😀", 1)  # four bytes, three tokens at least


@pytest.mark.parametrize("bad", [-1, 1.5, None])
def test_negative_or_non_integer_budgets_are_rejected(token_budget, bad):
    for call in (
        lambda: token_budget.split_at_tokens("abc", bad),
        lambda: token_budget.count_till_limit("abc", bad),
        lambda: token_budget.chunk("abc", bad),
        lambda: token_budget.truncate("abc", bad),
    ):
        with pytest.raises(ValueError):
            call()


@EXAMPLES
@given(text=TEXTS, data=st.data())
def test_interval_counts_equal_re_encoding_the_slice(budget, embedded_tokenizer, text, data):
    counter = IntervalCounter(budget, text)
    assert counter.total == n_tokens(embedded_tokenizer, text)
    for _ in range(10):
        start = data.draw(st.integers(0, len(text)))
        end = data.draw(st.integers(start, len(text)))
        assert counter.count(start, end) == n_tokens(embedded_tokenizer, text[start:end])


def test_interval_counter_rejects_ranges_outside_the_text(token_budget):
    counter = IntervalCounter(token_budget, "hello")
    for start, end in [(-1, 2), (3, 2), (0, 6)]:
        with pytest.raises(ValueError):
            counter.count(start, end)


@EXAMPLES
@given(text=TEXTS, cuts=st.lists(st.integers(1, 7), max_size=60))
def test_appending_encoder_is_exact_after_every_append(budget, embedded_tokenizer, text, cuts):
    encoder = AppendingEncoder(budget)
    position, sizes = 0, iter(cuts)
    while position < len(text):
        step = next(sizes, len(text))
        encoder.append(text[position : position + step])
        position = min(len(text), position + step)
        expected = embedded_tokenizer.encode(text[:position])
        assert encoder.count == len(expected)
        assert encoder.tokens == expected


@pytest.mark.parametrize("run", ["a", " ", "\n", "!", "ab", "é"])
def test_no_pre_token_split_inputs_stay_exact(budget, embedded_tokenizer, run):
    """Long runs are one piece: the operations use the linear tables, and stay exact."""
    text = run * 700 + "x" + run * 300
    count = n_tokens(embedded_tokenizer, text)
    assert budget.count(text) == count
    assert budget.count_till_limit(text, 10) is None
    n = count // 3  # so that the cuts fall inside the runs
    prefix = budget.split_at_tokens(text, n)
    assert n_tokens(embedded_tokenizer, prefix) <= n < n_tokens(embedded_tokenizer, text[: len(prefix) + 1])
    kept = budget.truncate(text, n, "left")
    assert kept.count == n_tokens(embedded_tokenizer, kept.text) <= n
    assert n_tokens(embedded_tokenizer, text[kept.offset - 1 :]) > n
    chunks = budget.chunk(text, max(4, n // 2))
    assert "".join(c.text for c in chunks) == text and all(c.count <= max(4, n // 2) for c in chunks)
    counter = IntervalCounter(budget, text)
    for start, end in [(0, len(text)), (3, 500), (250, 701), (699, 1001), (1, len(text) - 1)]:
        assert counter.count(start, end) == n_tokens(embedded_tokenizer, text[start:end])
    encoder = AppendingEncoder(budget)
    for ch in text:
        encoder.append(ch)
    assert encoder.count == count


def test_chat_messages_count_as_the_rendered_prompt_encodes(token_budget, embedded_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sum 12 and  30, then say <|im_end|> literally."},
    ]
    for add_generation_prompt in (True, False):
        expected = len(embedded_tokenizer.encode_chat(messages, add_generation_prompt))
        assert token_budget.count_chat(messages, add_generation_prompt) == expected
    assert embedded_tokenizer.budget.count("hi") == 1  # the tokenizer's own shared budget


def test_budget_hands_out_interval_counters_and_appending_encoders(token_budget, embedded_tokenizer):
    text = "Count me, then append: 12 apples."
    assert token_budget.interval_counter(text).count(6, 20) == n_tokens(embedded_tokenizer, text[6:20])
    encoder = token_budget.appending_encoder()
    encoder.append(text)
    assert encoder.tokens == embedded_tokenizer.encode(text) and len(encoder) == len(text)
