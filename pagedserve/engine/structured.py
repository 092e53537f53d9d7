"""Structured outputs: grammars that constrain a request's tokens, through xgrammar.

A request's constraint is a ``GrammarSpec``: one xgrammar structural tag, as canonical JSON
(a JSON schema, a regex, a set of choices or the model's tool-call syntax, optionally after a
free reasoning block; ``server/constraints.py`` builds them). ``StructuredOutputs`` compiles a
spec once and keeps the result in an LRU cache keyed by the spec; it runs in the caller's
thread, so a bad schema fails before the request is queued and the engine thread never
compiles. Each request gets its own ``RequestGrammar``: a matcher holding the grammar's state
after the tokens generated so far.

One step, for the rows that sample (``LLMEngine._launch``)::

    host    fill the bitmask rows of constrained requests     int32 [B, ceil(V / 32)]
            (bit t of row b set: token t allowed) while the device runs the forward pass
            (its launch returns at once), into pinned memory; unconstrained rows stay all ones
    device  disallowed logits -> -inf (``sampler.apply_token_bitmask``), then sampling
    host    after the read-back: ``accept(token)``; a grammar that has terminated ends the
            request

So constrained and unconstrained requests share a batch, and the mask costs the device one
elementwise pass over the logits. With async scheduling a constrained step's forward pass
is launched ahead as any other; its sampling waits until the previous step's tokens have
advanced the grammars (``lookahead.py``).

A speculative verify step scores ``d + 1`` rows of one request: ``bitmask_along`` gives
each row the mask of the grammar's state after the drafts before it, walking the matcher
forward and rolling it back, so the verify decision keeps only drafts the grammar accepts
and replaces the first it refuses by an allowed token (``engine/spec_step.py``).

The tokenizer's special tokens that the detokenizer drops (``<|im_start|>``...) are never
allowed inside a grammar, so the text the client sees is the text the grammar matched; the
model's EOS ids are the grammar's stop tokens.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

MAX_CACHED_GRAMMARS = 256
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "
# xgrammar lowers a JSON string with minLength / maxLength to a bounded repetition of the
# class [^"\\\r\n], which lets raw control characters in (invalid JSON) and every escape
# out (mlc-ai/xgrammar#800). Each use of that class is rewritten to one JSON character.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'([^\0-\x1f\"\\] | "\\" basic_escape)'


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: an xgrammar structural tag as canonical JSON.

    ``structural_tag`` is ``{"type": "structural_tag", "format": {...}}`` serialized with
    sorted keys, so equal constraints are equal specs (and share one compiled grammar).
    """

    structural_tag: str

    @classmethod
    def of_format(cls, fmt: dict[str, Any]) -> GrammarSpec:
        tag = {"type": "structural_tag", "format": fmt}
        return cls(json.dumps(tag, sort_keys=True, ensure_ascii=False))


def _special_token_ids(tokenizer: Any) -> list[int]:
    """Ids the detokenizer skips (``skip_special_tokens``)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = {i for i, tok in added.items() if getattr(tok, "special", False)}
    return sorted(ids | set(getattr(tokenizer, "all_special_ids", []) or []))


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of ``tokenizer``: each id's bytes, special ids blanked (never allowed
    as text), ``vocab_size`` the model's logits width, ``stop_token_ids`` the EOS ids."""
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            encoded[i] = token
    for i in _special_token_ids(tokenizer):
        if i < vocab_size:
            encoded[i] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids,
                             add_prefix_space=detected.add_prefix_space)


def json_schema_grammar(schema: Any, max_whitespace_cnt: int | None) -> str:
    """The EBNF grammar of ``schema`` (strict, any whitespace up to the bound), with every
    length-bounded string's characters made valid JSON characters."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=True, strict_mode=True,
        max_whitespace_cnt=max_whitespace_cnt))
    if _BOUNDED_STRING_CHAR in ebnf:
        if "basic_escape ::=" not in ebnf:
            raise RuntimeError("xgrammar's JSON grammar has no basic_escape rule")
        ebnf = ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
    return ebnf


def lower_json_schemas(node: Any) -> Any:
    """``node`` (a structural-tag format tree) with each JSON-style ``json_schema`` format
    replaced by its corrected grammar (``json_schema_grammar``)."""
    if isinstance(node, list):
        return [lower_json_schemas(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        return {"type": "grammar", "grammar": json_schema_grammar(
            node["json_schema"], node.get("max_whitespace_cnt"))}
    return {k: lower_json_schemas(v) for k, v in node.items()}


class RequestGrammar:
    """One request's grammar state (an xgrammar ``GrammarMatcher``)."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing may follow."""
        return bool(self.matcher.is_terminated())


