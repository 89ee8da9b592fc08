"""The prefix cache (parrot/engine/prefix_cache.py): a request that starts with the tokens of an
earlier one reuses their KV, and that changes nothing it computes.

Properties, on the tiny model quantised to blocks for every kernel set this CPU runs:
- a hit gives the same logits bit for bit as computing the prefix, however the cached prefix
  and the rest were chunked;
- a warm request (its prefix cached by an earlier turn) gives the same tokens and logprobs as a
  cold one, greedy and seeded sampling, drafting on and off, with drafts accepted and cached
  tokens counted, so that no case passes vacuously;
- parallel requests with one prompt (``n`` > 1) read it once: the others wait and reuse it;
- scopes isolate: another tenant's (or ``cache_salt``'s) identical prompt is never a hit, except
  over a configured shared prefix;
- the budget holds: blocks in bytes never exceed it, eviction takes least recently used leaves,
  and what is evicted only costs a recomputation, never a different answer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parrot.config import DraftingConfig
from parrot.engine.backend import KVLayout
from parrot.engine.engine import Engine, GenerationRequest
from parrot.engine.interface import CacheScope, SpeculationParams
from parrot.engine.kernels import available_isas
from parrot.engine.llama import LlamaForward
from parrot.engine.prefix_cache import PrefixCache, block_keys
from parrot.engine.sampling import SamplingParams
from tests.test_native_forward import quantized_tiny_model
from tests.tiny import TinyTokenizer

each_isa = pytest.mark.parametrize("isa", available_isas())
COST = [0.0] + [1.0 + 0.02 * t for t in range(DraftingConfig().max_draft + 1)]
MB = 1 << 20


@pytest.fixture(scope="module")
def quantized():
    return quantized_tiny_model()


def _tokens(length: int, seed: int) -> list[int]:
    return torch.randint(1, 64, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(forward: LlamaForward, cache: PrefixCache | None, drafting: bool = True, chunk: int = 512) -> Engine:
    config = DraftingConfig() if drafting else DraftingConfig(enabled=False)
    return Engine(forward, TinyTokenizer(64), config, COST if drafting else None, chunk, chunk,  # type: ignore[arg-type]
                  prefix_cache=cache)


# -- keys and the cache on its own ------------------------------------------------------------------


def test_block_keys_name_whole_prefixes_within_a_scope():
    a, b = _tokens(70, 1), _tokens(70, 1)
    b[40] = (b[40] % 63) + 1  # differs in block 2 (positions 32..47)
    ka, kb = block_keys(a, 16, "t"), block_keys(b, 16, "t")
    assert len(ka) == 4  # full blocks only: 70 tokens hold 4 of 16
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]  # a change names every later block anew
    assert block_keys(a, 16, "t", start=2, parent=ka[1]) == ka[2:]  # the chain goes on from any block
    other = block_keys(a, 16, "u")
    assert not set(other) & set(ka)  # another scope: no key in common
    shared = block_keys(a, 16, "u", shared_tokens=40), block_keys(a, 16, "t", shared_tokens=40)
    assert shared[0][:2] == shared[1][:2]  # blocks ending within the shared prefix: one key for all
    assert shared[0][2] != shared[1][2]  # the first block past it carries the scope again


def _layout() -> KVLayout:
    return KVLayout(layers=2, kv_heads=2, head_dim=4, dtype=torch.float16)


def _kv(positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, positions, 4, generator=g).half(), torch.randn(2, 2, positions, 4, generator=g).half())


def test_a_stored_prefix_loads_back_exactly():
    cache = PrefixCache(_layout(), MB, block_tokens=4)
    keys = block_keys(list(range(1, 14)), 4, "")  # 3 full blocks
    k, v = _kv(13, 0)
    assert cache.store(keys, 0, k, v) == 3 and cache.match(keys) == 3
    k2, v2 = torch.zeros(2, 2, 16, 4, dtype=torch.float16), torch.zeros(2, 2, 16, 4, dtype=torch.float16)
    cache.load(keys, 10, k2, v2)  # part of the last block too
    assert torch.equal(k2[:, :, :10], k[:, :, :10]) and torch.equal(v2[:, :, :10], v[:, :, :10])
    assert not k2[:, :, 10:].any()  # nothing past what was asked
    assert cache.store(keys, 0, k, v) == 0  # stored once


def test_eviction_takes_least_recently_used_leaves_and_keeps_the_budget():
    layout = _layout()
    block_bytes = layout.bytes_per_position * 4
    cache = PrefixCache(layout, 5 * block_bytes + 7, block_tokens=4)
    assert cache.capacity == 5 and cache.budget_bytes == 5 * block_bytes
    first = block_keys(list(range(1, 13)), 4, "")  # blocks A0 A1 A2
    second = block_keys(list(range(20, 32)), 4, "")  # blocks B0 B1 B2
    k, v = _kv(12, 1)
    cache.store(first, 0, k, v)
    cache.store(second, 0, k, v)  # 6 blocks in 5 slots: the oldest leaf, A2, goes
    assert cache.match(first) == 2 and cache.match(second) == 3
    assert cache.stats().bytes <= cache.budget_bytes and cache.evicted_blocks == 1
    cache.load(first[:2], 8, torch.empty(2, 2, 8, 4, dtype=torch.float16), torch.empty(2, 2, 8, 4, dtype=torch.float16))
    third = block_keys(list(range(40, 48)), 4, "")  # 2 more blocks: B2, then B1 go (A's were used since)
    cache.store(third, 0, k, v)
    assert cache.match(first) == 2 and cache.match(second) == 1 and cache.match(third) == 2
    # Never a block whose parent is gone: every cached block is reachable from its chain's start.
    for key, block in cache._blocks.items():
        assert block.parent is None or block.parent in cache._blocks


def test_a_budget_smaller_than_a_block_holds_nothing():
    cache = PrefixCache(_layout(), 100, block_tokens=16)
    k, v = _kv(16, 2)
    assert cache.capacity == 0 and cache.store(block_keys(list(range(16)), 16, ""), 0, k, v) == 0


# -- exactness on the model ----------------------------------------------------------------------------


@each_isa
def test_a_hit_gives_the_logits_of_computing_the_prefix_bit_for_bit(quantized, isa):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa)
    prompt = _tokens(230, 3)
    cold = forward.forward([(forward.new_cache(240), prompt, 50)])[0]
    for donor_chunk, rest_chunk in ((7, 70), (64, 1), (160, 13)):
        cache = PrefixCache(forward.kv_layout, 8 * MB, block_tokens=16)
        keys = block_keys(prompt, 16, "")
        donor = forward.new_cache(240)
        for start in range(0, 176, donor_chunk):  # the donor reads 176 tokens in its own chunks
            forward.forward([(donor, prompt[start : min(start + donor_chunk, 176)], 0)])
        cache.store(keys[:11], 0, donor.k, donor.v)
        warm = forward.new_cache(240)
        warm.reserve(176)
        cache.load(keys[:11], 176, warm.k, warm.v)
        warm.length = 176
        rows = []
        for start in range(176, 230, rest_chunk):  # and the warm request the rest in others
            tokens = prompt[start : min(start + rest_chunk, 230)]
            wanted = max(0, min(len(tokens), start + len(tokens) - 180))
            rows.append(forward.forward([(warm, tokens, wanted)])[0])
        assert torch.equal(torch.cat(rows), cold), (donor_chunk, rest_chunk)


MODES = {
    "greedy": SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3),
    "seeded": SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3, temperature=0.9, seed=11),
}


def _turns(engine: Engine, first: list[int], second_tail: list[int], params: SamplingParams,
           context: list[list[int]]) -> tuple[list[int], object]:
    """Turn 1, then turn 2 = turn 1's prompt and output and more: the result of turn 2."""
    one = engine.generate(GenerationRequest(first, params, draft_context=context))
    second = first + one.token_ids + second_tail
    return second, engine.generate(GenerationRequest(second, params, draft_context=context))


