"""A plan's launches as one CUDA graph (kdash.kernels.graph_launch).

CPU: the slot's policy (when it captures, launches, steps aside, gives up) against a stand-in
for the CUDA driver, which this machine does not have: the stand-in records the calls a real
driver would get and hands out exec handles. ``gpu``: plans on the H200 through the real driver,
their output against the kernels', captures counted, a caller's own capture left to kernel
nodes, a rebind dropping the graph.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kdash.kernels import graph_launch  # noqa: E402
from kdash.kernels.graph_launch import DriverError, GraphSlot  # noqa: E402


class StandInDriver:
    """Stands in for the CUDA driver (absent on the CPU machine): records what a slot asks."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.capturing_streams: set[int] = set()
        self.live: set[int] = set()
        self.fail_capture = False
        self._next = 100

    def capture(self, stream: int, launches) -> int:
        self.calls.append(("capture", stream))
        launches(stream)
        if self.fail_capture:
            raise DriverError("cuStreamEndCapture returned CUDA error 901")
        self._next += 1
        self.live.add(self._next)
        return self._next

    def launch(self, exe: int, stream: int) -> None:
        assert exe in self.live, "launch of a destroyed graph"
        self.calls.append(("launch", exe, stream))

    def capturing(self, stream: int) -> bool:
        return stream in self.capturing_streams

    def start(self, exe: int, stream: int) -> bool:
        if self.capturing(stream):
            return False
        self.launch(exe, stream)
        return True

    def destroy(self, exe: int) -> None:
        self.live.discard(exe)
        self.calls.append(("destroy", exe))


def make_slot(max_captures: int = 8):
    drv = StandInDriver()
    fired: list[tuple] = []

    def fire(stream: int, *key) -> None:
        fired.append((stream, *key))

    return GraphSlot(fire, 7, drv, max_captures), drv, fired


def test_slot_captures_on_the_second_run_with_one_key_then_launches_it() -> None:
    slot, drv, fired = make_slot()
    key = (0x1000, 0x2000, 0x3000, 0x40, 0x50)
    assert not slot.launch(1, key)  # first sighting: the caller launches its kernels
    assert drv.calls == [] and fired == []
    assert slot.launch(1, key)  # second: captured on the slot's stream, started on the caller's
    assert fired == [(7, *key)]
    assert drv.calls[0] == ("capture", 7) and drv.calls[1][0] == "launch"
    exe = drv.calls[1][1]
    assert slot.launch(3, key)  # then one launch per run, on the stream given
    assert drv.calls[-1] == ("launch", exe, 3)
    assert slot.captures == 1 and len(fired) == 1


def test_slot_holds_a_graph_per_layer_of_a_step() -> None:
    """One plan runs every layer, each on its own caches: keys come round in turn, never twice
    in a row, and each gets its graph on its second step."""
    slot, drv, fired = make_slot()
    layers = [(0x100, 0x1000 * i, 0x2000 * i, 0, 0) for i in range(1, 5)]
    assert [slot.launch(0, k) for k in layers] == [False] * 4  # step 1: kernels
    assert [slot.launch(0, k) for k in layers] == [True] * 4  # step 2: one capture each
    assert [slot.launch(0, k) for k in layers] == [True] * 4  # step 3: launches only
    assert slot.captures == 4 and set(slot.graphs) == set(layers)
    assert [f[1:] for f in fired] == layers  # each captured with its own caches
    assert [c[1] for c in drv.calls[-4:]] == [slot.graphs[k] for k in layers]


def test_slot_evicts_its_oldest_graph_past_its_size() -> None:
    slot, drv, _ = make_slot()
    slot = GraphSlot(lambda *a: None, 7, drv, max_graphs=2)
    a, b, c = (1, 0, 0, 0, 0), (2, 0, 0, 0, 0), (3, 0, 0, 0, 0)
    for k in (a, a, b, b):
        slot.launch(0, k)
    exe_a = slot.graphs[a]
    slot.launch(0, c)
    slot.launch(0, c)
    assert list(slot.graphs) == [b, c] and exe_a not in drv.live
    assert not slot.launch(0, a)  # seen again after its graph went: a new sighting


