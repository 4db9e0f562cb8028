"""Compiling GrammarSpecs for the reference engine with llguidance, cached and bounded.

One compiler per engine (rank 0). `prepare` compiles a spec (cached by its key, LRU) and is
called off the engine thread before a request is queued; `matcher` hands the engine thread a
copy of the cached matcher, which costs microseconds. Work is bounded by llguidance's parser
limits (lexer fuel per step, Earley items, lexer states: time and memory), and a spec whose
grammar exceeds them or is invalid is a `GrammarError` naming the request field — a 400,
never a stalled batch. Tool schemas are the exception (K3's API: a valid JSON Schema in
`tools` is never a 400): a tool whose schema cannot be compiled keeps the call structure with
free arguments, and the compiler says which tools it relaxed.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import llguidance
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from serve_app.grammar.lark import json_rule, lark_grammar
from serve_app.grammar.recursion import bound_recursion
from serve_app.protocol.grammar import GrammarSpec, ToolSpec
from serve_app.tokenizer import Tokenizer

# Bounds on one grammar's work (llguidance's defaults, lower where they cost memory): a mask
# step spends at most ~15 ms of lexer fuel and 50k Earley items; at most 50k lexer states
# (~100 MB); a grammar of at most 200k symbols (a 10 MB schema is refused by this).
LIMITS = dict(step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=50_000,
              max_grammar_size=200_000, initial_lexer_fuel=1_000_000)
# How many `$ref`s deep a recursive schema may nest (recursion.py): far deeper than the
# arguments and answers agents ask for, and it leaves a model that keeps recursing room to
# close within a few hundred tokens.
MAX_REF_DEPTH = 32


class GrammarError(ValueError):
    """A constraint the engine cannot compile; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[type[GrammarError], tuple[str, str]]:
        # It crosses from the target replica to the ingress (Ray pickles it by its args).
        return GrammarError, (self.param, self.message)


@dataclass
class GrammarStats:
    """Counters the engine's telemetry reads (observability: grammar compile time, cache)."""

    compiled: int = 0
    cache_hits: int = 0
    failed: int = 0
    compile_seconds: float = 0.0  # summed over `compiled`


class _VocabularyBytes:
    """The tokenizer as llguidance's TokenizerWrapper reads it: every id's bytes (control
    tokens by their text, marked special), an encoder, the EOS ids."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        self.special_token_ids = [i for i in range(vocab_size) if vocabulary_special(tokenizer, i)]
        self.tokens = [vocabulary_bytes(tokenizer, i) for i in range(vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode_text(text)


def vocabulary_special(tokenizer: Tokenizer, i: int) -> bool:
    try:
        return tokenizer.is_special(i)
    except Exception:
        return False


def vocabulary_bytes(tokenizer: Tokenizer, i: int) -> bytes:
    # Ids past the tokenizer's vocabulary (a model's padded embedding) are empty: never allowed.
    try:
        return tokenizer.token_bytes(i)
    except Exception:
        return b""


def allowed_bits(matcher: LLMatcher, vocab_size: int) -> np.ndarray:
    """The matcher's allowed next ids as 0/1 bytes [vocab_size] (llguidance packs them)."""
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                         bitorder="little")[:vocab_size]


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: Iterable[int]) -> LLTokenizer:
    """The model's vocabulary for llguidance (~0.5 s for K3's 163,840 ids: build once)."""
    eos_ids = sorted(set(eos))
    wrapper = llguidance.TokenizerWrapper(_VocabularyBytes(tokenizer, vocab_size, eos_ids))
    return LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos_ids)


