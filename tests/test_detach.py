"""The agent's way out of CUPTI (collectors/agent/detach.py), in process.

`FakeLib` stands in for libcupti's four callback-API functions, since no GPU or CUPTI runs
here; `call()` plays the target's CUDA call reaching CUPTI at its entry and exit. The real
library's behaviour that this is built on was measured on the H200
(bench/results/agent-finalize*-h200.json).
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
import types

from kdash.collectors.agent import detach


class FakeLib:
    """Stand-in for libcupti's callback API (test only: there is no CUPTI here)."""

    def __init__(self, subscribe_rc: int = 0) -> None:
        self.subscribe_rc = subscribe_rc
        self.cb = None
        self.enabled: set[tuple[int, int]] = set()
        self.events: list[str] = []

    def cuptiSubscribe(self, pp_sub, cb, userdata) -> int:
        self.events.append("subscribe")
        if self.subscribe_rc:
            return self.subscribe_rc
        self.cb = detach._CALLBACK_T(cb.value)
        return 0

    def cuptiEnableCallback(self, enable, sub, domain, cbid) -> int:
        if enable:
            self.enabled.add((domain, cbid))
        return 0

    def cuptiUnsubscribe(self, sub) -> int:
        self.events.append("unsubscribe")
        self.cb = None
        self.enabled.clear()
        return 0

    finalize_s = 0.0  # how long the stand-in's finalize takes

    def cuptiFinalize(self) -> int:
        self.events.append("finalize")
        if self.finalize_s:
            time.sleep(self.finalize_s)
        return 0

    def call(self, domain: int, cbid: int) -> None:
        """The target makes a CUDA call: CUPTI calls back at its entry, then at its exit."""
        for site in (0, detach.API_EXIT):
            data = ctypes.c_int(site)
            if self.cb is not None and (domain, cbid) in self.enabled:
                self.cb(None, domain, cbid, ctypes.addressof(data))


LAUNCH, GRAPH, MALLOC, SYNC = 211, 311, 20, 131
CUPTI = types.SimpleNamespace(
    runtime_api_trace_cbid=enum.IntEnum(
        "runtime_api_trace_cbid",
        {
            "INVALID": 0,
            "cudaMalloc_v3020": MALLOC,
            "cudaStreamSynchronize_v3020": SYNC,
            "cudaLaunchKernel_v7000": LAUNCH,
            "cudaGraphLaunch_v10000": GRAPH,
        },
    ),
    driver_api_trace_cbid=enum.IntEnum("driver_api_trace_cbid", {"cuLaunchKernelEx": 652}),
)
RT = detach.RUNTIME_DOMAIN
PATIENCE_S = 60.0  # a safety net for a hung test; a loaded machine passes long before it


def call_once_armed(lib: FakeLib, *calls: tuple[int, int]) -> threading.Thread:
    """The target's CUDA calls, made from another thread once the hook listens for the last
    of them (a call before that reaches no callback): the test then depends on order, not on
    timing."""

    def run() -> None:
        end = time.monotonic() + PATIENCE_S
        while not (lib.cb is not None and calls[-1] in lib.enabled) and time.monotonic() < end:
            time.sleep(0.005)
        for domain, cbid in calls:
            lib.call(domain, cbid)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_callback_ids_are_launches_and_synchronizes_only():
    ids = detach.callback_ids(CUPTI)
    assert set(ids) == {(RT, LAUNCH), (RT, GRAPH), (RT, SYNC), (detach.DRIVER_DOMAIN, 652)}
    assert detach.callback_ids(CUPTI, detach.GRAPH_LAUNCH) == [(RT, GRAPH)]


def test_finalized_at_the_exit_of_the_next_launch_not_before():
    lib = FakeLib()
    hook = detach.finalize_at_next_call(lib, CUPTI, wait_s=0.0)
    assert hook.state == "armed" and lib.events == ["subscribe"]
    lib.call(RT, MALLOC)  # not a call the hook listens to
    assert hook.state == "armed"
    lib.call(RT, LAUNCH)
    assert hook.state == "finalized" and hook.wait(0)
    assert lib.events == ["subscribe", "unsubscribe", "finalize"]  # let go, then finalize
    lib.call(RT, LAUNCH)
    assert lib.events.count("finalize") == 1


def test_the_wait_sees_a_call_from_another_thread():
    lib = FakeLib()
    t = call_once_armed(lib, (RT, SYNC))
    hook = detach.finalize_at_next_call(lib, CUPTI, wait_s=PATIENCE_S)
    t.join()
    assert hook.state == "finalized"


