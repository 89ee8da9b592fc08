"""The perplexity guard's arithmetic (loadtests/perplexity.py), as llama-perplexity chunks and
scores: chunk boundaries, BOS placement, which positions are scored, PPL with its +/-, and the
KL divergence; end to end on the tiny model against one transformers forward per chunk. No model
is downloaded and llama.cpp is not needed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loadtests import perplexity as ppl
from tests.tiny import tiny_hf_model


def test_chunks_drop_the_remainder_and_put_bos_first():
    tokens = list(range(100, 1200))  # 1,100 tokens: two chunks of 512, 76 left over
    plain = ppl.chunks(tokens, 512, None)
    assert [c[0] for c in plain] == [100, 612] and [len(c) for c in plain] == [512, 512]
    assert plain[1][-1] == 1123
    with_bos = ppl.chunks(tokens, 512, 1)
    assert [c[0] for c in with_bos] == [1, 1]  # the chunk's first token replaced, not shifted
    assert [c[1:] for c in with_bos] == [c[1:] for c in plain]
    assert tokens[0] == 100 and tokens[512] == 612  # the text's tokens are untouched
    assert ppl.chunks(tokens[:511], 512, None) == []


def test_second_half_scored():
    assert ppl.first_scored(512) == 256 and ppl.logits_wanted(512) == 256
    chunk = list(range(512))
    assert ppl.targets(chunk) == list(range(257, 512))  # 255 tokens, as llama.cpp counts
    small = [10, 11, 12, 13, 14, 15, 16, 17]
    assert ppl.targets(small) == [15, 16, 17]
    # logits after positions 4..7; rows 0..2 predict positions 5..7, row 3 is not used
    log_probs = torch.full((4, 20), -9.0)
    for row, token in enumerate([15, 16, 17]):
        log_probs[row, token] = -float(row + 1)
    log_probs[3] = 0.0
    assert ppl.scored_log_probs(log_probs, small).tolist() == [-1.0, -2.0, -3.0]


def test_perplexity_and_its_error():
    uniform = torch.log_softmax(torch.zeros(6, 50), dim=-1)
    tally = ppl.Tally()
    tally.add(uniform[:, 0])
    result = tally.result()
    assert result["ppl"] == pytest.approx(50) and result["plus_minus"] is None  # no spread
    value, plus_minus = ppl.perplexity(1 + 2 + 3, 1 + 4 + 9, 3)  # NLLs 1, 2, 3
    assert value == pytest.approx(math.e ** 2)
    assert plus_minus == pytest.approx(math.sqrt((14 / 3 - 4) / 2) * math.e ** 2)
    tally = ppl.Tally()
    tally.add(torch.tensor([-1.0]))
    tally.add(torch.tensor([-2.0, -3.0]))
    assert tally.running == pytest.approx([math.e, math.e ** 2])  # after each chunk, as llama.cpp prints


def test_kl_divergence():
    p = torch.tensor([[0.5, 0.5], [0.25, 0.75]]).log()
    q = torch.tensor([[0.9, 0.1], [0.25, 0.75]]).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert ppl.kl_rows(p, q).tolist() == pytest.approx([expected, 0.0])
    rows = torch.log_softmax(torch.randn(70, 30, generator=torch.Generator().manual_seed(1)), dim=-1)
    other = torch.log_softmax(torch.randn(70, 30, generator=torch.Generator().manual_seed(2)), dim=-1)
    assert torch.allclose(ppl.kl_rows(rows, other, block=7), ppl.kl_rows(rows, other, block=100))
    assert (ppl.kl_rows(rows, other) > 0).all() and ppl.kl_rows(rows, rows).abs().max() == 0


def test_log_prob_rows_are_stored_as_llama_perplexity_stores_them():
    """The 16-bit rows of llama-perplexity's --kl-divergence-base file, byte for byte as its
    log_softmax writes them (scale and lowest log-probability as float32, then uint16 codes)."""
    import struct

    logits = torch.tensor([[2.0, -1.0, 0.5, -30.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    log_probs = torch.log_softmax(logits, dim=-1)
    coded = ppl.log_prob_rows(log_probs)
    assert coded.shape == (2, 2 * 3 + 4) and coded.dtype == torch.int16
    row = coded[0].numpy().tobytes()
    scale, lowest = struct.unpack("<ff", row[:8])
    codes = struct.unpack("<6H", row[8:])
    top = float(log_probs[0].max())
    assert lowest == pytest.approx(top - 16, abs=1e-5)  # -30 is more than 16 below the top
    assert scale == pytest.approx(16 / 65535, rel=1e-6)
    assert codes[0] == 65535 and codes[3] == 0 and codes[5] == 0  # the top, one below the lowest, padding
    assert codes[1] == round((float(log_probs[0, 1]) - lowest) / scale)
    decoded = ppl.decode_log_prob_rows(coded, 5)
    kept = log_probs[0] > lowest
    assert torch.allclose(decoded[0][kept], log_probs[0][kept], atol=scale)
    assert struct.unpack("<ff", coded[1].numpy().tobytes()[:8])[0] == 0  # a flat row: scale 0, codes 0
    assert decoded[1].tolist() == pytest.approx(log_probs[1].tolist())
    # KL as llama.cpp sums it: the tokens above -16 only, otherwise KL itself
    other = torch.log_softmax(logits * 0.9, dim=-1)
    assert ppl.kl_rows(log_probs[1:], other[1:], above=-16).tolist() == pytest.approx(ppl.kl_rows(log_probs[1:], other[1:]).tolist())
    header = ppl.logits_file_header(4, 5, [7, 8, 9, 10, 11, 12, 13, 14, 15])
    assert header[:8] == b"_logits_" and struct.unpack("<Iii", header[8:20]) == (4, 5, 2)
    assert struct.unpack("<8i", header[20:]) == (7, 8, 9, 10, 11, 12, 13, 14)  # whole chunks only


def test_score_writes_the_base_rows_and_takes_kl_the_same_way(tmp_path):
    """With a base file, the base's rows are written after the header, one block of
    n_ctx - 1 - n_ctx / 2 rows per chunk, and the other system's KL is also taken from them."""
    vocab, n_ctx = 30, 16
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(4))

    def system(temperature):
        return lambda chunk: table[chunk[-ppl.logits_wanted(len(chunk)):]] * temperature

    chunk_list = ppl.chunks([i % vocab for i in range(40)], n_ctx, None)
    path = tmp_path / "base.logits"
    with open(path, "wb") as f:
        scored = ppl.score(chunk_list, {"base": system(1.0), "other": system(0.8)}, base="base", base_file=f)
    rows = len(ppl.targets(chunk_list[0]))
    assert rows == n_ctx - 1 - n_ctx // 2
    data = path.read_bytes()
    assert len(data) == len(chunk_list) * rows * (vocab + 4) * 2
    kl = scored["kl"]["other"]
    assert kl["mean_llama_way"] == pytest.approx(kl["mean"], rel=1e-3) and kl["mean"] > 0.01


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_scores_on_the_tiny_model_as_one_forward_per_chunk(backend):
    from parrot.engine.hf_runner import HFForward
    from parrot.engine.llama import LlamaForward

    model = tiny_hf_model(seed=3)
    forward = LlamaForward(model, 512) if backend == "native" else HFForward(model, 512)
    tokens = torch.randint(2, 64, (16 * 3 + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    chunk_list = ppl.chunks(tokens, 16, 1)
    scored = ppl.score(chunk_list, {"a": ppl.forward_logits(forward), "b": ppl.forward_logits(forward)}, base="a")
    nll, count = 0.0, 0
    with torch.inference_mode():
        for chunk in chunk_list:
            log_probs = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), dim=-1)
            for position in range(8, 15):  # logits after positions 8..14 predict 9..15
                nll -= float(log_probs[position, chunk[position + 1]])
                count += 1
    a = scored["systems"]["a"]
    assert a["scored"] == count == 3 * 7
    assert a["mean_nll"] == pytest.approx(nll / count, rel=1e-4)
    assert a["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert scored["kl"]["b"]["mean"] == pytest.approx(0.0, abs=1e-9) and scored["kl"]["b"]["same_top"] == 1.0


def test_each_chunk_is_one_fresh_pass_with_bos_first():
    passes = []

    class Cache:
        def __init__(self) -> None:
            self.length = 0

    class Recording:
        def new_cache(self, capacity):
            return Cache()

        def forward(self, batch):
            (cache, tokens, num_logits), = batch
            passes.append((cache.length, list(tokens), num_logits))
            cache.length += len(tokens)
            return [torch.zeros(num_logits, 40)]

    tokens = list(range(5, 37))  # two chunks of 16
    scored = ppl.score(ppl.chunks(tokens, 16, 2), {"only": ppl.forward_logits(Recording())})
    assert [(start, t[0], len(t), n) for start, t, n in passes] == [(0, 2, 16, 8), (0, 2, 16, 8)]
    assert passes[1][1][1:] == tokens[17:32]
    assert scored["systems"]["only"]["ppl"] == pytest.approx(40)  # uniform over 40
    assert "kl" not in scored


class FakeTokenizer:
    def __init__(self, bos: int | None) -> None:
        self.bos = bos
        self.hf = self
        self.all_special_ids = [0, 1]
        self.added_tokens_decoder: dict = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) for c in text]
        return ([self.bos] if add_special_tokens and self.bos is not None else []) + ids


