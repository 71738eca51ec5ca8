"""Structured outputs on xgrammar: compile a request's constraint once, follow each sequence's
accepted tokens with a matcher, and mask the logits of constrained rows.

    StructuredOutputsParams ──compile (cached by schema text)──▶ CompiledGrammar
    per sequence: GrammarMatcher, advanced by the tokens the scheduler accepted
    per step: one int32 bitmask [rows, ceil(vocab / 32)], filled for constrained rows only
              and applied in place to those rows' logits (tessera/kernels/token_mask.py)

Why here and not in the scheduler: the mask is needed where the logits are, and a matcher that
follows the *accepted* tokens (the scheduler's diffs, `tessera/worker/input_batch.py`) is rebuilt
by replay whenever a request is resent whole (resume after preemption, a forked child). Rows
without a constraint pay nothing: no bitmask is allocated when no row has one.

xgrammar is imported on first use, so an engine that never sees a constraint never loads it.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch

from tessera.kernels import token_mask
from tessera.kernels.token_mask import apply_bitmask_, unpack_bitmask
from tessera.sampling.structured_outputs import StructuredOutputsParams

__all__ = ["DraftWalk", "GrammarBackend", "GrammarState", "ReasoningGate", "apply_grammar_masks",
           "unpack_bitmask"]

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:94: " and sometimes a failed check
_INTERNAL_PREFIX = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
_MAX_ERROR_CHARS = 300


def _xgrammar():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - the Makefile installs it
        raise ValueError("structured_outputs needs the xgrammar package (pip install xgrammar)"
                         ) from None
    return xgrammar


class GrammarBackend:
    """One per tokenizer: the xgrammar tokenizer info and compiler, and a cache of compiled
    grammars. Thread-safe: the server compiles in a worker thread (to validate a request before
    it reaches the engine) while the engine thread builds matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: dict[tuple[str, str], Any] = {}

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer, and this "
                                     "model has none")
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=list(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                token_mask.prepare()
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; a `ValueError` naming the field for an invalid constraint."""
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind == "json":
                # compact separators: a small model given free whitespace can loop on newlines
                compiled = compiler.compile_json_schema(params.schema_text, any_whitespace=False)
            elif kind == "json_object":  # any object, with the same compact separators
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(params.choice or ()))
            else:
                compiled = compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_clean(e)}") from None
        with self._lock:
            self._cache[key] = compiled
        return compiled

    def matcher(self, params: StructuredOutputsParams, token_ids: list[int]) -> GrammarState:
        """A matcher for one sequence, advanced over the tokens it already generated."""
        matcher = _xgrammar().GrammarMatcher(self.compile(params))
        if params.reasoning_end_token_ids:
            matcher = ReasoningGate(matcher, params.reasoning_end_token_ids)
        state = GrammarState(matcher, self.vocab_size)
        state.accept(token_ids)
        return state


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        # the grammar allows no token of this vocabulary here (a choice or regex needing a
        # character no token spells, as \x1d in the default model): the sequence may only stop
        self.dead = False

    def accept(self, token_ids: list[int]) -> None:
        for t in token_ids:
            if self.matcher.is_terminated() or self.dead:
                return  # tokens after the end (stop tokens under ignore_eos) change nothing
            if not self.matcher.accept_token(t):
                if dead_end(self.matcher, self.vocab_size):
                    self.dead = True  # the stop token its mask allowed (apply_grammar_masks)
                    return
                # the scheduler accepted a token the mask forbade: a bug, not user input
                raise AssertionError(f"token {t} violates the request's grammar")

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (rejected speculative drafts)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)


class ReasoningGate:
    """A matcher that starts after a reasoning model's end-of-thinking tokens (`</think>`).

    Until they have been generated nothing is masked and tokens do not reach the grammar; from
    the token after them on, it is the grammar's matcher. It has the matcher's interface
    (accept_token, is_terminated, fill_next_token_bitmask, rollback), so speculative drafts and
    replays after preemption go through it unchanged."""

    def __init__(self, matcher: Any, end_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.end_token_ids = list(end_token_ids)
        self.history: list[int] = []  # every token accepted, in order
        self.open_at: int | None = None  # len(history) when the gate opened

    def accept_token(self, token_id: int) -> bool:
        if self.open_at is not None:
            if not self.matcher.accept_token(token_id):
                return False
            self.history.append(token_id)
            return True
        self.history.append(token_id)
        n = len(self.end_token_ids)
        if self.history[-n:] == self.end_token_ids:
            self.open_at = len(self.history)
        return True

    def is_terminated(self) -> bool:
        return self.open_at is not None and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> None:
        if self.open_at is None:
            bitmask[index].fill_(-1)  # thinking: every token allowed
        else:
            self.matcher.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        keep = len(self.history) - num_tokens
        if self.open_at is not None:
            self.matcher.rollback(len(self.history) - max(keep, self.open_at))
            if keep < self.open_at:
                self.open_at = None
        del self.history[keep:]


class DraftWalk:
    """A constrained request verifying drafts d_0..d_{m-1}: logits row j needs the grammar after
    d_0..d_{j-1}. `row(j)` stands in for the request's GrammarState on row j; when the sampler
    masks rows in order, the one matcher is advanced through the drafts as far as each row needs,
    and `restore` rolls it back (xgrammar's rollback) before the accepted tokens are applied as
    usual (tessera/worker/input_batch.py). A draft the grammar refuses ends the walk: rows past it
    are unreachable (row j's mask forbids d_j, so d_j is never accepted) and left unmasked."""

    def __init__(self, state: GrammarState, drafts: list[int]) -> None:
        self.state = state
        self.drafts = drafts
        self.pos = 0  # drafts walked through (accepted, or skipped after the grammar's end)
        self.num_accepted = 0  # tokens the matcher accepted: what `restore` rolls back
        self.refused = False

    def row(self, j: int) -> GrammarState:
        return _DraftRow(self, j)  # type: ignore[return-value]

    def seek(self, j: int) -> bool:
        """Bring the matcher to the state after drafts[:j]; False if a draft before j was
        refused."""
        if j < self.pos:
            self.restore()
        matcher = self.state.matcher
        while self.pos < j and not self.refused:
            if not matcher.is_terminated():
                if not matcher.accept_token(self.drafts[self.pos]):
                    self.refused = True
                    break
                self.num_accepted += 1
            self.pos += 1
        return not self.refused

    def restore(self) -> None:
        self.state.rollback(self.num_accepted)
        self.pos = self.num_accepted = 0
        self.refused = False


class _DraftRow:
    """What `apply_grammar_masks` reads of a row's state (`.matcher`), for row j of a DraftWalk."""

    def __init__(self, walk: DraftWalk, j: int) -> None:
        self.matcher = self
        self.walk, self.j = walk, j

    def is_terminated(self) -> bool:
        return self.walk.seek(self.j) and self.walk.state.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> None:
        if self.walk.seek(self.j):
            self.walk.state.matcher.fill_next_token_bitmask(bitmask, index)


def dead_end(matcher: Any, vocab_size: int) -> bool:
    """Whether the grammar, not terminated, allows no token at all next."""
    if matcher.is_terminated():
        return False
    bitmask = _xgrammar().allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return not bool(bitmask.any())


def apply_grammar_masks(logits: torch.Tensor, states: list[GrammarState | None],
                        stop_token_ids: tuple[int, ...]) -> None:
    """Mask, in place, the tokens each constrained row's grammar forbids next (logits [R, V]).

    A row whose grammar has ended may only emit a stop token, and so may a row at a dead end (a
    grammar that allows no token of this vocabulary next): every logit -inf would sample an
    arbitrary token, which the grammar then refuses."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return
    xgr = _xgrammar()
    num_rows, vocab = logits.shape
    # one bitmask row per logits row: xgrammar indexes both by the same row ids
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab)  # [R, ceil(V / 32)] int32, all ones
    ended: list[int] = []
    active: list[int] = []
    for i in rows:
        state = states[i]
        assert state is not None
        if state.matcher.is_terminated():
            ended.append(i)
            continue
        state.matcher.fill_next_token_bitmask(bitmask, i)
        if bitmask[i].any():
            active.append(i)
        else:
            ended.append(i)
    apply_bitmask_(logits, bitmask, active)
    for i in ended:
        stop = [t for t in stop_token_ids if 0 <= t < vocab]
        keep = logits[i, stop].clone()
        logits[i] = float("-inf")
        logits[i, stop] = keep


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """EBNF that matches exactly one of the strings (JSON escapes are valid EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _clean(error: BaseException) -> str:
    """xgrammar's message without its C++ file paths and check text, cut to a readable size."""
    text = _INTERNAL_PREFIX.sub("", str(error)).strip()
    text = text.split("The JSON string is:")[0].strip()
    return text[:_MAX_ERROR_CHARS]
