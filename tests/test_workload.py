"""The demo workload's scheduler (pure Python) and a tiny end-to-end engine run on the CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest
from kdash.kernels.scheduler import (
    ArrivalProcess,
    OutOfPages,
    PageAllocator,
    Request,
    Scheduler,
    State,
    off_local_cpus,
    pages_for,
    parse_cpulist,
)
from kdash.kernels.workload import build_parser, fmt_cpus, graph_batch_sizes


def test_page_allocator_accounts_every_page() -> None:
    a = PageAllocator(8)
    x = a.alloc(3)
    y = a.alloc(5)
    assert len(set(x) | set(y)) == 8 and a.num_free == 0
    with pytest.raises(OutOfPages):
        a.alloc(1)
    a.free(x)
    assert a.num_free == 3
    with pytest.raises(ValueError, match="twice"):
        a.free(x[:1])
    assert sorted(a.alloc(3)) == sorted(x)


def check_invariants(s: Scheduler) -> None:
    owned = [p for r in s.running for p in r.pages]
    assert len(owned) == len(set(owned)), "a page owned twice"
    assert len(owned) + s.pages.num_free == s.pages.num_pages, "pages leaked"
    for r in s.running:
        assert r.state is State.RUNNING
        assert len(r.pages) >= pages_for(max(r.cached, 1), s.page_size)
    assert len(s.running) <= s.max_running


def drive(s: Scheduler, arrivals: ArrivalProcess, horizon: float, dt: float = 0.01):
    """Run the scheduler on simulated time until every arrival before ``horizon`` is done."""
    t = 0.0
    kinds: list[str] = []
    steps = 0
    while t < horizon or s.running or s.waiting:
        for req in arrivals.due(min(t, horizon)):
            s.add(req)
        step = s.schedule()
        check_invariants(s)
        if step.kind == "prefill":
            assert step.num_tokens <= s.max_prefill_tokens or len(step.requests) == 1
            for r in step.requests:
                assert len(r.pages) == pages_for(r.prompt_len, s.page_size)
        if step.kind == "decode":
            for r in step.requests:  # room for the token this step writes at position `cached`
                assert not r.in_prefill
                assert len(r.pages) * s.page_size >= r.cached + 1
        kinds.append(step.kind)
        s.complete(step, t)
        check_invariants(s)
        t += dt
        steps += 1
        assert steps < 200_000, "scheduler made no progress"
    return kinds


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_every_request_finishes_with_its_tokens_and_frees_its_pages(chunked: bool) -> None:
    s = Scheduler(
        chunked_prefill=chunked,
        page_size=16,
        num_pages=4096,
        max_prefill_tokens=2048,
        max_running=32,
        max_context=4096,
    )
    arr = ArrivalProcess(
        50.0, prompt_mean=300, output_mean=40, max_prompt=2000, max_output=1000, seed=1
    )
    kinds = drive(s, arr, horizon=2.0)
    assert len(s.finished) == arr.next_rid > 50
    for r in s.finished:
        assert r.state is State.DONE and r.generated == r.max_new_tokens and r.pages == []
        assert r.finished_at is not None and r.first_token_at is not None
    assert s.pages.num_free == s.pages.num_pages
    assert "decode" in kinds and "prefill" in kinds


def test_no_two_prefills_in_a_row_while_requests_decode() -> None:
    s = Scheduler(
        page_size=16, num_pages=4096, max_prefill_tokens=64, max_running=64, max_context=4096
    )
    for i in range(20):
        s.add(Request(i, prompt_len=50, max_new_tokens=30))
    prev = None
    for _ in range(200):
        had_running = bool(s.running)
        step = s.schedule()
        if prev == "prefill" and had_running:
            assert step.kind == "decode"
        prev = step.kind
        s.complete(step)
    assert len(s.finished) == 20


def test_page_pool_exhaustion_preempts_the_newest_and_still_finishes() -> None:
    s = Scheduler(
        page_size=4, num_pages=40, max_prefill_tokens=4096, max_running=16, max_context=128
    )
    for i in range(8):
        s.add(Request(i, prompt_len=12, max_new_tokens=40))  # 52 tokens = 13 pages each
    for _ in range(5000):
        if not (s.running or s.waiting):
            break
        step = s.schedule()
        check_invariants(s)
        s.complete(step)
    assert len(s.finished) == 8
    assert s.preemptions > 0
    assert all(r.generated == 40 for r in s.finished)
    assert s.pages.num_free == 40


def test_long_prompts_are_prefilled_in_budget_sized_chunks() -> None:
    s = Scheduler(
        page_size=4, num_pages=64, max_prefill_tokens=10, max_context=64, chunked_prefill=True
    )
    r = Request(0, prompt_len=23, max_new_tokens=2)
    s.add(r)
    seen = []
    for _ in range(3):
        step = s.schedule()
        assert step.kind == "prefill" and step.requests == [r]
        seen.append((step.prefix[0], step.chunks[0]))
        s.complete(step)
    assert seen == [(0, 10), (10, 10), (20, 3)]  # each chunk attends to the earlier ones
    assert not r.in_prefill and r.generated == 1
    assert s.schedule().kind == "decode"


def test_without_chunking_a_long_prompt_runs_alone_in_one_step() -> None:
    s = Scheduler(
        page_size=4, num_pages=64, max_prefill_tokens=10, max_context=64, chunked_prefill=False
    )
    s.add(Request(0, prompt_len=23, max_new_tokens=2))
    s.add(Request(1, prompt_len=3, max_new_tokens=2))
    step = s.schedule()
    assert [r.rid for r in step.requests] == [0] and step.chunks == [23]
    s.complete(step)
    assert s.schedule().kind == "decode"  # no two prefills in a row while one can decode
    assert s.schedule().chunks == [3]


def test_decode_takes_a_new_page_exactly_at_a_page_boundary() -> None:
    s = Scheduler(page_size=16, num_pages=8, max_context=64)
    r = Request(0, prompt_len=16, max_new_tokens=5)
    s.add(r)
    s.complete(s.schedule())  # prefill: 16 tokens cached in exactly one page
    assert len(r.pages) == 1 and r.cached == 16
    step = s.schedule()
    assert step.kind == "decode" and len(r.pages) == 2  # token 17 goes to a second page
    s.complete(step)
    s.complete(s.schedule())
    assert len(r.pages) == 2


def test_requests_longer_than_the_context_are_refused() -> None:
    s = Scheduler(page_size=16, num_pages=8, max_context=64)
    with pytest.raises(ValueError):
        s.add(Request(0, prompt_len=60, max_new_tokens=10))


def test_arrivals_are_seeded_and_have_the_asked_means() -> None:
    a = ArrivalProcess(
        100.0,
        prompt_mean=500,
        output_mean=100,
        sigma=0.5,
        seed=3,
        max_prompt=10**6,
        max_output=10**6,
    )
    b = ArrivalProcess(
        100.0,
        prompt_mean=500,
        output_mean=100,
        sigma=0.5,
        seed=3,
        max_prompt=10**6,
        max_output=10**6,
    )
    ra, rb = a.due(30.0), b.due(30.0)
    assert [(r.prompt_len, r.max_new_tokens) for r in ra] == [
        (r.prompt_len, r.max_new_tokens) for r in rb
    ]
    assert 2500 < len(ra) < 3500  # Poisson, 100/s for 30 s
    assert abs(sum(r.prompt_len for r in ra) / len(ra) - 500) < 50
    assert abs(sum(r.max_new_tokens for r in ra) / len(ra) - 100) < 10
    assert all(x.arrival <= y.arrival for x, y in zip(ra, ra[1:], strict=False))
    assert a.due(30.0) == []


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3", {0, 1, 2, 3}), ("0-1,8,10-11\n", {0, 1, 8, 10, 11}), ("5", {5}), ("0-6:3", {0, 3, 6})],
)
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(fmt_cpus(cpus)) == cpus


def test_off_local_cpus() -> None:
    assert off_local_cpus(set(range(8)), {0, 1, 2, 3}) == {4, 5, 6, 7}
    assert off_local_cpus({0, 1}, {0, 1, 2}) == set()


def test_cli_has_the_pathology_flags() -> None:
    a = build_parser().parse_args(
        ["--duration", "5", "--pin-off-local", "--noisy-neighbour", "--sync-every-step"]
    )
    assert a.duration == 5 and a.pin_off_local and a.noisy_neighbour and a.sync_every_step
    assert build_parser().parse_args(["--noisy-neighbor"]).noisy_neighbour
    assert not a.eager_decode  # graphs unless asked (bench/device_kernels.sh ran them on the H200)
    assert build_parser().parse_args(["--eager-decode"]).eager_decode
    assert build_parser().parse_args(["--graph-decode"]).graph_decode


def test_graph_batch_sizes_cover_every_batch_once() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_static_buffer_decode_matches_eager_decode_on_the_cpu() -> None:
    """The step a CUDA graph captures (static buffers, padded batch, one plan for any lengths),
    run eagerly here (no CUDA), gives the eager step's tokens and K/V; padding writes only the
    spare page."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU engine run needs the Triton interpreter")
    from kdash.kernels.workload import Engine, GraphDecoder, ModelConfig

    cfg = ModelConfig(layers=1, hidden=128, q_heads=2, kv_heads=1, head_dim=64, mlp=256, vocab=64)

    def setup():
        torch.manual_seed(0)  # the prefill draws its (random) prompt ids from torch's generator
        eng = Engine(cfg, num_pages=24, page_size=4, max_running=4, max_context=32, device="cpu")
        s = Scheduler(page_size=4, num_pages=24, max_running=4, max_context=32)
        for i, n in enumerate((6, 3, 9)):
            s.add(Request(i, prompt_len=n, max_new_tokens=4))
        step = s.schedule()
        assert step.kind == "prefill" and len(step.requests) == 3
        eng.prefill(step)
        s.complete(step)
        return eng, s

    eager, s1 = setup()
    static, s2 = setup()
    graphs = GraphDecoder(static, max_batch=4, max_context=32, capture=False)
    for i in range(2):  # two steps through the same slot: buffers rewritten, plan reused
        a, b = s1.schedule(), s2.schedule()
        assert a.kind == b.kind == "decode" and len(a.requests) == 3
        ids = torch.tensor([5 + i, 17, 60])
        ta = eager.decode(a, tokens=ids)
        tb = graphs.decode(b, tokens=ids)
        assert graphs.bucket(3) == 4 and list(graphs.slots) == [4]  # one padding row
        assert torch.equal(ta, tb)
        s1.complete(a)
        s2.complete(b)
    pad = static.pad_page
    torch.testing.assert_close(
        eager.k_cache[0][:pad].float(), static.k_cache[0][:pad].float(), rtol=0, atol=0
    )
    torch.testing.assert_close(
        eager.v_cache[0][:pad].float(), static.v_cache[0][:pad].float(), rtol=0, atol=0
    )
    assert float(eager.k_cache[0][pad].abs().sum()) == 0  # eager never pads
    assert float(static.k_cache[0][pad, 0].abs().sum()) > 0  # the padding row's K landed there


