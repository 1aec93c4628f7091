"""The demo workload's serving logic in pure Python: requests, pages, continuous batching.

Nothing here touches torch or a GPU, so the lifecycle, the page accounting and the batching policy
are tested on the CPU (tests/test_workload.py). The GPU side (:mod:`kdash.kernels.workload`) asks
:class:`Scheduler` for the next step, runs it, and reports it done.

Policy (a simplified SGLang/vLLM scheduler, enough to look like a server in a profiler):

- Requests arrive at random (:class:`ArrivalProcess`, Poisson, lognormal lengths).
- Prefill first: while requests wait and their prompt plus one token fits in free pages (the
  prompt's pages are taken at admission), they join one batched prefill (extend) step, up to the
  step's token budget. With ``chunked_prefill`` a prompt that does not fit the budget is cut into
  chunks over several steps, each later chunk attending to the earlier ones through the cache
  (the extend kernel's prefix); without it, such a prompt runs alone in one step. Never two
  prefill steps in a row while requests are decoding, so arrivals cannot starve them.
- Otherwise one decode step for every running request: each gets one more token; a request whose
  next token starts a new page is given one; when no page is free the most recently admitted
  request is preempted (its pages freed, it goes back to the head of the queue and is prefilled
  again later, as vLLM's recompute preemption does).
- A request finishes after ``max_new_tokens`` tokens (the prefill makes the first) and frees its
  pages at once.
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """Raised by :class:`PageAllocator` when a request asks for more pages than are free."""


class PageAllocator:
    """Free list over ``num_pages`` KV pages; every page is owned by at most one request."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        # Hand out low page numbers first (stack popped from the end), so a fresh run is stable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass
class Request:
    """One request: its prompt, how many tokens it wants, and where its KV lives."""

    rid: int
    prompt_len: int
    max_new_tokens: int
    arrival: float = 0.0
    state: State = State.WAITING
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the cache
    generated: int = 0  # tokens produced so far (the prefill produces the first)
    preemptions: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def in_prefill(self) -> bool:
        """True until the whole prompt is in the cache (a chunked prompt takes several steps)."""
        return self.cached < self.prompt_len

    @property
    def context_len(self) -> int:
        """Tokens the next decode step attends to (the cache plus the token it writes)."""
        return self.cached + 1