class GrammarCompiler:
    def __init__(self, tokenizer: LLTokenizer, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.cache_size = cache_size
        self.stats = GrammarStats()
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # prepare runs on worker threads, matcher on the engine's

    def prepare(self, spec: GrammarSpec) -> None:
        """Compile `spec` into the cache unless it is there (call off the engine thread)."""
        with self._lock:
            if spec.key in self._cache:
                self._cache.move_to_end(spec.key)
                self.stats.cache_hits += 1
                return
        start = time.perf_counter()
        try:
            matcher = self._compile(spec)
        except GrammarError:
            with self._lock:
                self.stats.failed += 1
            raise
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[spec.key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def matcher(self, spec: GrammarSpec) -> LLMatcher:
        """A fresh matcher for one request (compiled now if `prepare` was not called)."""
        with self._lock:
            template = self._cache.get(spec.key)
        if template is None:
            self.prepare(spec)
            with self._lock:
                template = self._cache[spec.key]
        return template.deep_copy()

    def _build(self, grammar: str) -> LLMatcher | str:
        """A matcher, or the compiler's error text."""
        matcher = LLMatcher(self.tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0,
                            limits=LLParserLimits(**LIMITS))
        return matcher.get_error() if matcher.is_error() else matcher

    def _compile(self, spec: GrammarSpec) -> LLMatcher:
        spec = self._resolvable(spec)
        built = self._build(lark_grammar(spec))
        if isinstance(built, str) and spec.tools:
            # Only a failed grammar is taken apart: a tool whose call does not compile alone
            # (its rules are a part of the whole) keeps the call with free arguments.
            relaxed = frozenset(t.name for t in spec.tools
                                if t.strict and not self._compiles(spec, t))
            if relaxed:
                built = self._build(lark_grammar(spec, relaxed))
        if isinstance(built, str):
            raise GrammarError(spec.param, f"cannot be compiled to a grammar: {_short(built)}")
        return built

    def _resolvable(self, spec: GrammarSpec) -> GrammarSpec:
        """`spec` with each schema as the engine enforces it.

        - `$id`s are dropped from a schema that compiles only without them. A validator given
          the schema document alone resolves its `#/...` references in that document;
          llguidance instead resolves them against an `$id` that is no URI ("anyOf with refs")
          or is one it would have to fetch, and fails (4 of KVV's walle schemas).
        - A recursive schema is unfolded to `MAX_REF_DEPTH` (recursion.py), when the unfolding
          compiles; else it is enforced unbounded."""
        def fixed(schema: Any) -> Any:
            if _has_id(schema) and not self._json_compiles(schema):
                plain = _without_ids(schema)
                schema = plain if self._json_compiles(plain) else schema
            bounded = bound_recursion(schema, MAX_REF_DEPTH)
            if bounded is not schema and self._json_compiles(bounded):
                return bounded
            return schema

        if spec.kind == "json_schema" and spec.strict:
            spec = replace(spec, schema=fixed(spec.schema))
        tools = tuple(replace(t, parameters=fixed(t.parameters)) if t.strict else t
                      for t in spec.tools)
        return replace(spec, tools=tools) if tools != spec.tools else spec

    def _json_compiles(self, schema: Any) -> bool:
        return not isinstance(self._build(f"start: {json_rule(schema)}\n"), str)

    def _compiles(self, spec: GrammarSpec, tool: ToolSpec) -> bool:
        """Whether a strict tool's call grammar compiles on its own (the same rules the
        request's grammar uses for it)."""
        alone = replace(spec, tools=(tool,), optional_calls=False)
        return not isinstance(self._build(lark_grammar(alone)), str)


def _has_id(schema: Any) -> bool:
    return '"$id"' in json.dumps(schema)


def _without_ids(schema: Any) -> Any:
    """The schema with every `$id` keyword removed (property names are kept: only the
    keyword inside a schema object goes)."""
    if isinstance(schema, list):
        return [_without_ids(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$id" and isinstance(value, str):
            continue
        # Under these keys the values are maps of names to schemas, not schemas themselves.
        if key in ("properties", "$defs", "definitions", "patternProperties") \
                and isinstance(value, dict):
            out[key] = {k: _without_ids(v) for k, v in value.items()}
        else:
            out[key] = _without_ids(value)
    return out


def _short(error: str, limit: int = 300) -> str:
    """The compiler's message, bounded and without the grammar excerpt it quotes (the
    project's own grammar text is no business of the client's)."""
    first = " ".join(error.splitlines()[0].split()) if error.strip() else "invalid"
    return first if len(first) <= limit else first[: limit - 3] + "..."
