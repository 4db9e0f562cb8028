"""Shared pieces of the training commands: progress lines, data windows, schedules, seeding."""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from serve_app.chat.segments import encode_segments
from serve_app.tokenizer import HFTokenizer
from serve_app.training.conversations import Conversation, conversations
from serve_app.training.corpus import SourceFile


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Progress:
    """A progress bar printed as plain lines (no terminal control codes), so that it reads the
    same on a terminal, in a nohup log and in CI output. The bar tracks wall time, the real
    budget of every loop here."""

    name: str
    budget_s: float
    every_s: float = 15.0
    start: float = field(default_factory=time.monotonic)
    # A step budget as well (a short run whose result must not depend on the machine's speed,
    # e.g. the end-to-end test): the loop ends at whichever runs out first.
    max_steps: int | None = None
    _last: float = 0.0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def finished(self, step: int) -> bool:
        return self.elapsed >= self.budget_s or (self.max_steps is not None
                                                 and step >= self.max_steps)

    def share(self, step: int) -> float:
        """How much of the budget is spent: time, or steps where those run out first."""
        steps = step / self.max_steps if self.max_steps else 0.0
        return min(1.0, max(self.fraction, steps))

    @property
    def fraction(self) -> float:
        return min(1.0, self.elapsed / self.budget_s) if self.budget_s > 0 else 1.0

    def update(self, force: bool = False, **metrics: float | int | str) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        width = 24
        filled = int(self.fraction * width)
        bar = "#" * filled + "-" * (width - filled)
        parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                 for k, v in metrics.items()]
        print(f"{self.name:<9}[{bar}] {100 * self.fraction:5.1f}%  "
              f"{self.elapsed / 60:5.1f}/{self.budget_s / 60:.1f} min  " + "  ".join(parts),
              flush=True, file=sys.stdout)


def running_mean(previous: float, value: float) -> float:
    """The training loops' moving average (0.95 / 0.05); NaN, before any value, takes the
    first."""
    return value if math.isnan(previous) else 0.95 * previous + 0.05 * value


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor,
                   params: Iterable[torch.Tensor]) -> None:
    """One update of every training loop: gradients of `loss`, `params`' norm clipped at 1.0."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def cosine_lr(fraction: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to floor*peak as the wall-time
    budget runs out (the number of steps is not known in advance on a shared machine)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, fraction))))


# The share of the training stream's tokens that are conversations in K3's format (the rest is
# the code itself).
CONVERSATION_FRACTION = 0.3


def conversation_ids(tok: HFTokenizer, conversation: Conversation) -> tuple[list[int], list[int]]:
    """(prompt, completion) token ids, tokenized as the server tokenizes a request."""
    prompt, completion = conversation.tokens()
    return encode_segments(tok, prompt), encode_segments(tok, completion)


def encode_documents(tok: HFTokenizer, files: list[SourceFile], seed: int,
                     conversation_fraction: float = CONVERSATION_FRACTION) -> torch.Tensor:
    """One token stream: every file (as plain text: a file's "[EOS]" stays characters) and
    conversations about its functions in K3's chat format (`conversation_fraction` of the
    tokens), shuffled with the seed, each document preceded by [BOS]."""
    rng = random.Random(seed)
    docs = [tok.encode_text(f.text) for f in files]
    wanted = sum(map(len, docs)) * conversation_fraction / (1 - conversation_fraction)
    made = 0
    while made < wanted:
        batch = conversations(files, 256, rng)
        if not batch:
            break
        for c in batch:
            prompt, completion = conversation_ids(tok, c)
            docs.append(prompt + completion)
            made += len(docs[-1])
    rng.shuffle(docs)
    ids: list[int] = []
    for doc in docs:
        ids.append(tok.bos_token_id)
        ids.extend(doc)
    return torch.tensor(ids, dtype=torch.int32)


def random_windows(stream: torch.Tensor, batch: int, length: int,
                   gen: torch.Generator) -> torch.Tensor:
    """[batch, length] random windows of the stream (int64)."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=gen)
    return torch.stack([stream[s:s + length] for s in starts.tolist()]).long()


def fixed_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Up to `count` evenly spaced windows of `length` that do not overlap ([n, length]): a
    deterministic evaluation set. A stream too short for `count` gives fewer windows, each
    token counted once, instead of the same tokens evaluated several times over."""
    count = max(1, min(count, len(stream) // length))
    step = max(length, (len(stream) - length) // count)
    return torch.stack([stream[i * step:i * step + length] for i in range(count)]).long()


class ThreadTuner:
    """Picks the faster of 1..max_threads torch threads while a loop runs, and keeps checking.

    On a shared 2-core machine, 2 OpenMP threads are ~1.8x faster than 1 when the machine is
    free and many times slower when another process holds a core (the threads spin against
    each other). Once `trial` steps are timed, and again after `every_s` seconds of steps, the
    other count is tried for up to `trial` steps and the faster (median step time) is kept;
    steps are of one size, so their wall times compare directly. A trial step slower than
    `abort_ratio` x the current median ends the trial at once, and each lost trial doubles the
    wait before the next (a busy machine stays busy for minutes)."""

    def __init__(self, max_threads: int, every_s: float = 60.0, trial: int = 3,
                 abort_ratio: float = 1.3, max_every_s: float = 480.0) -> None:
        self.options = list(range(1, max(1, max_threads) + 1))
        self.current = self.options[-1]
        self.base_every_s = self.every_s = every_s
        self.max_every_s = max_every_s
        self.trial, self.abort_ratio = trial, abort_ratio
        self.since_trial = float("inf")  # seconds of steps since the last trial: try soon
        self.recent: list[float] = []  # the last `trial` step times at the current count
        self.trying: int | None = None
        self.trial_times: list[float] = []
        torch.set_num_threads(self.current)

    def record(self, seconds: float) -> None:
        if self.trying is None:
            self.recent = [*self.recent, seconds][-self.trial:]
            self.since_trial += seconds
            if (len(self.options) > 1 and len(self.recent) == self.trial
                    and self.since_trial >= self.every_s):
                self.trying = next(o for o in reversed(self.options) if o != self.current)
                torch.set_num_threads(self.trying)
            return
        self.trial_times.append(seconds)
        base = statistics.median(self.recent)
        if seconds > self.abort_ratio * base:
            self._end_trial(won=False)
        elif len(self.trial_times) >= self.trial:
            self._end_trial(won=statistics.median(self.trial_times) < base)

    def _end_trial(self, won: bool) -> None:
        if won:
            assert self.trying is not None
            self.current, self.recent = self.trying, self.trial_times
            self.every_s = self.base_every_s
        else:
            self.every_s = min(2 * self.every_s, self.max_every_s)
        self.trying, self.trial_times, self.since_trial = None, [], 0.0
        torch.set_num_threads(self.current)
