"""Prefix caching for a hybrid model: which prefixes to keep, and where a request resumes.

Policy over two mechanisms: cached K/V blocks (``BlockPool``, named by chained hashes) and
recurrent-state checkpoints (``CheckpointPool``). A request resumes at position ``p`` only
when both halves of the prefix ``[0, p)`` are there:

    K/V     every full block below p cached or owned under its chain name, and the rows
            of a partial last block in a block whose contents are still known
    state   a checkpoint saved at exactly p (the GDN state cannot be rewound or
            advanced without recomputing the tokens)

``match`` picks the longest such ``p`` up to the request's token count. Below it, the
request recomputes its tokens from ``p`` on, the last one yielding the logits of its next
token. At it (an identical prompt sent again, or any request whose whole token sequence
is a checkpointed prefix) nothing is left to compute: its next token's distribution is
the logits of its last token, which the forward pass that computed the checkpoint's state
produced. A checkpoint saved right after its forward pass therefore keeps that pass's
logits row (``CheckpointPool``; one float32 row of the vocabulary, 1 MB at 248K tokens,
under 1% of a 27B-shape checkpoint's state and counted in its bytes), and a match at the
full length needs that row. The request then runs a zero-token chunk: the engine forwards
nothing for it and samples its first token from a copy of the stored row
(``logits_with_cached_rows``), through the same sampler as a computed row, so penalties,
logprobs, grammars and seeds apply unchanged; it decodes from its full length after. The
zero-token chunk never enters a forward batch (CUDA graphs see the same batches as
without it), a step of only such chunks runs no forward pass, and with async scheduling
the decode step after it is launched ahead from its sampled token as after any prefill.

The alternative, a second checkpoint at ``L - 1`` so that the last token is recomputed,
is not taken: the prefill would stop one token short of every prompt's end to save it
(one more forward step on every prompt's time to first token), each such checkpoint
costs a whole state (150 MB for the 27B shape) instead of a row, and a hit still
recomputes a token. Checkpoints saved when a request finishes or is preempted have no row
(the logits of their last token were sampled steps earlier): a request whose tokens end
exactly there resumes at the longest checkpoint below. A preempted request is never such
a one: its last sampled token was not fed back, so its own checkpoint is one token short.

Checkpoints are saved:

* at the end of every prompt, at its exact length;
* every ``checkpoint_interval`` tokens of a prompt;
* where a request's tokens leave the cached K/V chain beyond its resume point (the last
  full block it shares): the branch point of prompts that share a system prompt, or of
  a whole prompt sent again after its end checkpoint was evicted, so that every later
  one resumes there;
* when a request finishes or is preempted, at its computed length (prompt plus the
  output tokens fed back), unless a forward pass of it is still in flight.

An interval position or the branch point inside a prefill chunk is a state tap
(``model/state_taps.py``): the state there is copied into a spare state slot and saved
from it after the step, and the chunk stays whole. A step has ``num_tap_slots`` spare
slots; a chunk that would pass more checkpoint positions than the step has slots left is
cut at the first one it cannot tap (a chunk boundary is exact too). A chunk short enough
for a prefill CUDA graph is cut at each of its positions instead: the graphs run the
linear layers in one round, and replaying two costs less than one eager step.

With speculative decoding the cache serves the drafter too (``engine/spec_step.py``):

* block names cover the token after each block (``HashChain``'s ``num_next_tokens`` of one),
  since the MTP head's K/V row at a block's end holds that token: a shared block's
  drafter rows are then exact for every request that matches it. A resume point ``p``
  hangs from the ``(p - 1) // block_size`` blocks its tokens name, and the block of row
  ``p - 1`` is always the copied tail;
* each checkpoint keeps the target's hidden state of its last token
  (``CheckpointPool.hidden_row``), and only such checkpoints are resumed from: the request
  gets it as ``resume_hidden``, and the drafter's first rows after the hit start at
  ``p - 1``, rewriting that row (its next token may differ from the one the copied tail
  held) in the request's private tail copy.

A checkpoint is worth the tokens it saves recomputing, halved for every ``half_life``
saves and hits since it was last used, and nothing once its K/V blocks are gone; the
least valuable is evicted when the checkpoint pool is full. A checkpoint that a request
resumed from or saved counts only ``SUPERSEDED_WEIGHT`` of that once the same request
saves a longer one: the conversation it served has moved past it (a next turn resumes at
the longer one), and it stays useful only to a request that leaves the path in between,
such as a resend of the same prompt. Without the discount, each conversation's turn
leaves three fresh checkpoints (the one it resumed from, its prompt's end, its finish)
where one serves its next turn, and at 16 conversations over a 27-checkpoint budget the
finishes themselves get evicted. A hit on a superseded checkpoint lifts the mark.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from pagedserve.engine.request import Request
from pagedserve.kv.checkpoint_pool import Checkpoint, CheckpointPool
from pagedserve.kv.handles import Handle
from pagedserve.kv.kv_manager import KVCacheManager
from pagedserve.kv.memory import GiB
from pagedserve.kv.prefix_hash import HashChain
from pagedserve.kv.state_pool import StatePool

# Recomputing 2048 tokens of a 27B-shape model costs about 0.2 s on an H200, while one
# checkpoint (150 MB) costs about what the f16 K/V of those 2048 tokens does: a checkpoint
# at most doubles a cached prefix's memory and bounds what a reader of a longer shared
# prefix recomputes (docs/ARCHITECTURE.md, "Prefix caching").
DEFAULT_CHECKPOINT_INTERVAL = 2048
# Spare state slots for taps at most (one 27B-shape slot is 150 MB): a chunk that passes
# more interval positions than a step's slots is cut at the first one it cannot tap.
MAX_TAP_SLOTS = 8
# The default checkpoint budget: at most 4 GiB (3% of an H200; 27 checkpoints of the 27B
# shape, more than one per running sequence at the default max-num-seqs) and at most
# max(64, 8 * max_num_seqs) checkpoints (small models).
DEFAULT_CHECKPOINT_MEMORY = 4 * GiB
# A superseded checkpoint's share of its value (module doc): four half-lives. On a CPU
# rerun of the H100 chat workload's shape (16 conversations over 27 checkpoints), the hit
# rate over reusable tokens went from 91% to 97% at 0.25 and 99% at this weight.
SUPERSEDED_WEIGHT = 0.0625


def num_checkpoints_for(memory_bytes: int | None, bytes_per_checkpoint: int,
                        max_num_seqs: int) -> int:
    """Checkpoints that fit ``memory_bytes`` (``None``: the default budget)."""
    if bytes_per_checkpoint == 0:  # no linear-attention layer: a checkpoint is only a key
        return max(64, 8 * max_num_seqs)
    if memory_bytes is not None:
        return memory_bytes // bytes_per_checkpoint
    return min(max(64, 8 * max_num_seqs), DEFAULT_CHECKPOINT_MEMORY // bytes_per_checkpoint)


def tap_slots_for(max_chunk: int, checkpoint_interval: int) -> int:
    """Spare state slots that let a prefill chunk of ``max_chunk`` tokens, wherever it
    starts, take a tap at every interval position it passes (at most ``MAX_TAP_SLOTS``)."""
    return min(MAX_TAP_SLOTS, -(-max_chunk // checkpoint_interval))


@dataclass(frozen=True)
class PrefixHit:
    """Resume at ``num_tokens``: share ``full_blocks``, copy ``tail_block`` (the rows past
    the last full block, ``None`` when block-aligned) and restore ``checkpoint``."""

    num_tokens: int
    full_blocks: list[int]
    tail_block: int | None
    checkpoint: Checkpoint


@dataclass(frozen=True)
class PrefixMatch:
    """What ``match`` found: where to resume (if anywhere) and how many leading tokens
    have cached K/V (full blocks only), resumable or not."""

    hit: PrefixHit | None
    num_kv_tokens: int


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # tokens looked up at admissions
    num_hits: int = 0  # of which resumed from the cache


class PrefixCache:
    """Matching and checkpoint policy over one K/V manager, state pool and checkpoint pool.

    Args:
        kv: the sequences' K/V manager (its pool holds the cached blocks).
        states: the running sequences' state slots.
        checkpoints: the checkpoint pool (capacity 0 disables reuse: nothing can resume).
        salt: the hash chain's root (``prefix_hash.salt_of`` over model and K/V types).
        checkpoint_interval: tokens between checkpoints inside a long prompt.
        num_tap_slots: spare state slots for checkpoints inside a step's prefill chunks
            (``states`` holds them beyond its running sequences' slots; 0: chunks are
            cut at every interval position instead).
        speculative: serve a drafter too (the module docstring): block names cover the
            next token, and only checkpoints with a hidden row are resumed from.
    """

    def __init__(self, kv: KVCacheManager, states: StatePool, checkpoints: CheckpointPool,
                 salt: int, checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL,
                 speculative: bool = False, num_tap_slots: int = 0,
                 graphed_chunk_tokens: int = 0) -> None:
        if checkpoint_interval <= 0:
            raise ValueError(f"prefix-checkpoint-interval must be > 0, got "
                             f"{checkpoint_interval}")
        self.kv = kv
        self.states = states
        self.checkpoints = checkpoints
        self.salt = salt
        self.block_size = kv.block_size
        self.checkpoint_interval = checkpoint_interval
        self.num_tap_slots = num_tap_slots
        # Prefill chunks of up to this many rows replay a prefill CUDA graph, which runs
        # the linear layers in one round: such a chunk is cut at its checkpoint positions
        # instead of tapped, since a short step is bound by the host's launches and two
        # replays cost less than one eager step (engine/prefill_graphs.py).
        self.graphed_chunk_tokens = graphed_chunk_tokens
        self.speculative = speculative
        self.num_next_tokens = int(speculative)
        self.half_life = max(16, 2 * checkpoints.num_checkpoints)
        checkpoints.value = self._value
        self.stats = PrefixCacheStats()

    # ---- matching -----------------------------------------------------------------------
    def chain(self, req: Request, num_tokens: int) -> HashChain:
        """``req``'s block names, extended to cover ``num_tokens`` tokens."""
        if req.prefix_chain is None:
            req.prefix_chain = HashChain(self.salt, self.block_size, self.num_next_tokens)
        req.prefix_chain.extend(num_tokens, req.token_slice)
        return req.prefix_chain

    def match(self, req: Request) -> PrefixMatch:
        """The longest cached prefix of ``req``'s tokens: all of them only with a stored
        logits row (``Checkpoint.has_logits``), which yields the next token's."""
        limit = req.num_tokens
        bs = self.block_size
        chain = self.chain(req, limit)
        blocks: list[int] = []
        for i in range(chain.num_blocks):
            b = self.kv.pool.lookup(chain.block_name(i))
            if b is None:
                break
            blocks.append(b)
        for i in range(len(blocks), -1, -1):
            best: tuple[Checkpoint, int | None] | None = None
            for entry in self.checkpoints.under(chain.parents[i]):
                p = entry.num_tokens
                if (not i * bs <= p <= limit or (best and p <= best[0].num_tokens)
                        or (p == limit and not entry.has_logits)
                        or (self.speculative and not entry.has_hidden)):
                    continue
                tail = self._tail(entry, blocks, i)
                if (p == i * bs or tail is not None) and entry.key == chain.key_at(
                        p, req.token_slice):
                    best = (entry, tail)
            if best is not None:
                entry, tail = best
                return PrefixMatch(PrefixHit(entry.num_tokens, blocks[:i], tail, entry),
                                   len(blocks) * bs)
        return PrefixMatch(None, len(blocks) * bs)

    def _tail(self, entry: Checkpoint, blocks: list[int], i: int) -> int | None:
        """The block holding ``entry``'s rows past full block ``i``, if any is known."""
        if entry.num_tokens == i * self.block_size:
            return None
        if i < len(blocks):
            return blocks[i]  # a full cached block with the same leading tokens
        if entry.tail is not None and self.kv.pool.holds(*entry.tail):
            return entry.tail[0]
        return None

    def resume(self, req: Request, hit: PrefixHit) -> Handle | None:
        """A K/V sequence for ``req`` holding ``hit``'s prefix (``None`` if blocks or rows
        are short); the caller restores the state once ``req`` has a slot."""
        return self.kv.create_from_prefix(hit.full_blocks, hit.num_tokens, hit.tail_block)

    def restore(self, req: Request, hit: PrefixHit, state_slot: int) -> None:
        """Copy ``hit``'s state into ``req``'s slot ``state_slot``; when ``hit`` covers all
        of ``req``'s tokens, also a copy of its logits row into ``req.cached_logits``;
        when it keeps a hidden row, a copy into ``req.resume_hidden``."""
        self.checkpoints.restore(hit.checkpoint, self.states, state_slot)
        hit.checkpoint.superseded = False
        req.checkpoints_on_path.append(hit.checkpoint)
        if hit.num_tokens == req.num_tokens:
            req.cached_logits = self.checkpoints.logits_row(hit.checkpoint)
        if hit.checkpoint.has_hidden:
            req.resume_hidden = self.checkpoints.hidden_row(hit.checkpoint)
            req.last_hidden = (hit.num_tokens, req.resume_hidden)

    def count(self, num_queried: int, num_hit: int) -> None:
        """An admission looked up ``num_queried`` tokens and resumed after ``num_hit``."""
        self.stats.num_queries += num_queried
        self.stats.num_hits += num_hit

    # ---- what to keep -------------------------------------------------------------------
    def set_branch(self, req: Request, match: PrefixMatch) -> None:
        """Checkpoint ``req`` where it leaves the cached K/V chain, if past its resume
        point (``req.checkpoint_branch``, 0: nowhere)."""
        resume = match.hit.num_tokens if match.hit is not None else 0
        req.checkpoint_branch = match.num_kv_tokens if match.num_kv_tokens > resume else 0

    def chunk_limit(self, req: Request, start: int, n: int, num_taps: int = 0) -> int:
        """``n`` cut so that a prefill chunk from ``start`` passes at most ``num_taps``
        checkpoint positions (each a state tap), none if a prefill graph holds ``n`` rows:
        it ends at the first one past those."""
        if n <= self.graphed_chunk_tokens:
            num_taps = 0
        end = start + n
        taps = self.tap_positions(req, start, end)
        if len(taps) > num_taps:
            end = taps[num_taps]
        return end - start

    def tap_positions(self, req: Request, start: int, end: int) -> list[int]:
        """The checkpoint positions strictly inside a prefill chunk ``[start, end)`` of
        ``req``'s prompt, ascending: each interval position and the branch point, where
        the state is checkpointed from a tap."""
        stop = min(end, req.num_prompt_tokens)
        if stop - start < 2:
            return []  # a decode row, or rows past the prompt: nothing strictly inside
        step = self.checkpoint_interval
        first = (start // step + 1) * step
        taps = list(range(first, stop, step))
        branch = req.checkpoint_branch
        if start < branch < stop and branch % step:
            bisect.insort(taps, branch)
        return taps

    def take_taps(self, req: Request, start: int, end: int) -> list[tuple[int, Handle]]:
        """A spare state slot for each tap position of chunk ``[start, end)``: ``(position,
        slot handle)`` pairs, which ``save_taps`` saves and gives back."""
        return [(p, self.states.acquire()) for p in self.tap_positions(req, start, end)]

    def save_taps(self, req: Request, taps: list[tuple[int, Handle]],
                  hidden: list[torch.Tensor] | None = None) -> None:
        """Checkpoint each of ``taps`` (their step queued) from its slot, with ``hidden``
        rows (one per tap: the final hidden state of the token before it) if given, and
        give the slots back. A tap's checkpoint has no logits row (a prompt that ends
        exactly there resumes at the checkpoint below)."""
        for j, (p, handle) in enumerate(taps):
            self.save(req, p, hidden=hidden[j] if hidden is not None else None,
                      state_slot=self.states.slot(handle))
            self.states.release(handle)

    def wants_checkpoint(self, req: Request, start: int, end: int) -> bool:
        """Whether the state after a prefill chunk ``[start, end)`` is saved."""
        return start < req.num_prompt_tokens and (
            end == req.num_prompt_tokens or end == req.checkpoint_branch
            or end % self.checkpoint_interval == 0)

    def save(self, req: Request, end: int, logits: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None, state_slot: int | None = None) -> None:
        """Save ``req``'s state after ``end`` tokens, which its state slot holds (or
        ``state_slot``, a tap's), with ``logits`` (``[vocab]`` float32), those of token
        ``end - 1``, and ``hidden`` (``[H]``), that token's final hidden state, if given."""
        if self.checkpoints.num_checkpoints == 0:
            return
        chain = self.chain(req, end)
        handle = req.live_kv_handle
        num_full = chain.blocks_at(end)
        tail = None
        if end > num_full * self.block_size:
            block = self.kv.block_at(handle, end - 1)
            tail = (block, self.kv.pool.epoch(block))
        # The shorter checkpoints on req's path are superseded before the save, so that
        # room for the new one is taken from them first.
        for older in req.checkpoints_on_path:
            older.superseded = older.superseded or older.num_tokens < end
        entry = self.checkpoints.save(
            chain.key_at(end, req.token_slice), end, chain.parents[num_full], tail,
            self.states, self.states.slot(req.live_state_handle) if state_slot is None
            else state_slot, logits, hidden)
        req.checkpoints_on_path = [c for c in req.checkpoints_on_path if c.num_tokens > end]
        if entry is not None:
            req.checkpoints_on_path.insert(0, entry)

    def on_commit(self, req: Request) -> None:
        """Name ``req``'s committed full blocks, so that other requests can find them."""
        handle = req.live_kv_handle
        n = self.kv.num_tokens(handle)
        chain = self.chain(req, min(n + self.num_next_tokens, req.num_tokens))
        self.kv.name_full_blocks(handle, chain.parents[1:])

    def on_release(self, req: Request, save_state: bool) -> bool:
        """``req`` leaves (finished, preempted or aborted) with ``num_computed_tokens``
        tokens computed; with ``save_state`` its slot holds their state. Returns whether
        the block of its last token must stay cached although no name may cover it (a
        checkpoint's tail ends inside it)."""
        self.on_commit(req)
        n = req.num_computed_tokens
        if not save_state or n == 0:
            return False
        hidden = None
        if req.last_hidden is not None and req.last_hidden[0] == n:
            hidden = req.last_hidden[1]
        self.save(req, n, hidden=hidden)
        return n > self.chain(req, n).blocks_at(n) * self.block_size

    def _value(self, c: Checkpoint, now: int) -> float:
        if c.parent != self.salt and self.kv.pool.lookup(c.parent) is None:
            return -1.0  # its K/V prefix is gone: it can never be used
        weight = SUPERSEDED_WEIGHT if c.superseded else 1.0
        return weight * c.num_tokens * 0.5 ** ((now - c.last_used) / self.half_life)

    def reset(self) -> None:
        """Forget every cached block and checkpoint (running sequences keep theirs)."""
        self.kv.pool.clear_cache()
        self.checkpoints.clear()
        self.stats = PrefixCacheStats()

    def check_invariants(self) -> None:
        self.checkpoints.check_invariants()


def logits_with_cached_rows(logits: torch.Tensor | None, reqs: list[Request]) -> torch.Tensor:
    """A step's logits: ``logits`` (``[B, V]``, the forward pass's rows; ``None`` when the
    step forwards nothing) followed by the stored row of each of ``reqs``, which resumed
    with every token cached (``PrefixCache.restore``). Each request's row is used once."""
    rows = []
    for req in reqs:
        if req.cached_logits is None:
            raise RuntimeError(f"request {req.request_id} forwards no token and has no "
                               "stored logits row")
        rows.append(req.cached_logits)
        req.cached_logits = None
    cached = torch.stack(rows)
    return cached if logits is None else torch.cat([logits, cached])