def test_engine_steps_end_to_end_on_the_cpu() -> None:
    """A one-layer model through prefill and decode: the tokens' K/V land in their pages only."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU engine run needs the Triton interpreter")
    from kdash.kernels.workload import Engine, ModelConfig

    cfg = ModelConfig(layers=1, hidden=128, q_heads=2, kv_heads=1, head_dim=64, mlp=256, vocab=64)
    eng = Engine(cfg, num_pages=16, page_size=4, max_running=4, max_context=32, device="cpu")
    # A budget of 5 tokens: request 0 (6 tokens) is prefilled as 5 + 1, the second chunk reading
    # the first through the cache (the extend kernel's paged prefix).
    s = Scheduler(
        page_size=4,
        num_pages=16,
        max_running=4,
        max_context=32,
        max_prefill_tokens=5,
        chunked_prefill=True,
    )
    s.add(Request(0, prompt_len=6, max_new_tokens=3))
    s.add(Request(1, prompt_len=3, max_new_tokens=3))
    prefixes = []
    while True:
        step = s.schedule()
        if step.kind != "prefill":
            break
        prefixes += step.prefix
        toks = eng.prefill(step)
        assert toks.shape == (len(step.requests),)
        s.complete(step)
    assert 5 in prefixes  # the chunk with a cached prefix ran
    toks = eng.decode(step)
    assert step.kind == "decode" and toks.shape == (2,)
    assert int(toks.min()) >= 0 and int(toks.max()) < cfg.vocab
    s.complete(step)
    kc = eng.k_cache[0].float()
    used = {
        (p, slot)
        for r in s.running
        for i, p in enumerate(r.pages)
        for slot in range(4)
        if i * 4 + slot < r.cached
    }
    for p in range(16):
        for slot in range(4):
            written = bool(kc[p, slot].abs().sum() > 0)
            assert written == ((p, slot) in used), (p, slot)


def test_noisy_neighbour_dies_with_the_workload(tmp_path) -> None:
    """Kill the process that started the busy child hard: the child must not outlive it."""
    import signal
    import subprocess
    import sys
    import time

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs Linux CPU affinity")
    script = (
        "import time\n"
        "from kdash.kernels.workload import start_noisy_neighbour\n"
        "proc, msg = start_noisy_neighbour()\n"
        "print(proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # let the child run its prctl
    os.kill(child, 0)  # alive while the parent is
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        # a dead but unreaped child (init reaps it) still answers kill 0: check its state
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the busy child outlived its parent")


def test_the_workload_loop_runs_eagerly_without_cuda(capsys) -> None:
    """`python -m kdash.kernels --device cpu`: no CUDA, so decode stays eager (no graphs)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU engine run needs the Triton interpreter")
    from kdash.kernels.workload import main

    rc = main(
        [
            "--device", "cpu", "--duration", "3", "--rate", "20", "--prompt-len", "8",
            "--output-len", "4", "--max-context", "64", "--num-pages", "64", "--page-size", "4",
            "--max-running", "4", "--layers", "1", "--hidden", "128", "--q-heads", "2",
            "--kv-heads", "1", "--head-dim", "64", "--mlp", "256", "--report-every", "1",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "decode: eager" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("kdash workload:")
    import re

    steps = int(re.search(r"(\d+) steps", last).group(1))
    assert steps >= 1
    assert "graphs captured" not in last


@pytest.mark.gpu
def test_gpu_graph_replayed_decode_equals_the_same_step_run_eagerly() -> None:
    """On CUDA: the captured decode step, replayed over rewritten buffers for three steps (batch
    sizes 3, 3 and 2: one slot reused, one new), gives the eager static-buffer step's tokens and
    K/V bit for bit (same plan, same kernels; only launch mode differs)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.skip("needs CUDA and TRITON_INTERPRET=0")
    from kdash.kernels.workload import Engine, GraphDecoder, ModelConfig

    cfg = ModelConfig(layers=2, hidden=512, q_heads=4, kv_heads=2, head_dim=128, mlp=1024)

    def setup(capture: bool):
        torch.manual_seed(0)
        eng = Engine(cfg, num_pages=256, page_size=16, max_running=8, max_context=1024)
        s = Scheduler(page_size=16, num_pages=256, max_running=8, max_context=1024)
        for i, n in enumerate((100, 37, 300)):
            s.add(Request(i, prompt_len=n, max_new_tokens=3 if i == 1 else 8))
        step = s.schedule()
        eng.prefill(step)
        s.complete(step)
        return eng, s, GraphDecoder(eng, max_batch=8, max_context=1024, capture=capture)

    ea, sa, ga = setup(False)
    eb, sb, gb = setup(True)
    sizes = []
    for i in range(3):
        a, b = sa.schedule(), sb.schedule()
        assert a.kind == b.kind == "decode"
        ids = torch.randint(0, cfg.vocab, (len(a.requests),), device="cuda")
        ta, tb = ga.decode(a, tokens=ids), gb.decode(b, tokens=ids)
        torch.cuda.synchronize()
        assert torch.equal(ta, tb), i
        sizes.append(len(a.requests))
        sa.complete(a)
        sb.complete(b)
    assert gb.captured and ga.captured == []
    pad = ea.pad_page
    for layer in range(cfg.layers):
        assert torch.equal(ea.k_cache[layer][:pad], eb.k_cache[layer][:pad])
        assert torch.equal(ea.v_cache[layer][:pad], eb.v_cache[layer][:pad])
    assert sizes == [3, 3, 2] and sorted(gb.captured) == [2, 4]


def test_decode_replays_graphs_by_default_on_a_gpu_and_never_without_one() -> None:
    """The workload runs as a server does unless told otherwise: graphs on a GPU by default,
    eager with --eager-decode, and eager wherever there is no CUDA (the decision itself; the
    graphs are captured on the H200 by bench/device_kernels.sh)."""
    from kdash.kernels.workload import _start_extras

    p = build_parser()
    assert _start_extras(p.parse_args([]), cuda=True)[2] is True
    assert _start_extras(p.parse_args(["--graph-decode"]), cuda=True)[2] is True
    notes, _, graphs = _start_extras(p.parse_args(["--eager-decode"]), cuda=True)
    assert graphs is False and any("eager" in n for n in notes)
    assert _start_extras(p.parse_args([]), cuda=False)[2] is False