@each_isa
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drafting", [True, False], ids=["drafting", "plain"])
@pytest.mark.parametrize("warm_chunk", [512, 5], ids=["whole", "chunked"])
def test_a_warm_turn_equals_a_cold_one(quantized, isa, mode, drafting, warm_chunk):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa)
    params = MODES[mode]
    first, tail = _tokens(90, 4), _tokens(23, 5)
    # What turn 2 gives on a server without the cache.
    plain = _engine(forward, None, drafting=False)
    plain_first = plain.generate(GenerationRequest(first, params))
    second = first + plain_first.token_ids + tail
    plain_second = plain.generate(GenerationRequest(second, params))
    # With drafting, drafts that are often right: part of turn 2's own answer (as Predicted Outputs).
    context = [plain_second.token_ids[:25]] if drafting else []
    cold = _engine(forward, None, drafting).generate(GenerationRequest(second, params, draft_context=context))
    assert cold.token_ids == plain_second.token_ids
    # The same turns on an engine with the cache, turn 1 read in other chunks.
    warm_engine = _engine(forward, PrefixCache(forward.kv_layout, 8 * MB), drafting, chunk=warm_chunk)
    second_warm, warm = _turns(warm_engine, first, tail, params, context)
    assert second_warm == second
    assert warm.stats.cached_tokens >= 4 * ((len(first) + len(plain_first.token_ids) - 1) // 4)
    assert warm.stats.prefix_query_tokens == len(second)
    assert warm.token_ids == cold.token_ids
    assert [(e.token, e.logprob, e.top) for e in warm.logprobs] == [(e.token, e.logprob, e.top) for e in cold.logprobs]
    if drafting:
        assert warm.stats.accepted_tokens > 0 and cold.stats.accepted_tokens > 0
    else:
        assert warm.stats.drafted_tokens == 0


@each_isa
def test_parallel_requests_with_one_prompt_read_it_once(quantized, isa):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa)
    prompt = _tokens(150, 6)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = _engine(forward, None).generate(GenerationRequest(prompt, params))
    engine = _engine(forward, PrefixCache(forward.kv_layout, 8 * MB, block_tokens=16), chunk=32)
    seqs = [engine.start(GenerationRequest(prompt, params)) for _ in range(3)]
    while not all(s.finished for s in seqs):
        engine.step(seqs)
    assert seqs[0].stats.cached_tokens == 0 and seqs[0].stats.prefill_chunks == 4  # 150 tokens in chunks of 32
    for seq in seqs[1:]:
        assert seq.stats.cached_tokens == 144 and seq.stats.prefill_chunks == 0  # waited, then reused 9 blocks
        assert seq.output_ids == seqs[0].output_ids == alone.token_ids


