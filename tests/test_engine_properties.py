"""Property-based tests of ``Engine.step`` (hypothesis): whatever the grammar, the drafts and the
sampling, a step never raises, a finished constrained output validates, and the output does not
depend on drafting.

The model is the tiny deterministic Llama of ``tests/tiny.py`` with the embedded model's
vocabulary, so the grammars are real ones over the real tokenizer: JSON schemas from
``../shared/data/schemas.jsonl`` (real-world, see its ``SCHEMAS.md``), regexes and choice lists.
The model's weights are random; a ``logit_bias`` towards tokens that close JSON values (drawn per
example) makes it finish often enough for the validity property to be exercised.

Drafts come from a test drafter that mixes, call by call, the kinds of draft the engine meets:
random tokens; the n-gram drafter's; the reference output itself (accepted), or corrupted (one
rejection), running on past its end (past the grammar's end, with or without EOS, and through
stop strings, since the reference is taken without them); the grammar's forced tokens as
llguidance gives them (not cut to canonical ones), and its forced bytes spelled by the
tokenizer. Draft lengths are cut by the cost policy, by a random sizer, or not at all, and up to
three requests share every pass, starting at different steps, so that prompt chunks and decoding
mix. The engine itself spells the forced bytes when a grammar allows none of a draft.

Properties, on every example:
- no exception from ``Engine.step``;
- every output that ends with ``finish_reason == "stop"`` at its grammar's end (not at a stop
  string, which ends an output wherever the client's string appears) satisfies the constraint:
  a schema with nothing unenforced validates against the whole schema, one with unenforced
  keywords is JSON, a regex matches in full, a choice is one of the choices;
- the output (tokens, text, finish reason) equals the same request's with drafting off, greedy
  or seeded (the random numbers are keyed by output position, so seeded sampling does not depend
  on drafting either).

``PARROT_PROPERTY_EXAMPLES`` raises the number of examples (and draws new ones each run) for a
longer search than the suite's fixed, derandomized set.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parrot.drafting import Draft, DrafterSettings, DraftSlot, new_drafter, register_drafter
from parrot.config import DraftingConfig
from parrot.engine.engine import Engine, Generation, GenerationRequest, SpeculationParams
from parrot.engine.llama import LlamaForward
from parrot.engine.sampling import SamplingParams
from parrot.constrain.schema_check import SchemaCheck
from tests.conftest import fixed_cost_curve
from tests.tiny import tiny_hf_model
from parrot.constrain.grammar import Grammar, GrammarCompiler

SCHEMAS_FILE = Path(__file__).resolve().parents[2] / "shared" / "data" / "schemas.jsonl"
EXAMPLES = int(os.environ.get("PARROT_PROPERTY_EXAMPLES", "0"))
MAX_DRAFT = 8

# Regexes whose meaning is the same in llguidance (Rust regex, matched in full) and Python's re.
REGEXES = [
    r"[a-z]{1,8}",
    r"(yes|no|maybe)",
    r"\d{1,3}(,\d{3}){0,2}",
    r"-?(0|[1-9]\d{0,3})(\.\d{1,2})?",
    r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6})?",
    r'\{"id": [0-9]{1,4}, "ok": (true|false)\}',
    r"(ab|a)(bc|c)?d?",
    r"[^\n]{0,12}\.",
    r"(café|thé|ça) \w{1,3}",
]
# Kinds of draft (PropertyDrafter); the reference output is drawn most often, as it is what runs
# into the grammar's end.
DRAFT_KINDS = ["oracle", "oracle", "oracle", "ngram", "random", "corrupt", "forced", "spelled", "none"]
# Token texts that end a JSON value or structure: the bias towards them makes outputs finish.
CLOSERS = ['"', "}", "]", ",", '",', '"}', "}}", "]}", "},", "0", "1", "true", "false", "null", '":', '"]']


def _schemas() -> list[dict]:
    if not SCHEMAS_FILE.is_file():
        pytest.skip(f"{SCHEMAS_FILE} is not here (a checkout without ../shared beside it)")
    rows = [json.loads(line) for line in SCHEMAS_FILE.read_text().splitlines() if line.strip()]
    return [row for row in rows if row.get("llguidance_lenient_ok", True)]


@dataclass
class Constraint:
    kind: str  # json_schema | regex | choice
    spec: object
    grammar: str
    unenforced: bool = False

    def satisfied_by(self, text: str) -> str | None:
        """None when ``text`` satisfies the constraint, else why not."""
        if self.kind == "regex":
            return None if re.fullmatch(str(self.spec), text) else f"{text!r} does not match {self.spec!r}"
        if self.kind == "choice":
            choices = [str(c) for c in self.spec]  # type: ignore[attr-defined]
            return None if text in choices else f"{text!r} is not one of {choices!r}"
        if self.unenforced:  # keywords the grammar left out may be broken; the JSON may not
            try:
                json.loads(text)
            except json.JSONDecodeError as exc:
                return f"not JSON: {exc}"
            return None
        return SchemaCheck(self.spec).check(text)  # type: ignore[arg-type]


@dataclass
class Script:
    """What the property drafter of one sequence does: the draft kinds, call by call, and the
    reference output the oracle kinds copy (taken without stop strings)."""

    kinds: list[str]
    reference: list[int]
    tail: list[int]  # tokens after the reference's end (past the grammar's end, EOS, ...)
    prompt_len: int
    grammar: Grammar | None
    rng: random.Random
    vocab: int
    tokenizer: object
    proposals: Counter = field(default_factory=Counter)


class PropertyDrafter:
    """A drafter that mixes kinds of draft by a ``Script``; it keeps the drafter contract (at most
    ``max_len`` tokens, ends right after a stop token, ``Draft([])`` for none)."""

    def __init__(self, settings: DrafterSettings, script: Script) -> None:
        self.stop_token_ids = settings.stop_token_ids
        self.ngram = new_drafter("suffix", settings)
        self.script = script
        self.live: list[int] = []
        self.calls = 0

    def extend(self, tokens):
        self.live.extend(tokens)
        self.ngram.extend(tokens)

    def add_context(self, tokens):
        self.ngram.add_context(tokens)

    def propose(self, max_len: int, after: Sequence[int] = ()) -> Draft:
        if max_len <= 0:
            return Draft([])
        s = self.script
        kind = s.kinds[self.calls % len(s.kinds)]
        self.calls += 1
        position = len(self.live) + len(after) - s.prompt_len  # output index the draft starts at
        oracle = (s.reference + s.tail)[position:]
        if kind == "ngram":
            tokens = self.ngram.propose(max_len, after).tokens
        elif kind == "random":
            tokens = [s.rng.randrange(s.vocab) for _ in range(s.rng.randint(1, max_len))]
        elif kind == "oracle":
            tokens = oracle
        elif kind == "corrupt":
            tokens = list(oracle[:max_len])
            if tokens:
                tokens[s.rng.randrange(len(tokens))] = s.rng.randrange(s.vocab)
        elif kind in ("forced", "spelled"):
            tokens = []
            if s.grammar is not None and not s.grammar.stopped:
                if kind == "forced":  # llguidance's own, not cut back to canonical tokens
                    tokens = list(s.grammar.matcher.compute_ff_tokens())
                else:
                    text = bytes(s.grammar.matcher.compute_ff_bytes()).decode("utf-8", errors="ignore")
                    tokens = s.tokenizer.encode(text) if text else []  # type: ignore[attr-defined]
            tokens = tokens + oracle
        else:
            tokens = []
        tokens = list(tokens[:max_len])
        for i, token in enumerate(tokens):
            if token in self.stop_token_ids:
                tokens = tokens[: i + 1]
                break
        if tokens:
            s.proposals[f"draft {kind}"] += 1
            if kind in ("oracle", "forced", "spelled") and position + len(tokens) > len(s.reference):
                s.proposals["draft past the reference's end"] += 1
        return Draft(tokens, len(tokens) if kind != "random" else 1)


# The drafter of each new sequence takes the next script (sequences start in a known order).
_SCRIPTS: list[Script] = []


@register_drafter("property-mix")
def _property_drafter(settings: DrafterSettings) -> PropertyDrafter:
    return PropertyDrafter(settings, _SCRIPTS.pop(0))


@pytest.fixture(scope="module")
def compiler(embedded_tokenizer):
    return GrammarCompiler(embedded_tokenizer)


@pytest.fixture(scope="module")
def tiny_forward(embedded_tokenizer):
    """The tiny random Llama over the embedded tokenizer's vocabulary (native forward)."""
    return LlamaForward(tiny_hf_model(seed=7, vocab_size=embedded_tokenizer.vocab_size), 512)