def test_slot_steps_aside_while_the_callers_stream_is_captured() -> None:
    slot, drv, _ = make_slot()
    key = (1, 2, 3, 4, 5)
    drv.capturing_streams.add(5)
    slot.launch(5, key)
    assert not slot.launch(5, key)  # no capture started from inside the caller's capture
    assert slot.captures == 0
    drv.capturing_streams.clear()
    assert slot.launch(5, key)
    drv.capturing_streams.add(5)
    n = len(drv.calls)
    assert not slot.launch(5, key)  # a held graph is not started into the caller's capture
    assert len(drv.calls) == n


def test_slot_gives_up_after_its_captures_and_on_a_driver_error() -> None:
    slot, drv, _ = make_slot(max_captures=2)
    for p in range(4):
        key = (p, 0, 0, 0, 0)
        slot.launch(0, key)
        slot.launch(0, key)
    assert slot.captures == 2  # keys kept changing: no third capture
    assert not slot.launch(0, (3, 0, 0, 0, 0)) and set(slot.graphs) == {
        (0, 0, 0, 0, 0),
        (1, 0, 0, 0, 0),
    }
    assert slot.launch(0, (1, 0, 0, 0, 0))  # the graphs it holds still run

    slot, drv, _ = make_slot()
    drv.fail_capture = True
    key = (1, 2, 3, 4, 5)
    slot.launch(0, key)
    assert not slot.launch(0, key)
    assert slot.refused and "901" in slot.refused
    drv.fail_capture = False
    assert not slot.launch(0, key) and slot.captures == 0  # it stays refused


def test_close_and_collection_destroy_the_graphs() -> None:
    slot, drv, _ = make_slot()
    keys = [(1, 2, 3, 4, 5), (6, 2, 3, 4, 5)]
    for k in keys * 2:
        slot.launch(0, k)
    held = list(slot.graphs.values())
    assert len(held) == 2
    slot.close()
    assert not (set(held) & drv.live) and not slot.graphs
    slot.launch(0, keys[0])
    assert slot.launch(0, keys[0])  # captures again
    exe = slot.graphs[keys[0]]
    del slot
    import gc

    gc.collect()
    assert exe not in drv.live


def _libcuda_loads() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_the_ctypes_driver_starts_a_graph_unless_the_stream_is_captured(stand_in_libcuda):
    """Driver.start on a stand-in libcuda: a stream not being captured gets the launch (a
    64-bit exec handle and stream passed whole); a captured stream, or one whose status cannot
    be read, gets none and False; a failed launch is a DriverError naming the call and code."""
    lib = stand_in_libcuda
    drv = graph_launch.Driver(lib)
    exe = drv.capture(0x7F0000002000, lambda s: None)
    assert exe == 0x7F0000001000
    lib.set(0, 0, 0)
    assert drv.start(exe, 0x7F0000002000) is True and lib.count() == 1
    lib.set(1, 0, 0)  # CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert drv.start(exe, 0x7F0000002000) is False and lib.count() == 1
    assert drv.capturing(0x7F0000002000)
    lib.set(0, 0, 906)  # the status could not be read (another thread's global capture)
    assert drv.start(exe, 0x7F0000002000) is False and lib.count() == 1
    lib.set(0, 700, 0)
    with pytest.raises(graph_launch.DriverError, match="cuGraphLaunch returned CUDA error 700"):
        drv.start(exe, 0x7F0000002000)
    assert lib.count() == 2


@pytest.mark.skipif(_libcuda_loads(), reason="this machine has a CUDA driver")
def test_driver_refusal_is_kept_as_a_reason(monkeypatch) -> None:
    monkeypatch.setattr(graph_launch, "_driver", None)
    monkeypatch.setattr(graph_launch, "_driver_refused", None)
    assert graph_launch.driver() is None
    assert graph_launch.driver_refused().startswith("libcuda:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real path")
def test_interpreted_plan_never_takes_a_graph() -> None:
    """In the interpreter every run takes Triton's own path: no slot is made."""
    from decode_cases import make_case
    from kdash.kernels.decode_attention import DecodeConfig, DecodePlan

    q, kc, vc, pt, sl, _ = make_case([40, 3], 4, 2, 64, 16, seed=1)
    plan = DecodePlan(pt, sl, 4, 2, 64, 16, max_seq_len=40, config=DecodeConfig(block_n=64))
    for _ in range(3):
        plan.run(q, kc, vc)
    assert plan.graph and plan._slot is None and plan.graph_refused is None
    off = DecodePlan(pt, sl, 4, 2, 64, 16, max_seq_len=40, graph=False)
    assert off.graph_refused == "off for this plan (graph=False)"


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
    reason="needs a CUDA GPU with TRITON_INTERPRET unset",
)