@dataclass
class Step:
    """What the engine runs next: a prefill of some requests, a decode of some, or nothing."""

    kind: str  # "prefill" | "decode" | "idle"
    requests: list[Request] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # prefill: new prompt tokens per request
    prefix: list[int] = field(default_factory=list)  # prefill: tokens already cached per request

    @property
    def num_tokens(self) -> int:
        if self.kind == "prefill":
            return sum(self.chunks)
        return len(self.requests)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    """Continuous batching over a paged KV cache (see the module docstring for the policy)."""

    def __init__(
        self,
        *,
        page_size: int,
        num_pages: int,
        max_prefill_tokens: int = 8192,
        max_running: int = 64,
        max_context: int = 32768,
        chunked_prefill: bool = False,
    ) -> None:
        self.page_size = page_size
        self.chunked_prefill = chunked_prefill
        self.pages = PageAllocator(num_pages)
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.preemptions = 0
        self._last_kind = "idle"

    @property
    def max_pages_per_request(self) -> int:
        return pages_for(self.max_context, self.page_size)

    def add(self, req: Request) -> None:
        if req.prompt_len < 1 or req.max_new_tokens < 1:
            raise ValueError("a request needs a prompt and at least one new token")
        if req.prompt_len + req.max_new_tokens > self.max_context:
            raise ValueError(f"request {req.rid} longer than max_context {self.max_context}")
        self.waiting.append(req)

    def schedule(self) -> Step:
        """The next step: prefill what fits, else decode everything running, else idle."""
        step = self._schedule()
        self._last_kind = step.kind
        return step

    def _schedule(self) -> Step:
        decodable = any(not r.in_prefill for r in self.running)
        if self._last_kind == "prefill" and decodable:
            return self._decode_step()
        batch: list[Request] = []
        chunks: list[int] = []
        budget = self.max_prefill_tokens
        # Chunked prompts already admitted go on first: their pages are already theirs.
        for req in self.running:
            if req.in_prefill and budget > 0:
                n = min(req.prompt_len - req.cached, budget)
                batch.append(req)
                chunks.append(n)
                budget -= n
        admitted: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) + len(admitted) < self.max_running:
            req = self.waiting[0]
            if pages_for(req.prompt_len + 1, self.page_size) > self.pages.num_free:
                break
            if self.chunked_prefill:
                n = min(req.prompt_len, budget)
            elif req.prompt_len <= budget or not batch:
                n = req.prompt_len  # an over-budget prompt runs alone, so it cannot starve
            else:
                break
            self.waiting.popleft()
            req.pages = self.pages.alloc(pages_for(req.prompt_len, self.page_size))
            req.state = State.RUNNING
            admitted.append(req)
            batch.append(req)
            chunks.append(n)
            budget -= n
        if batch:
            self.running.extend(admitted)
            return Step("prefill", batch, chunks, [r.cached for r in batch])
        if not decodable:
            return Step("idle")
        return self._decode_step()

    def _decode_step(self) -> Step:
        # Decode: every prefilled running request writes one token at position `cached`.
        for req in list(self.running):
            if req.state is not State.RUNNING or req.in_prefill:
                continue  # preempted below while making room for an earlier one, or prefilling
            need = pages_for(req.cached + 1, self.page_size) - len(req.pages)
            while need > 0 and self.pages.num_free < need:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.state is State.RUNNING and need > 0:
                req.pages.extend(self.pages.alloc(need))
        batch = [r for r in self.running if r.state is State.RUNNING and not r.in_prefill]
        return Step("decode", batch) if batch else Step("idle")

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pages.free(req.pages)
        req.pages = []
        req.cached = 0
        req.generated = 0
        req.state = State.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def complete(self, step: Step, now: float = 0.0) -> list[Request]:
        """Account a finished step; returns the requests that finished with it."""
        done: list[Request] = []
        for i, req in enumerate(step.requests):
            if step.kind == "prefill":
                req.cached += step.chunks[i]
                if req.in_prefill:
                    continue  # more chunks to come
                req.generated = 1
                req.first_token_at = now
            elif step.kind == "decode":
                req.cached += 1
                req.generated += 1
            if req.generated >= req.max_new_tokens:
                req.state = State.DONE
                req.finished_at = now
                self.running.remove(req)
                self.pages.free(req.pages)
                req.pages = []
                self.finished.append(req)
                done.append(req)
        return done


class ArrivalProcess:
    """Poisson arrivals with lognormal prompt and output lengths, seeded for repeatability."""

    def __init__(
        self,
        rate: float,
        *,
        prompt_mean: int = 1024,
        output_mean: int = 256,
        sigma: float = 0.8,
        max_prompt: int = 8192,
        max_output: int = 2048,
        seed: int = 0,
        start: float = 0.0,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.prompt_mean, self.output_mean, self.sigma = prompt_mean, output_mean, sigma
        self.max_prompt, self.max_output = max_prompt, max_output
        self.rng = random.Random(seed)
        self.next_rid = 0
        self.next_time = start + self.rng.expovariate(rate)

    def _length(self, mean: int, cap: int) -> int:
        mu = math.log(mean) - 0.5 * self.sigma**2  # so that the mean is `mean`
        return max(1, min(cap, int(self.rng.lognormvariate(mu, self.sigma))))

    def due(self, now: float) -> list[Request]:
        """Every request that has arrived by ``now`` and was not handed out yet."""
        out = []
        while self.next_time <= now:
            out.append(
                Request(
                    rid=self.next_rid,
                    prompt_len=self._length(self.prompt_mean, self.max_prompt),
                    max_new_tokens=self._length(self.output_mean, self.max_output),
                    arrival=self.next_time,
                )
            )
            self.next_rid += 1
            self.next_time += self.rng.expovariate(self.rate)
        return out


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a Linux cpulist (``"0-3,8,10-11"``), as in ``/sys/.../local_cpulist``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            step = 1
            if ":" in hi:  # "0-31:2" strides, rare but legal
                hi, s = hi.split(":", 1)
                step = int(s)
            cpus.update(range(int(lo), int(hi) + 1, step))
        else:
            cpus.add(int(part))
    return cpus


def off_local_cpus(allowed: set[int], local: set[int]) -> set[int]:
    """The allowed CPUs that are not local to the GPU (empty when every CPU is local)."""
    return set(allowed) - set(local)