@st.composite
def constraints(draw, compiler, schemas):
    kind = draw(st.sampled_from(["json_schema", "json_schema", "regex", "choice", "none"]))
    if kind == "none":
        return None
    if kind == "json_schema":
        schema = draw(st.sampled_from(schemas))["schema"]
        grammar = compiler.compile("json_schema", schema, lenient=True)
        return Constraint(kind, schema, grammar, bool(compiler.unenforced(grammar)))
    if kind == "regex":
        regex = draw(st.sampled_from(REGEXES))
        return Constraint(kind, regex, compiler.compile("regex", regex))
    words = st.text(alphabet='ab x"{}1é', min_size=1, max_size=5)
    choices = draw(st.lists(words, min_size=1, max_size=4, unique=True))
    return Constraint(kind, choices, compiler.compile("choice", choices))


@st.composite
def sequences(draw, compiler, schemas, closers):
    constraint = draw(constraints(compiler, schemas))
    seeded = draw(st.booleans())
    # The random model finishes a JSON value mostly with the bias (6 in 10 schemas at 40).
    bias = draw(st.sampled_from([0.0, 10.0, 40.0, 40.0]))
    params = dict(
        max_tokens=draw(st.one_of(st.integers(1, 6), st.integers(24, 64))),
        temperature=draw(st.sampled_from([0.7, 1.0, 1.5])) if seeded else 0.0,
        seed=draw(st.integers(0, 2**32)) if seeded else None,
        top_k=draw(st.sampled_from([0, 0, 5])) if seeded else 0,
        top_p=draw(st.sampled_from([1.0, 1.0, 0.8])) if seeded else 1.0,
        choice=draw(st.integers(0, 2)) if seeded else 0,
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.sampled_from([None, None, 2])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 1.5])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
        logit_bias=tuple((t, bias) for t in closers) if bias else (),
    )
    return {
        "constraint": constraint,
        "params": params,
        "fast_forward": draw(st.booleans()),
        "max_draft": draw(st.sampled_from([None, 2, MAX_DRAFT])),
        "kinds": draw(st.lists(st.sampled_from(DRAFT_KINDS), min_size=1, max_size=6)),
        "tail": draw(st.sampled_from(["eos", "eos", "random", "eos+random", "none"])),
        # A stop string (from the output without one) in one request of three.
        "stop_at": draw(st.tuples(st.floats(0, 1), st.integers(1, 4))) if draw(st.integers(0, 2)) == 0 else None,
        "start_step": draw(st.integers(0, 3)),
        "prompt": draw(st.text(alphabet="abc {}:\",\n0123é", min_size=1, max_size=60)),
        "rng_seed": draw(st.integers(0, 2**16)),
    }