def _plan(lens, fused, fp8=False, graph=None):
    from decode_cases import make_case
    from kdash.kernels.decode_attention import DecodePlan

    q, kc, vc, pt, sl, sc = make_case(lens, 32, 8, 128, 16, fp8, seed=5)
    plan = DecodePlan(pt, sl, 32, 8, 128, 16, max_seq_len=max(lens), total_tokens=sum(lens),
                      kv_dtype=kc.dtype, fused=fused, graph=graph, **sc)  # fmt: skip
    return plan, q, kc, vc


@gpu
@needs_cuda
@pytest.mark.parametrize("fused", [False, True, "persistent"], ids=["two", "fused", "persistent"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_graph_launch_gives_the_kernels_output(fused, fp8: bool) -> None:
    lens = [5000, 17, 70000, 1]
    plan, q, kc, vc = _plan(lens, fused, fp8)
    ref_plan, *_ = _plan(lens, fused, fp8, graph=False)
    want = ref_plan.run(q, kc, vc).clone()
    for _ in range(5):
        plan.out.fill_(float("nan"))
        got = plan.run(q, kc, vc)
    torch.cuda.synchronize()
    assert plan.graph_refused is None
    assert plan._slot is not None and plan._slot.captures == 1
    assert torch.equal(got, want)
    # a new q buffer: kernels once, then a second capture; the output follows the new q
    q2 = q.flip(0).contiguous()
    want2 = ref_plan.run(q2, kc, vc).clone()
    for _ in range(3):
        plan.out.fill_(float("nan"))
        got = plan.run(q2, kc, vc)
    torch.cuda.synchronize()
    assert plan._slot.captures == 2 and torch.equal(got, want2)
    if fused:
        assert not plan._flags.any()


@gpu
@needs_cuda
def test_gpu_callers_capture_holds_kernels_and_replays_right() -> None:
    """A plan whose slot holds a graph, run inside the caller's capture: the caller's graph
    gets kernel nodes (a graph launch cannot be captured), and its replays follow q."""
    lens = [3000, 900]
    plan, q, kc, vc = _plan(lens, False)
    for _ in range(3):
        plan.run(q, kc, vc)
    assert plan._slot.captures == 1
    q_in = q.clone()
    plan.run(q_in, kc, vc)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q_in, kc, vc)
    assert plan._slot.captures == 1  # nothing captured from inside the caller's capture
    ref_plan, *_ = _plan(lens, False, graph=False)
    for _ in range(2):
        q_in.copy_(torch.randn_like(q.float()).bfloat16())
        plan.out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(plan.out, ref_plan.run(q_in, kc, vc))


@gpu
@needs_cuda
def test_gpu_rebind_drops_the_graph() -> None:
    lens = [4000, 4000]
    plan, q, kc, vc = _plan(lens, False)
    for _ in range(3):
        plan.run(q, kc, vc)
    slot = plan._slot
    assert slot is not None and slot.captures == 1
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device=q.device)
    q_strided = wide[:, :, : q.shape[2]]
    q_strided.copy_(q)
    plan.run(q_strided, kc, vc)  # another q layout: the plan rebinds
    assert plan._slot is not slot and not slot.graphs
    for _ in range(3):
        got = plan.run(q_strided, kc, vc)
    torch.cuda.synchronize()
    ref_plan, *_ = _plan(lens, False, graph=False)
    assert torch.equal(got, ref_plan.run(q, kc, vc))


@gpu
@needs_cuda
@pytest.mark.parametrize("fused", [False, True], ids=["two", "fused"])
def test_gpu_one_plan_over_layers_holds_a_graph_per_layer(fused) -> None:
    """As the demo runs it: one plan, every layer on its own caches, steps in turn."""
    lens = [2000, 333, 9000]
    plan, q, kc, vc = _plan(lens, fused)
    ref_plan, *_ = _plan(lens, fused, graph=False)
    caches = [(kc, vc)] + [(torch.randn_like(kc), torch.randn_like(vc)) for _ in range(2)]
    want = [ref_plan.run(q, k, v).clone() for k, v in caches]
    for _ in range(3):
        for i, (k, v) in enumerate(caches):
            plan.out.fill_(float("nan"))
            got = plan.run(q, k, v)
            torch.cuda.synchronize()
            assert torch.equal(got, want[i])
    assert plan._slot.captures == 3 and len(plan._slot.graphs) == 3
