"""The demo workload: a small transformer-shaped server loop over the project's attention kernels.

``python -m kdash.kernels`` runs it until stopped (Ctrl-C, SIGTERM, or ``--duration S``) and prints
tokens/s every few seconds. Requests arrive at random, are prefilled (extend kernel) and then
decoded (split-KV decode kernel) in a continuously batched, paged KV cache; around the attention
sit the usual matmuls (QKV and output projections, a SwiGLU MLP, RMSNorm, a tied LM head) so that
a profile looks like a real server's: many kernels per step, the attention among them. Each step is
an NVTX range named ``prefill`` or ``decode``.

The model is random weights (nothing to download) and has no rotary embedding (it would add a
kernel, not change what is being watched). Sampling is greedy. The host waits for a step's tokens
one step later (the "overlap" pattern of SGLang's scheduler), unless ``--sync-every-step``.

Decode steps are replayed from CUDA graphs, as SGLang's CUDA-graph runner does: one graph per
padded batch size, captured the first time that size is needed, over static input buffers (token
ids, positions, lengths, page table) that each step rewrites before the replay; the attention's
plan (:class:`~kdash.kernels.decode_plan.DecodePlan`) is made once per graph and cuts the
work on the GPU from the lengths in memory. With ``--eager-decode`` every kernel of every step is
launched from Python instead: the host-bound way, for kdash's launch-gap and CPU panes (kdash's
agent records no kernels of graph replays unless asked, `--graph-kernels`, which `kdash demo`
asks). ``--graph-decode`` names the default.
Without CUDA (the CPU interpreter) decode is eager.

Pathologies on purpose, for kdash's CPU-affinity and idle-gap panes:

- ``--pin-off-local``: pin the launch thread to CPUs not local to the GPU
  (``/sys/bus/pci/devices/<bdf>/local_cpulist``);
- ``--noisy-neighbour``: start a busy process pinned to the launch thread's CPU;
- ``--sync-every-step``: ``torch.cuda.synchronize()`` after every step (GPU idle while the host
  schedules the next one);
- ``--eager-decode``: decode without CUDA graphs (the GPU waits on Python's launches).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .scheduler import ArrivalProcess, Scheduler, Step, off_local_cpus, parse_cpulist


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the toy model; the defaults start in a few seconds and fill an H200 usefully."""

    layers: int = 4
    hidden: int = 2048
    q_heads: int = 16
    kv_heads: int = 4
    head_dim: int = 128
    mlp: int = 5632
    vocab: int = 32000