class StructuredOutputs:
    """The grammar compiler for one model's tokenizer, its cache, and the step's bitmask.

    Thread-safe: routes compile from worker threads while the engine thread fills masks.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_num_seqs: int, device: torch.device) -> None:
        import xgrammar as xgr

        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, and this model has none")
        self.vocab_size = vocab_size
        self.info = build_tokenizer_info(tokenizer, vocab_size, list(stop_token_ids))
        # xgrammar's worker threads spin while they wait, which starves torch's own CPU
        # threads: on the CPU device (where torch runs the model) it gets one thread; on
        # CUDA, where the host only launches work, a few of the machine's cores.
        threads = 1 if device.type == "cpu" else min(4, max(1, (os.cpu_count() or 1) // 4))
        # xgrammar's own cache is off: ours is keyed by the spec and bounded by count.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads,
                                             cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and metrics
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._masks = BitmaskBuffers(max_num_seqs, vocab_size, device)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec`` (cached); ``ValueError`` naming the problem."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            try:
                tag = lower_json_schemas(json.loads(spec.structural_tag))
                compiled = self._compiler.compile_structural_tag(json.dumps(tag))
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError & co.
                message = _CPP_PREFIX.sub("", str(exc).strip())
                raise ValueError(f"invalid constraint: {message}") from None
            self.num_compiled += 1
            self._cache[spec] = compiled
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return compiled

    def new_grammar(self, spec: GrammarSpec) -> RequestGrammar:
        return RequestGrammar(self.compile(spec))

    def fill_bitmask(self, grammars: list[RequestGrammar | None]) -> torch.Tensor | None:
        """The allowed-token bitmask of one step's sampling rows, on the device (int32
        ``[B, ceil(V / 32)]``), or ``None`` when no row is constrained."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        host = self._masks.next_host(len(grammars))  # [B, W], all ones
        self._batch.batch_fill_next_token_bitmask(
            [grammars[i].matcher for i in rows], host, rows)  # type: ignore[union-attr]
        return self._masks.to_device(host)


    def bitmask_along(self, grammar: RequestGrammar, token_ids: list[int]) -> torch.Tensor:
        """What ``grammar`` allows before each of ``token_ids`` and after the last: int32
        ``[n + 1, ceil(V / 32)]`` on the device, row ``j`` its mask after tokens
        ``0 .. j - 1`` (a speculative verify step's rows, ``token_ids`` its drafts).

        The matcher walks the tokens while it accepts them and is rolled back after, so it
        ends where it began. Past a token it refuses (which the row before already
        excludes) or past its termination, the rows repeat the last one filled: no
        decision reads them. The host rows are a fresh tensor, so that no later fill can
        overwrite them while their copy to the device is queued."""
        n = len(token_ids)
        host = torch.full((n + 1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        matcher, walked = grammar.matcher, 0
        for j in range(n + 1):
            if j and matcher.is_terminated():
                host[j:] = host[j - 1]
                break
            matcher.fill_next_token_bitmask(host, j)
            if j == n or not matcher.accept_token(token_ids[j]):
                host[j + 1:] = host[j]
                break
            walked += 1
        if walked:
            matcher.rollback(walked)
        return host.to(self._masks.device)


class BitmaskBuffers:
    """Host bitmask buffers (pinned on CUDA, two used in turn so that one step's copy to
    the device may still be reading one while the next step fills the other)."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        width = (vocab_size + 31) // 32
        pin = device.type == "cuda"
        self._host = [torch.full((max_rows, width), -1, dtype=torch.int32, pin_memory=pin)
                      for _ in range(2)]
        self._turn = 0
        self.device = device

    def next_host(self, num_rows: int) -> torch.Tensor:
        buf = self._host[self._turn][:num_rows]  # [B, W]
        self._turn ^= 1
        buf.fill_(-1)
        return buf

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return host.clone()
        return host.to(self.device, non_blocking=True)