@each_isa
def test_prompt_logprobs_read_the_whole_prompt_and_agree(quantized, isa):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks, isa=isa)
    prompt = _tokens(100, 7)
    engine = _engine(forward, PrefixCache(forward.kv_layout, 8 * MB))
    params = SamplingParams(max_tokens=4, prompt_logprobs=2)
    first = engine.generate(GenerationRequest(prompt, params))
    again = engine.generate(GenerationRequest(prompt, params))
    assert again.stats.cached_tokens == 0  # every prompt position's logits are needed
    assert [(e.token, e.logprob) for e in again.prompt_logprobs] == [(e.token, e.logprob) for e in first.prompt_logprobs]
    reused = engine.generate(GenerationRequest(prompt, dataclasses.replace(params, prompt_logprobs=None)))
    assert reused.stats.cached_tokens == 99 and reused.token_ids == first.token_ids  # both stored it


def test_scopes_isolate_tenants_but_share_a_configured_prefix(quantized):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks)
    engine = _engine(forward, PrefixCache(forward.kv_layout, 8 * MB, block_tokens=16), drafting=False)
    prompt = _tokens(120, 8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(salt: str, shared: int = 0):
        return engine.generate(GenerationRequest(prompt, params, cache_scope=CacheScope(salt, shared)))

    a = run("tenant-a")
    assert a.stats.cached_tokens == 0
    assert run("tenant-a").stats.cached_tokens == 112  # the same tenant: a hit
    b = run("tenant-b")
    assert b.stats.cached_tokens == 0 and b.token_ids == a.token_ids  # another: computed anew
    assert run("tenant-a\nsalt").stats.cached_tokens == 0  # a cache_salt is a scope of its own
    run("tenant-c", shared=50)  # stores the shared blocks (0..47) without scope
    assert run("tenant-d", shared=50).stats.cached_tokens == 48  # only those are common to tenants


def test_eviction_under_a_small_budget_changes_no_answer(quantized):
    model, blocks = quantized
    forward = LlamaForward(model, 512, blocks)
    layout = forward.kv_layout
    budget = 12 * 16 * layout.bytes_per_position  # 12 blocks; each conversation below needs 6-8, both 13-15
    cache = PrefixCache(layout, budget, block_tokens=16)
    engine, plain = _engine(forward, cache), _engine(forward, None)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    hits = 0
    for round_ in range(3):
        for conv in range(2):
            prompt = _tokens(100 + 10 * round_, 20 + conv)
            warm = engine.generate(GenerationRequest(prompt, params))
            assert warm.token_ids == plain.generate(GenerationRequest(prompt, params)).token_ids
            hits += warm.stats.cached_tokens > 0
            stats = cache.stats()
            assert stats.bytes <= stats.budget_bytes == budget
    assert cache.evicted_blocks > 0 and hits > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drafting", [True, False], ids=["drafting", "plain"])
def test_the_embedded_model_answers_a_warm_turn_as_a_cold_one(embedded_engine, mode, drafting):
    """The same on the embedded model and its tokenizer: a chat's second turn, its first turn's
    answer in the history, with the cache and without, tokens and logprobs bit for bit."""
    tokenizer, forward = embedded_engine.tokenizer, embedded_engine.forward
    params = dataclasses.replace(MODES[mode], max_tokens=48, ignore_eos=False)
    spec = SpeculationParams(enabled=drafting)
    warm_engine = Engine(forward, tokenizer, embedded_engine.drafting, embedded_engine.policy.cost,
                         prefix_cache=PrefixCache(forward.kv_layout, 32 * MB))
    text = ("Please fix the grammar of this text and return it whole: the cat have been sitting on the mat "
            "since this morning, and it do not want to move because the sun are warm and the mat is soft.")
    turn = [{"role": "user", "content": text}]
    first = warm_engine.generate(GenerationRequest(tokenizer.encode_chat(turn), params, spec))
    turn += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now the same, in capitals."}]
    second = tokenizer.encode_chat(turn)
    warm = warm_engine.generate(GenerationRequest(second, params, spec))
    cold = embedded_engine.generate(GenerationRequest(second, params, spec))
    assert warm.stats.cached_tokens >= len(second) - 30  # all but the new question's tokens and a partial block
    assert warm.token_ids == cold.token_ids and len(warm.token_ids) > 0
    assert [(e.token, e.logprob, e.top) for e in warm.logprobs] == [(e.token, e.logprob, e.top) for e in cold.logprobs]
    if drafting:
        assert warm.stats.accepted_tokens > 0