def test_an_idle_target_stays_armed_until_a_new_client_cancels():
    lib = FakeLib()
    hook = detach.finalize_at_next_call(lib, CUPTI, wait_s=0.01)
    assert hook.state == "armed"
    assert hook.cancel() and hook.state == "cancelled"
    lib.call(RT, LAUNCH)
    assert "finalize" not in lib.events and not hook.cancel()


def test_another_subscriber_means_no_finalize():
    """torch.profiler or Nsight holds CUPTI: its state would go with a finalize."""
    lib = FakeLib(subscribe_rc=39)
    hook = detach.finalize_at_next_call(lib, CUPTI, wait_s=0.01)
    assert hook.state.startswith("failed") and "39" in hook.state
    assert lib.events == ["subscribe"] and not hook.cancel()


def test_graph_probe_finalizes_at_the_graph_launch():
    lib = FakeLib()
    t = call_once_armed(lib, (RT, LAUNCH), (RT, GRAPH))
    hook = detach.probe_graphs(lib, CUPTI, seconds=PATIENCE_S)
    t.join()
    assert hook.graph_seen and hook.state == "finalized"
    assert lib.events == ["subscribe", "unsubscribe", "finalize"]


def test_graph_probe_without_graphs_leaves_cupti_to_the_caller():
    lib = FakeLib()
    hook = detach.probe_graphs(lib, CUPTI, seconds=0.05)
    lib.call(RT, LAUNCH)
    assert not hook.graph_seen and hook.state == "cancelled"
    assert lib.events == ["subscribe", "unsubscribe"]


def test_a_library_without_the_callback_api_arms_nothing():
    lib = types.SimpleNamespace(cuptiSubscribe=lambda *a: 0)
    hook = detach.finalize_at_next_call(lib, CUPTI, wait_s=0.01)
    assert hook.state.startswith("failed: this libcupti has no")


def test_the_finalize_is_timed_and_a_release_adds_it_to_the_controllers_cost():
    """The finalize runs inside the target's own CUDA call: the hook times it, and the real
    controller adds each release's finalize to what the cost estimate counts (the stand-in
    library takes 20 ms to finalize; CUPTI itself is not here)."""
    from kdash.collectors.agent.controller import CuptiActivity

    lib = FakeLib()
    lib.finalize_s = 0.02
    c = CuptiActivity(1)
    c.cupti, c._lib = CUPTI, lib
    t = call_once_armed(lib, (RT, LAUNCH))
    assert c.release_between_windows(PATIENCE_S) == "finalized"
    t.join()
    assert c.hook is not None and c.hook.finalize_ns >= 20_000_000
    assert c.release_finalize_ns == c.hook.finalize_ns and c.releases == 1
    assert c.needs_register  # the next window registers again (and times that too)


def test_the_graph_guard_switches_every_kind_off_and_none_on_again():
    """The real controller's guard (called on the target's thread at its first torch graph
    replay): every kind off at once, a later window's resume switches nothing on, and the
    detach may still finalize, since no replay's kernel was recorded (the stand-in cupti
    below records the switches; CUPTI itself is not here)."""
    from kdash.collectors.agent.controller import CuptiActivity

    switched = []
    c = CuptiActivity(1)
    c.cupti = types.SimpleNamespace(
        activity_enable=lambda k: switched.append(("on", int(k))),
        activity_disable=lambda k: switched.append(("off", int(k))),
        activity_flush_all=lambda flag: None,
    )
    c.paused = [("kernels", 10), ("memcpy", 1)]
    assert c.resume() == "" and c.kinds_on() == [1, 10]
    c.graph_guard()
    assert c.kinds_on() == [] and c.graph_guarded and c.graphs_seen
    assert switched[-2:] == [("off", 10), ("off", 1)]
    assert c.pause() == "" and c.resume() == ""  # the window's edges: nothing goes on
    assert c.kinds_on() == [] and switched[-1] == ("off", 1)
    assert not c.graph_kernels_recorded  # what lets detach_cupti finalize


def test_the_narrowing_finds_its_ids_once_and_drops_those_that_refuse():
    """Every window's start narrows the API records again, holding the target's GIL: the ids
    are taken from the enum once, and an id CUPTI refuses is not asked again (a stand-in
    cupti below; CUPTI itself is not here)."""
    from kdash.collectors.agent.controller import CuptiActivity

    class Cbid(enum.IntEnum):
        INVALID = 0
        cudaGetDevice = 17
        cudaLaunchKernel = 211
        cudaFuncGetName = 300
        SIZE = 400

    calls = []

    def rtapi(cbid, on):
        calls.append((cbid, on))
        if cbid == 300:
            raise RuntimeError("not switchable")

    c = CuptiActivity(1)
    c.cupti = types.SimpleNamespace(runtime_api_trace_cbid=Cbid, activity_enable_runtime_api=rtapi)
    c.enabled = [("runtime", 5)]
    c._narrow_api_records(enable=True)
    assert calls == [(17, 0), (300, 0)]  # launches kept, markers skipped
    assert any("partly narrowed" in n for n in c.notes)
    calls.clear()
    c._narrow_api_records(enable=True)
    assert calls == [(17, 0)]
    c.last_enabled, c.enabled = c.enabled, []
    calls.clear()
    c._narrow_api_records(enable=False)
    assert calls == [(17, 1)]


