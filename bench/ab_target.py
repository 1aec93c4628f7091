"""The loop that the twin benches run: one of three targets, its rate printed as tick lines.

`python ab_target.py MODE SECONDS [FACTOR ON_S HOLD_S]`

MODE is `eager` (matmul + a small Triton kernel + a sync per iteration), `graph_tiny` (a CUDA
graph of 50 tiny Triton kernels replayed, a sync per replay) or `decode_graph` (a decode step of
kdash's demo model, 8 layers, batch 32 at 2k context, replayed from a CUDA graph; `decode_eager`
is the same step launched eagerly: a steady kernel mix for PC-sampling checks). It prints
`ready PID MONO_NS` once warmed up, then `tick MONO_NS ITERS MAX_ITER_NS` every 100 ms (the
longest iteration since the last tick, so a stall of the loop is seen), then `done ITERS`.

FACTOR (optional) is one thing done to CUPTI from inside the process, on a thread of its own,
ON_S seconds after `ready` and for HOLD_S seconds, on kdash's duty cycle (100 ms on every
second), to find which of the things kdash's agent does outlives it (bench/gpu_ab_cost.py
`--screen`). Each factor leaves the process as the agent's detach does; none finalizes CUPTI.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

KEEP = re.compile(r"Launch|Synchroniz|Memcpy|Memset|StreamWaitEvent|EventRecord")


def build(mode: str):
    if mode == "cpu":  # no GPU: only to try the benches' plumbing

        def spin():
            sum(range(20_000))

        return spin
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        v = alpha * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)
        tl.store(out_ptr + offs, v, mask=m)

    dev = "cuda"
    if mode in ("eager", "graph_tiny"):
        a = torch.randn(1024, 1024, device=dev)
        b = torch.randn(1024, 1024, device=dev)
        x = torch.randn(1 << 16, device=dev)
        y = torch.randn(1 << 16, device=dev)
        out = torch.empty_like(x)
        n = x.numel()

        def body():
            if mode == "eager":
                a @ b
                axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)
            else:
                for _ in range(50):
                    axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)

    elif mode in ("decode_graph", "decode_eager"):
        from kdash.kernels.decode_attention import decode_attention
        from kdash.kernels.kv_cache import write_kv
        from kdash.kernels.workload import Engine, ModelConfig

        B, CTX, PAGE = 32, 2048, 16
        cfg = ModelConfig(layers=8)
        eng = Engine(
            cfg,
            num_pages=B * CTX // PAGE + 8,
            page_size=PAGE,
            max_running=B,
            max_context=CTX,
            device=dev,
        )
        pt = torch.arange(B * CTX // PAGE, device=dev, dtype=torch.int32).view(B, CTX // PAGE)
        pos = torch.full((B,), CTX - 1, device=dev, dtype=torch.int32)
        lens = torch.full((B,), CTX, device=dev, dtype=torch.int32)
        req = torch.arange(B, device=dev)
        tokens = torch.randint(0, cfg.vocab, (B,), device=dev)

        def body():
            h = eng.embed[tokens]
            for i, lw in enumerate(eng.layers):
                q, k, v = eng._qkv(h, lw)
                write_kv(eng.k_cache[i], eng.v_cache[i], pt, req, pos, k, v, None, None)
                o = decode_attention(
                    q.contiguous(),
                    eng.k_cache[i],
                    eng.v_cache[i],
                    pt,
                    lens,
                    max_seq_len=CTX,
                    total_tokens=B * CTX,
                )
                h = h + o.view(B, -1) @ lw["wo"]
                h = eng._mlp(h, lw)
            return (eng._rms(h, 1.0) @ eng.embed.T).argmax(-1)

    else:
        raise SystemExit(f"unknown mode {mode!r}")

    graph = None
    if mode in ("graph_tiny", "decode_graph"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()

    def run_once():
        if graph is not None:
            graph.replay()
        else:
            body()
        torch.cuda.synchronize()

    return run_once


class Factor:
    """One CUPTI treatment on kdash's duty cycle; `name` picks what is switched on."""

    KINDS = {
        "register": [],
        "kernel": ["CONCURRENT_KERNEL"],
        "kernel_cont": ["CONCURRENT_KERNEL"],
        "runtime": ["CONCURRENT_KERNEL", "RUNTIME"],
        "driver": ["CONCURRENT_KERNEL", "DRIVER"],
        "narrow": ["CONCURRENT_KERNEL", "RUNTIME", "DRIVER"],
        "narrow_restore": ["CONCURRENT_KERNEL", "RUNTIME", "DRIVER"],
        "sync": ["CONCURRENT_KERNEL", "SYNCHRONIZATION"],
        "copies_markers": ["CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "MARKER"],
        "perapi": ["CONCURRENT_KERNEL"],
    }

    KINDS.update(
        {
            "fin_exit": ["CONCURRENT_KERNEL"],
            "fin_direct": ["CONCURRENT_KERNEL"],
            "fin_windows": ["CONCURRENT_KERNEL"],
            "register_fin": [],
            "kernel_sync_fin": ["CONCURRENT_KERNEL"],
            "graph_trace": ["GRAPH_TRACE"],
            "fin_windows_all": [
                "CONCURRENT_KERNEL",
                "MEMCPY",
                "MEMSET",
                "RUNTIME",
                "DRIVER",
                "SYNCHRONIZATION",
                "MARKER",
            ],
        }
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.records_bytes = 0
        self.errors: list[str] = []

    def run(self, on_s: float, hold_s: float, t_ready: float) -> None:
        time.sleep(max(0.0, t_ready + on_s - time.monotonic()))
        if self.name == "thread":
            import select
            import socket

            a, b = socket.socketpair()
            end = time.monotonic() + hold_s
            while time.monotonic() < end:
                select.select([a], [], [], 0.05)
            a.close()
            b.close()
            print("factor done thread", flush=True)
            return
        from cupti import cupti
        from kdash.collectors.agent import server

        if self.name == "import_only":  # what the agent's probe and offset do, no more
            for _ in range(7):
                cupti.get_timestamp()
            print("factor done import_only", flush=True)
            return
        if self.name == "probe_fin":  # the agent's START in a graph-replaying process
            import ctypes

            from kdash.collectors.agent import detach

            for _ in range(7):
                cupti.get_timestamp()
            path, why = server.find_libcupti()
            hook = detach.probe_graphs(ctypes.CDLL(path), cupti, 1.0)
            print(f"factor done probe_fin {hook.state} graph_seen={hook.graph_seen}", flush=True)
            return

        path, why = server.find_libcupti()
        raw = server.RawBuffers(path, self._buffer)
        raw.register()
        kinds = [getattr(cupti.ActivityKind, k) for k in self.KINDS[self.name]]
        if self.name.startswith("fin_windows"):
            self._fin_windows(cupti, raw, kinds, hold_s)
            return
        kept = self._kept_cbids(cupti) if self.name == "perapi" else []
        end = time.monotonic() + hold_s
        cont = self.name == "kernel_cont"
        while time.monotonic() < end:
            for k in kinds:
                cupti.activity_enable(k)
            if self.name in ("narrow", "narrow_restore"):
                self._narrow(cupti, 0)
            for fn, cbid in kept:
                fn(cbid, 1)
            t_off = time.monotonic() + (hold_s if cont else 0.1)
            while time.monotonic() < min(t_off, end):
                time.sleep(0.02)
                cupti.activity_flush_all(0)
            for k in kinds:
                cupti.activity_disable(k)
            for fn, cbid in kept:
                fn(cbid, 0)
            cupti.activity_flush_all(1)
            nxt = time.monotonic() + (0.0 if cont else 0.9)
            time.sleep(max(0.0, min(nxt, end) - time.monotonic()))
        if self.name == "narrow_restore":
            self._narrow(cupti, 1)
        cupti.activity_flush_all(1)
        if self.name == "kernel_sync_fin":
            import torch

            torch.cuda.synchronize()  # nothing CUPTI instrumented still in flight
            time.sleep(0.2)
        if self.name in ("fin_exit", "register_fin", "kernel_sync_fin"):
            fin = ExitFinalizer(raw.lib, cupti)
            self.note = fin.run(5.0)
        elif self.name == "fin_direct":
            self.note = f"cuptiFinalize rc={raw.lib.cuptiFinalize()}"
        print(f"factor done {self.name} bytes={self.records_bytes} {self.note}", flush=True)

    note = ""

    def _fin_windows(self, cupti, raw, kinds, hold_s: float) -> None:
        """Every window: CUPTI on (callbacks registered, kinds enabled), 100 ms, off, flushed,
        then finalized at the next launch's API exit, so no CUPTI is attached between windows."""
        end = time.monotonic() + hold_s
        waits = []
        narrow = "RUNTIME" in self.KINDS[self.name]
        while time.monotonic() < end:
            t_start = time.monotonic()
            raw.register()
            for k in kinds:
                cupti.activity_enable(k)
            if narrow:
                self._narrow(cupti, 0)
            time.sleep(0.1)
            for k in kinds:
                cupti.activity_disable(k)
            cupti.activity_flush_all(1)
            t0 = time.monotonic()
            why = ExitFinalizer(raw.lib, cupti).run(2.0)
            waits.append(round(1e3 * (time.monotonic() - t0), 1))
            if why:
                self.errors.append(why)
            time.sleep(max(0.0, t_start + 1.0 - time.monotonic()))
        print(
            f"factor done {self.name} bytes={self.records_bytes} finalize_wait_ms={waits} "
            f"errors={self.errors[:3]}",
            flush=True,
        )

    def _buffer(self, addr: int, valid: int) -> None:
        self.records_bytes += valid

    @staticmethod
    def _api_members(cupti):
        for enum_name, fn_name in (
            ("runtime_api_trace_cbid", "activity_enable_runtime_api"),
            ("driver_api_trace_cbid", "activity_enable_driver_api"),
        ):
            members = getattr(getattr(cupti, enum_name), "__members__", {})
            fn = getattr(cupti, fn_name)
            for name, cbid in members.items():
                if name in ("INVALID", "SIZE", "FORCE_INT"):
                    continue
                yield fn, name, int(cbid)

    def _narrow(self, cupti, value: int) -> None:
        for fn, name, cbid in self._api_members(cupti):
            if KEEP.search(name):
                continue
            try:
                fn(cbid, value)
            except Exception as e:  # noqa: BLE001 - some ids are not switchable; counted
                if len(self.errors) < 3:
                    self.errors.append(f"{name}: {e}")

    def _kept_cbids(self, cupti):
        return [(fn, cbid) for fn, name, cbid in self._api_members(cupti) if KEEP.search(name)]


class ExitFinalizer:
    """cuptiFinalize from the exit of the target's next launch or synchronize call.

    CUPTI recommends finalizing at an API exit callsite (no call of that thread is half done
    there); PyTorch's Kineto does so to end its "QPS slowdown" after a profile. The callback is
    enabled for launch and synchronize ids only, unsubscribed and finalized at its first exit.
    """

    NAMES = re.compile(
        r"^(cu|cuda)(LaunchKernel|GraphLaunch|StreamSynchronize|CtxSynchronize|"
        r"DeviceSynchronize|EventSynchronize)"
    )

    def __init__(self, lib, cupti) -> None:
        import ctypes

        self.ct = ctypes
        self.lib = lib
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.rc: int | None = None
        self.sub = ctypes.c_void_p(0)
        cb_t = ctypes.CFUNCTYPE(
            None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
        )
        self._cb = cb_t(self._callback)
        self.ids = []
        for domain, enum_name in ((1, "driver_api_trace_cbid"), (2, "runtime_api_trace_cbid")):
            for name, cbid in getattr(cupti, enum_name).__members__.items():
                if self.NAMES.search(name):
                    self.ids.append((domain, int(cbid)))

    def _callback(self, userdata, domain, cbid, cbdata) -> None:
        try:
            if self.done.is_set() or not cbdata:
                return
            if self.ct.c_int.from_address(cbdata).value != 1:  # CUPTI_API_EXIT
                return
            with self.lock:
                if self.done.is_set():
                    return
                self.lib.cuptiUnsubscribe(self.sub)
                self.rc = int(self.lib.cuptiFinalize())
                self.done.set()
        except BaseException:  # noqa: BLE001 - never into the target
            self.done.set()

    def run(self, timeout: float) -> str:
        ct = self.ct
        self.lib.cuptiSubscribe.argtypes = [ct.POINTER(ct.c_void_p), ct.c_void_p, ct.c_void_p]
        self.lib.cuptiUnsubscribe.argtypes = [ct.c_void_p]
        self.lib.cuptiEnableCallback.argtypes = [ct.c_uint32, ct.c_void_p, ct.c_int, ct.c_uint32]
        rc = self.lib.cuptiSubscribe(ct.byref(self.sub), ct.cast(self._cb, ct.c_void_p), None)
        if rc != 0:
            return f"cuptiSubscribe rc={rc}"
        for domain, cbid in self.ids:
            self.lib.cuptiEnableCallback(1, self.sub, domain, cbid)
        if not self.done.wait(timeout):
            with self.lock:
                if not self.done.is_set():
                    self.done.set()
                    self.lib.cuptiUnsubscribe(self.sub)
                    return "no launch within the wait: not finalized"
        return f"finalized rc={self.rc}"


def profiler_kernels(run_once) -> int:
    """Kernels torch.profiler sees over 0.3 s: does a profiler still work after kdash?"""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            run_once()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(1 for e in prof.profiler.kineto_results.events() if e.device_type() == cuda)


SLOT_GUARD_NS = 50_000_000  # the first iterations after a turn starts pay the switch: not counted


def slots(run_once) -> None:
    """Interleaved twins (bench/gpu_ab_cost.py `--interleaved`): two processes take turns on
    the GPU in alternate slots of a schedule read from stdin (`go T0_NS SLOT_NS PARITY N`),
    so a drift of the machine over the run falls on both alike. Prints `slot K ITERS NS WORST`
    for each of its own slots: iterations ended after the guard, the time they span, and the
    longest iteration."""
    line = sys.stdin.readline().split()
    t0, slot, parity, n = (int(x) for x in line[1:5])
    for k in range(parity, n, 2):
        start, end = t0 + k * slot, t0 + (k + 1) * slot
        delay = (start - time.monotonic_ns()) / 1e9
        if delay > 0:
            time.sleep(delay)
        count_from = start + SLOT_GUARD_NS
        iters, first, last, worst = 0, 0, 0, 0
        prev = time.monotonic_ns()
        while prev < end:
            run_once()
            t = time.monotonic_ns()
            worst = max(worst, t - prev)
            if t > count_from:
                if not iters:
                    first = prev
                iters += 1
                last = t
            prev = t
        print("slot", k, iters, last - first, worst, flush=True)
    print("done", flush=True)


def main() -> int:
    mode, seconds = sys.argv[1], float(sys.argv[2])
    factor = sys.argv[3] if len(sys.argv) > 3 else "none"
    run_once = build(mode)
    for _ in range(20):
        run_once()
    t_ready = time.monotonic()
    print("ready", os.getpid(), time.monotonic_ns(), flush=True)
    if factor != "none":
        f = Factor(factor)
        th = threading.Thread(
            target=f.run,
            args=(float(sys.argv[4]), float(sys.argv[5]), t_ready),
            name="factor",
            daemon=True,
        )
        th.start()
    if os.environ.get("AB_SLOTS"):
        slots(run_once)
        return 0
    iters = 0
    end = t_ready + seconds
    next_tick = t_ready + 0.1
    worst = 0
    last = time.perf_counter_ns()
    while True:
        run_once()
        iters += 1
        t = time.perf_counter_ns()
        worst = max(worst, t - last)
        last = t
        now = time.monotonic()
        if now >= next_tick:
            print("tick", time.monotonic_ns(), iters, worst, flush=True)
            worst = 0
            next_tick += 0.1
        if now >= end:
            break
    print("done", iters, flush=True)
    if mode != "cpu" and os.environ.get("AB_PROFILER_CHECK"):
        try:
            print("profiler_kernels", profiler_kernels(run_once), flush=True)
        except Exception as e:  # noqa: BLE001 - a figure, reported either way
            print("profiler_kernels failed", type(e).__name__, e, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