def _nvtx(name: str, enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.nvtx.range(name)


class Engine:
    """Weights, the paged KV cache, and the two step functions (prefill, decode)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        max_running: int,
        max_context: int,
        kv_dtype: str = "bf16",
        device: str = "cuda",
        seed: int = 0,
    ) -> None:
        import torch

        from .kv_cache import FP8

        self.torch = torch
        self.cfg, self.page_size, self.device = cfg, page_size, torch.device(device)
        self.nvtx = self.device.type == "cuda"
        g = torch.Generator(device="cpu").manual_seed(seed)
        bf = torch.bfloat16

        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
            return t.to(self.device, bf)

        qkv = (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim
        self.embed = (torch.randn(cfg.vocab, cfg.hidden, generator=g) * 0.02).to(self.device, bf)
        self.layers = [
            {
                "wqkv": w(cfg.hidden, qkv),
                "wo": w(cfg.q_heads * cfg.head_dim, cfg.hidden),
                "wgu": w(cfg.hidden, 2 * cfg.mlp),
                "wd": w(cfg.mlp, cfg.hidden),
                "n1": torch.ones(cfg.hidden, device=self.device, dtype=bf),
                "n2": torch.ones(cfg.hidden, device=self.device, dtype=bf),
            }
            for _ in range(cfg.layers)
        ]
        self.fp8 = kv_dtype == "fp8"
        self.cache_dtype = cache_dtype = FP8 if self.fp8 else bf
        # One page past the scheduler's: the padding rows of a replayed decode batch write their
        # K/V there, so no real request's page is touched.
        self.pad_page = num_pages
        shape = (num_pages + 1, page_size, cfg.kv_heads, cfg.head_dim)
        self.k_cache = [
            torch.zeros(shape, device=self.device, dtype=cache_dtype) for _ in self.layers
        ]
        self.v_cache = [
            torch.zeros(shape, device=self.device, dtype=cache_dtype) for _ in self.layers
        ]
        # Random activations are ~unit size after RMSNorm; a fixed scale keeps e4m3 in range.
        self.kv_scale = torch.full((cfg.kv_heads,), 4.0 / 448, device=self.device)
        self.max_pages = -(-max_context // page_size)
        self.max_running = max_running

    # ------------------------------------------------------------------ pieces of a layer
    def _rms(self, x, weight):
        t = self.torch
        xf = x.float()
        return (xf * t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    def _mlp(self, x, lw):
        t = self.torch
        gu = self._rms(x, lw["n2"]) @ lw["wgu"]
        gate, up = gu.chunk(2, dim=-1)
        return x + (t.nn.functional.silu(gate) * up) @ lw["wd"]

    def _qkv(self, x, lw):
        c = self.cfg
        qkv = self._rms(x, lw["n1"]) @ lw["wqkv"]
        q, k, v = qkv.split(
            [c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1
        )
        n = x.shape[0]
        return (
            q.view(n, c.q_heads, c.head_dim),
            k.reshape(n, c.kv_heads, c.head_dim),
            v.reshape(n, c.kv_heads, c.head_dim),
        )

    def _page_table(self, step: Step):
        rows = [r.pages + [0] * (self.max_pages - len(r.pages)) for r in step.requests]
        return self.torch.tensor(rows, dtype=self.torch.int32).to(self.device, non_blocking=True)

    def _tokens(self, n: int):
        return self.torch.randint(0, self.cfg.vocab, (n,), device=self.device)

    # ------------------------------------------------------------------------ the steps
    def prefill(self, step: Step):
        """Prompt tokens of ``step.requests`` through the stack; returns each one's first token."""
        from .kv_cache import write_kv
        from .prefill_attention import extend_attention

        t = self.torch
        lens = step.chunks
        prefixes = step.prefix
        total = sum(lens)
        with _nvtx("prefill", self.nvtx):
            cu_host = [0]
            for n in lens:
                cu_host.append(cu_host[-1] + n)
            cu = t.tensor(cu_host, dtype=t.int32).to(self.device, non_blocking=True)
            req = t.repeat_interleave(t.arange(len(lens)), t.tensor(lens)).to(self.device)
            pos = t.cat([t.arange(p, p + n) for p, n in zip(prefixes, lens, strict=True)])
            pos = pos.to(self.device)
            pt = self._page_table(step)
            with_prefix = any(prefixes)
            if with_prefix and self.fp8:
                raise ValueError("chunked prefill reads a bf16 cache; run fp8 KV without chunking")
            prefix_t = t.tensor(prefixes, dtype=t.int32).to(self.device, non_blocking=True)
            x = self.embed[self._tokens(total)]
            for i, lw in enumerate(self.layers):
                q, k, v = self._qkv(x, lw)
                scales = (self.kv_scale, self.kv_scale) if self.fp8 else (None, None)
                write_kv(self.k_cache[i], self.v_cache[i], pt, req, pos, k, v, *scales)
                # New tokens come straight from the projection; a chunk's earlier part of the
                # prompt (its prefix) is read from the paged cache.
                if with_prefix:
                    o = extend_attention(
                        q, k, v, self.k_cache[i], self.v_cache[i], pt, prefix_t, cu, max(lens)
                    )
                else:
                    o = extend_attention(q, k, v, None, None, None, None, cu, max(lens))
                x = x + o.view(total, -1) @ lw["wo"]
                x = self._mlp(x, lw)
            last = x[t.tensor([c - 1 for c in cu_host[1:]], device=self.device)]
            return (self._rms(last, 1.0) @ self.embed.T).argmax(-1)

    def plan(self, page_table, seq_lens, *, max_seq_len: int, total_tokens: int | None = None):
        """The decode attention plan for one batch (shared by every layer of a step)."""
        from .decode_plan import DecodePlan

        c = self.cfg
        scales = {"k_scale": self.kv_scale, "v_scale": self.kv_scale} if self.fp8 else {}
        return DecodePlan(
            page_table,
            seq_lens,
            c.q_heads,
            c.kv_heads,
            c.head_dim,
            self.page_size,
            max_seq_len=max_seq_len,
            total_tokens=total_tokens,
            kv_dtype=self.cache_dtype,
            **scales,
        )

    def decode_layers(self, tokens, pos, req, page_table, plan):
        """The decode forward on device tensors only: what a CUDA graph captures."""
        from .kv_cache import write_kv

        n = tokens.shape[0]
        x = self.embed[tokens]
        scales = (self.kv_scale, self.kv_scale) if self.fp8 else (None, None)
        for i, lw in enumerate(self.layers):
            q, k, v = self._qkv(x, lw)
            write_kv(self.k_cache[i], self.v_cache[i], page_table, req, pos, k, v, *scales)
            o = plan.run(q.contiguous(), self.k_cache[i], self.v_cache[i])
            x = x + o.view(n, -1) @ lw["wo"]
            x = self._mlp(x, lw)
        return (self._rms(x, 1.0) @ self.embed.T).argmax(-1)

    def decode(self, step: Step, tokens=None):
        """One token for each of ``step.requests``, every kernel launched now; the next tokens.

        ``tokens`` are the input ids (random ones by default: their values do not change the
        work, and drawing them on the device keeps the host out of it).
        """
        t = self.torch
        reqs = step.requests
        b = len(reqs)
        with _nvtx("decode", self.nvtx):
            pt = self._page_table(step)
            pos_host = [r.cached for r in reqs]
            pos = t.tensor(pos_host, dtype=t.int32).to(self.device, non_blocking=True)
            lens = t.tensor([p + 1 for p in pos_host], dtype=t.int32).to(
                self.device, non_blocking=True
            )
            req = t.arange(b, device=self.device)
            toks = self._tokens(b) if tokens is None else tokens.to(self.device)
            plan = self.plan(
                pt, lens, max_seq_len=max(pos_host) + 1, total_tokens=sum(pos_host) + b
            )
            return self.decode_layers(toks, pos, req, pt, plan)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 8, and the max."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


class _Slot:
    """Static buffers, attention plan and (on CUDA) the captured graph of one padded batch size."""

    def __init__(self, engine: Engine, size: int, max_context: int) -> None:
        t = engine.torch
        dev = engine.device
        self.size, self.max_pages = size, engine.max_pages
        # [pos | lens | page table rows] in one int32 buffer: one host-to-device copy per step.
        self.inputs = t.zeros(size * (2 + self.max_pages), dtype=t.int32, device=dev)
        self.pos = self.inputs[:size]
        self.lens = self.inputs[size : 2 * size]
        self.page_table = self.inputs[2 * size :].view(size, self.max_pages)
        self.tokens = t.zeros(size, dtype=t.int64, device=dev)
        self.req = t.arange(size, device=dev)
        self.lens.fill_(1)
        self.page_table.fill_(engine.pad_page)
        # Lengths unknown at plan time: the grid is sized for any up to max_context, and each
        # replay's cut comes from the lengths in memory.
        self.plan = engine.plan(self.page_table, self.lens, max_seq_len=max_context)
        self.graph = None
        self.out = None


class GraphDecoder:
    """Decode steps replayed from CUDA graphs, one per padded batch size (SGLang's pattern).

    A step of ``b`` requests runs in the graph of the smallest size ``n >= b``; rows ``b..n`` are
    padding: length 1, position 0, every page the engine's spare page. Each step writes its
    positions, lengths and page table into the graph's static buffers (one copy), draws its token
    ids in place and replays. With ``capture=False`` (no CUDA) the same static-buffer step runs
    eagerly, which is how the CPU tests check it.
    """

    def __init__(self, engine: Engine, *, max_batch: int, max_context: int, capture: bool = True):
        self.engine = engine
        self.sizes = graph_batch_sizes(max_batch)
        self.max_context = max_context
        self.capture = capture
        self.slots: dict[int, _Slot] = {}
        self.captured: list[int] = []

    def bucket(self, b: int) -> int:
        for s in self.sizes:
            if s >= b:
                return s
        raise ValueError(f"decode batch {b} above the largest graph size {self.sizes[-1]}")

    def _slot(self, size: int) -> _Slot:
        slot = self.slots.get(size)
        if slot is None:
            slot = _Slot(self.engine, size, self.max_context)
            if self.capture:
                self._capture(slot)
            self.slots[size] = slot
        return slot

    def _run(self, slot: _Slot):
        return self.engine.decode_layers(
            slot.tokens, slot.pos, slot.req, slot.page_table, slot.plan
        )

    def _capture(self, slot: _Slot) -> None:
        t = self.engine.torch
        # Warm up on a side stream (compiles the Triton kernels, arms their launchers, sets up
        # cuBLAS) on the padding inputs, which only write the spare page; then capture.
        side = t.cuda.Stream()
        side.wait_stream(t.cuda.current_stream())
        with t.cuda.stream(side):
            self._run(slot)
        t.cuda.current_stream().wait_stream(side)
        graph = t.cuda.CUDAGraph()
        # thread_local: a profiler's threads in this process (kdash's agent under `kdash run`)
        # may make CUDA calls while this thread captures; only this thread's must be capturable.
        with t.cuda.graph(graph, capture_error_mode="thread_local"):
            slot.out = self._run(slot)
        slot.graph = graph
        self.captured.append(slot.size)

    def decode(self, step: Step, tokens=None):
        """Like :meth:`Engine.decode` (same results), from the static buffers of a graph."""
        eng = self.engine
        t = eng.torch
        reqs = step.requests
        b = len(reqs)
        n = self.bucket(b)
        with _nvtx("decode", eng.nvtx):
            slot = self._slot(n)
            pad = n - b
            host = [r.cached for r in reqs] + [0] * pad
            host += [r.cached + 1 for r in reqs] + [1] * pad
            for r in reqs:
                host += r.pages
                host += [0] * (slot.max_pages - len(r.pages))
            host += [eng.pad_page] * (slot.max_pages * pad)
            slot.inputs.copy_(t.tensor(host, dtype=t.int32), non_blocking=True)
            if tokens is None:
                slot.tokens.random_(0, eng.cfg.vocab)
            else:
                slot.tokens[:b].copy_(tokens)
                slot.tokens[b:].zero_()
            if slot.graph is None:
                out = self._run(slot)
            else:
                slot.graph.replay()
                out = slot.out
            return out[:b]


# ---------------------------------------------------------------------------- host side
def gpu_pci_bdf(index: int = 0) -> str | None:
    """The GPU PCI address in sysfs form (``0000:19:00.0``) from NVML or torch; None if unknown."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).busId
        finally:
            pynvml.nvmlShutdown()
        bus = bus.decode() if isinstance(bus, bytes) else str(bus)
        return bus[-12:].lower()
    except Exception:  # noqa: BLE001 - no NVML here: torch's properties are the next source
        pass
    try:
        import torch

        p = torch.cuda.get_device_properties(index)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # noqa: BLE001 - neither can tell: the caller says "unknown"
        return None


def gpu_local_cpus(index: int = 0) -> tuple[set[int] | None, str]:
    """CPUs local to GPU ``index`` per sysfs, and where that came from (or why it is unknown)."""
    bdf = gpu_pci_bdf(index)
    if bdf is None:
        return None, "GPU PCI address unknown (no NVML, no torch PCI ids)"
    path = Path("/sys/bus/pci/devices") / bdf / "local_cpulist"
    try:
        return parse_cpulist(path.read_text()), str(path)
    except OSError as e:
        return None, f"{path}: {e.strerror}"


def fmt_cpus(cpus: set[int]) -> str:
    """Compact cpulist text (``0-3,8``) for messages."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def pin_off_local(index: int = 0) -> str:
    """Pin the calling (launch) thread to allowed CPUs not local to the GPU; says what it did."""
    allowed = os.sched_getaffinity(0)
    local, src = gpu_local_cpus(index)
    if local is None:
        return f"--pin-off-local: cannot tell which CPUs are local ({src}); not pinned"
    off = off_local_cpus(allowed, local)
    if not off:
        # Single-NUMA machines (and many VMs) list every CPU as local: pin to the CPU farthest
        # from the GPU's list instead, so the pin is still visible in kdash's thread table.
        off = {max(allowed)}
        note = f"every allowed CPU is local to GPU {index} ({src}); pinned to CPU {max(allowed)}"
    else:
        note = f"not local to GPU {index} (local: {fmt_cpus(local)}, from {src})"
    os.sched_setaffinity(0, off)
    return f"pinned launch thread {threading_tid()} to CPUs {fmt_cpus(off)}: {note}"


def threading_tid() -> int:
    import threading

    return threading.get_native_id()


def start_noisy_neighbour() -> tuple[subprocess.Popen, str]:
    """A busy-looping child process pinned to the launch thread's CPU (which is pinned too).

    The child asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so a
    workload killed hard (SIGKILL, a crash) does not leave a core spinning behind it.
    """
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    code = (
        "import ctypes, os, signal\n"
        "try:\n"
        "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
        "except Exception:\n"
        "    pass\n"
        f"if os.getppid() != {os.getpid()}:\n"
        "    raise SystemExit(0)  # the parent died before the prctl took effect\n"
        f"os.sched_setaffinity(0, {{{cpu}}})\n"
        "while True:\n"
        "    pass\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    return proc, f"noisy neighbour pid {proc.pid} busy on CPU {cpu}, the launch thread's CPU"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kdash.kernels",
        description="kdash demo workload: a paged-KV attention server loop on one GPU.",
    )
    ap.add_argument(
        "--duration", type=float, default=None, help="seconds to run (default: forever)"
    )
    ap.add_argument("--rate", type=float, default=16.0, help="request arrivals per second")
    ap.add_argument("--prompt-len", type=int, default=1024, help="mean prompt length (lognormal)")
    ap.add_argument("--output-len", type=int, default=256, help="mean output length (lognormal)")
    ap.add_argument("--max-running", type=int, default=64, help="decode batch limit")
    ap.add_argument("--max-prefill-tokens", type=int, default=8192, help="tokens per prefill step")
    ap.add_argument("--max-context", type=int, default=16384)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=16384)
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument(
        "--chunked-prefill",
        action="store_true",
        help="cut prompts over --max-prefill-tokens into chunks that read their prefix from the "
        "paged cache (bf16 KV only; tested on the CPU, not yet run on a GPU)",
    )
    ap.add_argument("--layers", type=int, default=ModelConfig.layers)
    ap.add_argument("--hidden", type=int, default=ModelConfig.hidden)
    ap.add_argument("--q-heads", type=int, default=ModelConfig.q_heads)
    ap.add_argument("--kv-heads", type=int, default=ModelConfig.kv_heads)
    ap.add_argument("--head-dim", type=int, default=ModelConfig.head_dim, choices=[64, 128])
    ap.add_argument("--mlp", type=int, default=ModelConfig.mlp)
    ap.add_argument("--report-every", type=float, default=2.0, help="seconds between reports")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--pin-off-local",
        action="store_true",
        help="pin the launch thread to CPUs not local to the GPU",
    )
    ap.add_argument(
        "--noisy-neighbour",
        "--noisy-neighbor",
        action="store_true",
        help="start a busy process pinned to the launch thread's CPU",
    )
    ap.add_argument(
        "--sync-every-step",
        action="store_true",
        help="torch.cuda.synchronize() after every step (GPU idles between steps)",
    )
    ap.add_argument(
        "--eager-decode",
        action="store_true",
        help="launch every decode kernel from Python (host-bound, as a server without graphs is)",
    )
    ap.add_argument(
        "--graph-decode",
        action="store_true",
        help="replay decode steps from CUDA graphs, one per padded batch size, as SGLang does "
        "(the default on a GPU)",
    )
    return ap