def _request(tokenizer, compiler, seq: dict, params: SamplingParams, drafting: bool,
             context: list[list[int]] | None = None) -> GenerationRequest:
    constraint: Constraint | None = seq["constraint"]
    grammar = None if constraint is None else compiler.new_state(constraint.grammar, fast_forward=seq["fast_forward"])
    prompt = tokenizer.encode("Answer in JSON. " + seq["prompt"])
    spec = SpeculationParams(enabled=drafting, max_draft=seq["max_draft"], fast_forward=seq["fast_forward"])
    return GenerationRequest(prompt, params, spec, context or [], grammar=grammar)


def _run(engine: Engine, requests: list[GenerationRequest], start_steps: list[int]) -> list[Generation]:
    """Step the requests together, each joining at its start step, until all have finished."""
    generations: list[Generation | None] = [None] * len(requests)
    step = 0
    while True:
        for i, request in enumerate(requests):
            if generations[i] is None and start_steps[i] <= step:
                generations[i] = engine.start(request)
        running = [g for g in generations if g is not None and not g.finished]
        if not running and all(g is not None for g in generations):
            return generations  # type: ignore[return-value]
        if running:
            engine.step(running)
        step += 1
        assert step < 2000, "the engine made no progress"


def _text(generation: Generation, tokenizer) -> str:
    emitted = [t for t in generation.output_ids if t not in generation.stop_token_ids]
    return tokenizer.decode(emitted)