def test_tokenize_finds_bos_as_llama_cpp_adds_it():
    with_bos = ppl.tokenize(FakeTokenizer(1), "ab")
    assert with_bos["tokens"] == [1, 97, 98] and with_bos["add_bos"] and with_bos["bos"] == 1
    without = ppl.tokenize(FakeTokenizer(None), "ab")
    assert without["tokens"] == [97, 98] and not without["add_bos"] and without["bos"] is None
    assert ppl.tokenize(FakeTokenizer(None), "a\x01")["specials_in_text"] == [1]


def test_fixed_text_reads_the_summeval_articles_in_order(tmp_path):
    rows = [{"id": "specbench-sum-1", "prompt": ppl.INSTRUCTION + "not this"},
            {"id": "summeval-cnn-test-a", "prompt": ppl.INSTRUCTION + "First article."},
            {"id": "summeval-dm-test-b", "prompt": ppl.INSTRUCTION + "Second\n\narticle."},
            {"id": "summeval-dm-test-c", "prompt": ppl.INSTRUCTION + "Third."}]
    (tmp_path / "summarization.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ppl.fixed_text(2, tmp_path) == "First article.\n\nSecond\n\narticle."
    with pytest.raises(ValueError):
        ppl.fixed_text(4, tmp_path)


def test_render_says_when_llama_cpp_is_skipped():
    system = {"ppl": 7.5, "plus_minus": 0.1, "ratio_to_float32": 1.0}
    result = {"model": "embedded", "gguf": "/x/m.gguf", "cpu": "cpu", "date": "today", "n_ctx": 512, "chunks": 2,
              "scored": 510, "text": {"articles": 34, "characters": 100},
              "tokens": {"parrot": 1100, "add_bos": False},
              "systems": {"parrot_float32": system, "parrot_q8": {**system, "ppl": 7.6, "ratio_to_float32": 1.013}},
              "kl": {"parrot_q8": {"mean": 0.002, "max": 0.03, "same_top": 0.95}},
              "parrot": {"q8": {"backend": "native", "details": {"summary": "kernels"}}}, "llama_cpp": None}
    text = ppl.render(result)
    assert "skipped: no LLAMA_PERPLEXITY given" in text and "| 7.6000 |" in text


def test_chunk_nlls_from_running_perplexities():
    per_chunk = [2.0, 3.0, 2.5]
    running = [math.exp(sum(per_chunk[: i + 1]) / (i + 1)) for i in range(3)]
    assert ppl.chunk_nlls(running, 255) == pytest.approx(per_chunk)
    pair = ppl.paired([1.0, 2.0, 3.0], [0.5, 2.0, 2.5])
    assert pair["mean_nll_difference"] == pytest.approx(1 / 3)
    assert pair["standard_error"] == pytest.approx(math.sqrt(((1 / 6) ** 2 * 2 + (1 / 3) ** 2) / 2 / 3))
    assert ppl.paired([1.0], [1.0]) is None