def run(args: argparse.Namespace) -> int:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("kdash demo workload: no CUDA GPU here", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    cfg = ModelConfig(
        args.layers, args.hidden, args.q_heads, args.kv_heads, args.head_dim, args.mlp
    )
    if args.q_heads * args.head_dim != args.hidden:
        print("note: q_heads * head_dim != hidden; fine for the demo", file=sys.stderr)
    sched = Scheduler(
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_prefill_tokens=args.max_prefill_tokens,
        max_running=args.max_running,
        max_context=args.max_context,
        # The extend kernel reads a bf16 cache; fp8 KV prefills whole prompts instead.
        chunked_prefill=args.chunked_prefill and args.kv_dtype != "fp8",
    )
    if sched.max_pages_per_request > args.num_pages:
        print("--num-pages too small for one request of --max-context", file=sys.stderr)
        return 2
    max_prompt = min(args.max_context // 2, 8 * args.prompt_len)
    arrivals = ArrivalProcess(
        args.rate,
        prompt_mean=args.prompt_len,
        output_mean=args.output_len,
        max_prompt=max_prompt,
        max_output=args.max_context - max_prompt,
        seed=args.seed,
    )
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    notes, neighbour, graphs = _start_extras(args, cuda)
    t_build = time.monotonic()
    engine = Engine(
        cfg,
        num_pages=args.num_pages,
        page_size=args.page_size,
        max_running=args.max_running,
        max_context=args.max_context,
        kv_dtype=args.kv_dtype,
        device=args.device,
        seed=args.seed,
    )
    decoder = (
        GraphDecoder(engine, max_batch=args.max_running, max_context=args.max_context)
        if graphs
        else engine
    )
    print(
        f"kdash workload: {cfg}, KV {args.kv_dtype} pages {args.num_pages}x{args.page_size}; "
        f"built in {time.monotonic() - t_build:.1f}s",
        flush=True,
    )
    for n in notes:
        print("  " + n, flush=True)
    t0 = time.monotonic()
    last_report = t0
    win = {"prefill": 0, "decode": 0, "steps": 0}
    totals = {"prefill": 0, "decode": 0, "steps": 0, "finished": 0}
    pending = None  # (event, host tokens) of the step before, waited on one step late
    try:
        while not stop["now"]:
            now = time.monotonic()
            if args.duration is not None and now - t0 >= args.duration:
                break
            for req in arrivals.due(now - t0):
                sched.add(req)
            step = sched.schedule()
            if step.kind == "idle":
                time.sleep(0.002)
                continue
            toks = engine.prefill(step) if step.kind == "prefill" else decoder.decode(step)
            if cuda:
                pending = _copy_tokens(toks, pending, args.sync_every_step)
            done = sched.complete(step, time.monotonic() - t0)
            totals["finished"] += len(done)
            tokens = step.num_tokens
            win[step.kind] += tokens
            totals[step.kind] += tokens
            win["steps"] += 1
            totals["steps"] += 1
            now = time.monotonic()
            if now - last_report >= args.report_every:
                _report(now - t0, now - last_report, win, totals, sched, args.num_pages)
                win = {"prefill": 0, "decode": 0, "steps": 0}
                last_report = now
    except KeyboardInterrupt:
        pass
    finally:
        if cuda:
            torch.cuda.synchronize()
        if neighbour is not None:
            neighbour.terminate()
            neighbour.wait(timeout=5)
    _summary(max(1e-9, time.monotonic() - t0), totals, decoder)
    return 0


def _start_extras(args: argparse.Namespace, cuda: bool) -> tuple[list[str], Any, bool]:
    """The notes printed at start, after what they describe is set up (CPU pinning, the noisy
    neighbour, whose process is returned to be stopped at the end), and whether decode
    replays CUDA graphs."""
    import torch

    notes = [f"pid {os.getpid()}, launch thread {threading_tid()}"]
    neighbour = None
    if args.pin_off_local and cuda:
        notes.append(pin_off_local(torch.cuda.current_device()))
    if args.noisy_neighbour:
        neighbour, msg = start_noisy_neighbour()
        notes.append(msg)
    if args.sync_every_step:
        notes.append("synchronizing after every step")
    graphs = cuda and not args.eager_decode
    notes.append(
        "decode: replayed from CUDA graphs, one per padded batch size"
        if graphs
        else "decode: eager, every kernel launched from Python"
    )
    return notes, neighbour, graphs


def _copy_tokens(
    toks: Any, pending: tuple[Any, Any] | None, sync_every_step: bool
) -> tuple[Any, Any]:
    """The step's tokens copied to pinned host memory behind an event; the step before is
    waited on (one step late), or the whole device with `sync_every_step`. Returns this
    step's (event, host tokens)."""
    import torch

    host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
    host.copy_(toks, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    if sync_every_step:
        torch.cuda.synchronize()
    elif pending is not None:
        pending[0].synchronize()
    return (ev, host)


def _report(
    at: float,
    dt: float,
    win: dict[str, int],
    totals: dict[str, int],
    sched: Scheduler,
    num_pages: int,
) -> None:
    """One progress line: the rates over the last `dt` seconds and the scheduler's state."""
    print(
        f"[{at:7.1f}s] decode {win['decode'] / dt:8.0f} tok/s  "
        f"prefill {win['prefill'] / dt:8.0f} tok/s  steps/s {win['steps'] / dt:6.1f}  "
        f"running {len(sched.running):3d} waiting {len(sched.waiting):3d}  "
        f"free pages {sched.pages.num_free}/{num_pages}  "
        f"done {totals['finished']} preempted {sched.preemptions}",
        flush=True,
    )


def _summary(el: float, totals: dict[str, int], decoder: Any) -> None:
    """The last line: mean rates over the whole run, the decode graphs captured."""
    graphs_note = ""
    if isinstance(decoder, GraphDecoder):
        graphs_note = f", decode graphs captured for batch sizes {sorted(decoder.captured)}"
    print(
        f"kdash workload: {el:.1f}s, {totals['decode'] / el:.0f} decode tok/s, "
        f"{totals['prefill'] / el:.0f} prefill tok/s, {totals['steps']} steps, "
        f"{totals['finished']} requests done{graphs_note}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