def test_a_stop_between_released_windows_makes_no_cupti_call():
    """A STOP (or a guard's stop) that comes while CUPTI is released between windows: the
    disable switches nothing, flushes nothing and reads no counter, since any CUPTI call would
    initialise it again and the detach would then leave it in the process (a stand-in cupti
    below records every call; CUPTI itself is not here)."""
    from kdash.collectors.agent.controller import CuptiActivity

    calls = []

    def log(name):
        return lambda *a: calls.append(name)

    c = CuptiActivity(1)
    c.cupti = types.SimpleNamespace(
        activity_enable=log("enable"),
        activity_disable=log("disable"),
        activity_flush_all=log("flush"),
        activity_get_num_dropped_records=log("dropped"),
    )
    c.paused = [("kernels", 10)]
    c.released = True  # release_between_windows finalized CUPTI after the last window
    assert c.disable() == "" and calls == []
    assert c.last_enabled == [("kernels", 10)]
    assert c.detach_cupti(0.01) == "" and c.detach_state == "detached" and calls == []
    # not released (KDASH_AGENT_RELEASE=0, or PC sampling on): the flush still happens
    c2 = CuptiActivity(1)
    c2.cupti = c.cupti
    c2.paused = [("kernels", 10)]
    assert c2.disable() == "" and calls == ["flush", "dropped"]


def test_an_action_runs_on_the_targets_thread_at_its_calls_exit_and_cupti_stays():
    """The PC range's edges (run_at_next_call): run by the thread that made the CUDA call,
    after the hook let go (so the action's own CUDA calls reach no callback), no finalize."""
    lib = FakeLib()
    ran_on: list[str] = []
    t = call_once_armed(lib, (RT, MALLOC), (RT, LAUNCH))
    t.name = "target"
    hook = detach.run_at_next_call(
        lib, CUPTI, lambda: ran_on.append(threading.current_thread().name), PATIENCE_S
    )
    t.join()
    assert hook.state == "ran" and ran_on == ["target"] and hook.raised is None
    assert lib.events == ["subscribe", "unsubscribe"]  # no finalize


def test_an_actions_exception_goes_to_the_thread_that_armed_the_hook():
    lib = FakeLib()

    def fails() -> None:
        raise RuntimeError("cuptiPCSamplingStart: CUPTI_ERROR_NOT_COMPATIBLE")

    t = call_once_armed(lib, (RT, SYNC))
    hook = detach.run_at_next_call(lib, CUPTI, fails, PATIENCE_S)
    t.join()
    assert isinstance(hook.raised, RuntimeError) and hook.state.startswith("failed: RuntimeError")


def test_no_call_within_the_wait_runs_nothing_and_takes_the_hook_back():
    lib = FakeLib()
    ran: list[int] = []
    hook = detach.run_at_next_call(lib, CUPTI, lambda: ran.append(1), wait_s=0.01)
    assert hook.state == "cancelled" and lib.events == ["subscribe", "unsubscribe"]
    lib.call(RT, LAUNCH)
    assert ran == []


def test_the_controller_runs_an_edge_in_the_target_or_says_why_here():
    """controller.run_in_target on the stand-in library: in the target when it calls, here
    (with the reason) when it is idle or another subscriber holds CUPTI."""
    from kdash.collectors.agent.controller import CuptiActivity

    ctl = CuptiActivity.__new__(CuptiActivity)  # only the attributes run_in_target reads
    lib = FakeLib()
    ctl._lib, ctl.raw, ctl.cupti = lib, None, CUPTI
    where: list[str] = []
    t = call_once_armed(lib, (RT, LAUNCH))
    t.name = "target"
    how = ctl.run_in_target(lambda: where.append(threading.current_thread().name), PATIENCE_S)
    t.join()
    assert how == "target" and where == ["target"]
    how = ctl.run_in_target(lambda: where.append(threading.current_thread().name), 0.01)
    assert how == "here: cancelled" and where[-1] == threading.current_thread().name
    ctl._lib = FakeLib(subscribe_rc=39)
    how = ctl.run_in_target(lambda: where.append("x"), 0.01)
    assert how.startswith("here: failed") and where[-1] == "x"