def test_engine_step_survives_any_draft_and_constrained_outputs_validate(embedded_tokenizer, compiler, tiny_forward):
    """Over grammars, drafts, sizers, batches and sampling (see the module docstring): no
    exception, finished constrained outputs validate, output equal to drafting off."""
    tokenizer = embedded_tokenizer
    schemas = _schemas()
    closers = sorted({t for text in CLOSERS for t in tokenizer.encode(text)[:1]})
    eos = min(tokenizer.eos_token_ids)
    totals: Counter = Counter()

    @settings(max_examples=EXAMPLES or 40, deadline=None, derandomize=not EXAMPLES, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(batch=st.lists(sequences(compiler, schemas, closers), min_size=1, max_size=3),
           sizing=st.sampled_from(["whole", "whole", "policy", "random"]), prefill_chunk=st.sampled_from([512, 8]),
           data=st.data())
    def check(batch, sizing, prefill_chunk, data):
        cost = fixed_cost_curve(MAX_DRAFT + 1)
        plain_engine = Engine(tiny_forward, tokenizer, DraftingConfig(enabled=False), None, prefill_chunk)
        # 1. Each request alone without drafting and without stop strings: the oracle drafts copy
        #    it, and stop strings are drawn from its text.
        firsts = []
        for seq in batch:
            first = _run(plain_engine, [_request(tokenizer, compiler, seq, SamplingParams(**seq["params"]), False)], [0])[0]
            firsts.append(first)
            if seq["stop_at"] is not None and _text(first, tokenizer):
                text = _text(first, tokenizer)
                where, length = seq["stop_at"]
                start = min(int(where * len(text)), len(text) - 1)
                seq["params"] = {**seq["params"], "stop": (text[start : start + length],)}
        params = [SamplingParams(**seq["params"]) for seq in batch]
        # 2. The reference: each request alone, drafting off, with its stop strings.
        references = [_run(plain_engine, [_request(tokenizer, compiler, seq, p, False)], [0])[0]
                      for seq, p in zip(batch, params)]
        # 3. All of them together, drafting on.
        rng = random.Random(data.draw(st.integers(0, 2**16)))

        def random_sizer(slots: Sequence[DraftSlot]) -> list[int]:
            return [rng.randint(0, len(slot.draft)) for slot in slots]

        drafting = DraftingConfig(method="property-mix", adaptive=sizing == "policy", max_draft=MAX_DRAFT)
        engine = Engine(tiny_forward, tokenizer, drafting, cost, prefill_chunk,
                        sizer=random_sizer if sizing == "random" else None)
        requests, scripts = [], []
        for seq, p, first in zip(batch, params, firsts):
            tail = {"eos": [eos], "random": [rng.randrange(tokenizer.vocab_size) for _ in range(4)],
                    "eos+random": [eos, rng.randrange(tokenizer.vocab_size), eos], "none": []}[seq["tail"]]
            # The n-gram drafter copies from the output and its tail too, as from a Predicted Output.
            request = _request(tokenizer, compiler, seq, p, True, [list(first.output_ids) + tail])
            requests.append(request)
            scripts.append(Script(seq["kinds"], list(first.output_ids), tail, len(request.prompt_ids), request.grammar,
                                  random.Random(seq["rng_seed"]), tokenizer.vocab_size, tokenizer))
        order = sorted(range(len(batch)), key=lambda i: batch[i]["start_step"])
        _SCRIPTS[:] = [scripts[i] for i in order]
        generations = _run(engine, requests, [batch[i]["start_step"] for i in range(len(batch))])
        assert not _SCRIPTS
        for seq, gen, ref, script in zip(batch, generations, references, scripts):
            # Output equals drafting off.
            assert gen.output_ids == ref.output_ids, (repr(seq), sizing, prefill_chunk, gen.output_ids, ref.output_ids)
            assert gen.finish_reason == ref.finish_reason
            assert _text(gen, tokenizer) == _text(ref, tokenizer)
            # A finished constrained output satisfies its constraint (with drafting on and off).
            constraint = seq["constraint"]
            stopped_by_string = gen.text.stopped is not None
            if constraint is not None and gen.finish_reason == "stop" and not stopped_by_string:
                reason = constraint.satisfied_by(_text(gen, tokenizer))
                assert reason is None, (constraint.kind, constraint.spec, _text(gen, tokenizer), reason)
                totals[f"valid {constraint.kind}"] += 1
            totals[f"end {constraint.kind if constraint else None} {gen.finish_reason}{' (stop string)' if stopped_by_string else ''}"] += 1
            totals["stop string"] += stopped_by_string
            totals["drafted"] += gen.stats.drafted_tokens
            totals["accepted"] += gen.stats.accepted_tokens
            totals["forced"] += gen.stats.forced_tokens
            totals["seeded" if gen.params.seed is not None else "greedy"] += 1
            totals.update(script.proposals)
        totals["examples"] += 1

    check()
    print("property totals:", dict(totals))
    # Not vacuous: drafts were made, kept and rejected; grammars forced tokens; every kind of
    # draft and of finished constraint was seen; drafts ran past the end of the output.
    assert totals["accepted"] > 50 and totals["drafted"] > totals["accepted"]
    assert totals["forced"] > 0 and totals["stop string"] > 0
    for kind in ("ngram", "random", "oracle", "corrupt", "forced", "spelled", "past the reference's end"):
        assert totals[f"draft {kind}"] > 0, kind
    for kind in ("json_schema", "regex", "choice"):
        assert totals[f"valid {kind}"] > 0, kind
    assert totals["greedy"] > 0 and totals["seeded"] > 0


@pytest.mark.parametrize("fast_forward", [True, False])
def test_an_output_cut_by_max_tokens_is_length_even_where_the_grammar_ends_one_token_later(
        embedded_tokenizer, compiler, tiny_forward, fast_forward):
    """The grammar forces "111" (three tokens: SmolLM2 splits digits), and the pass yields one token
    after the forced ones. With room for two, the output stops at two: finish_reason "length",
    never "stop" (it was "stop", for an unfinished output, when the token past the limit completed
    the grammar). Found by the property test above."""
    grammar = compiler.compile("choice", ["111"])
    assert embedded_tokenizer.encode("111") == [33, 33, 33]
    prompt = embedded_tokenizer.encode("Say 111.")
    for drafting in (False, True):
        engine = Engine(tiny_forward, embedded_tokenizer, DraftingConfig(enabled=drafting, adaptive=False), None)
        for max_tokens, finish in ((1, "length"), (2, "length"), (3, "stop"), (4, "stop")):
            result = engine.generate(GenerationRequest(
                prompt, SamplingParams(max_tokens=max_tokens), SpeculationParams(enabled=drafting, fast_forward=fast_forward),
                grammar=compiler.new_state(grammar, fast_forward=fast_forward)))
            assert (result.text, result.finish_reason) == ("111"[:max_tokens], finish), (max_tokens, drafting)
