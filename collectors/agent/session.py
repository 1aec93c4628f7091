"""One client's session, as a state machine: a phase, one handler per message type, and a step
that the session's thread runs after every message and at least every POLL_S.

Phases: IDLE (no START yet, stopped, or CUPTI cannot be had here), WAITING (START taken, CUPTI
not on yet: the target has not loaded CUDA, or another CUPTI client holds it), ACTIVE (CUPTI
activity on, switched by the duty cycle). The session owns nothing process-wide: the CUPTI
controller, the outbox and the PC-sampling runner belong to the agent (server.Agent) and
outlive it. The socket is not the session's either: frames go out through `send`, so the
tests drive a session in-process against a fake controller.

When the client says STOP, disconnects, or dies (SIGKILL closes its socket, which the agent
sees as EOF or a send error within its 50 ms poll), every enabled activity kind is disabled
and the buffers are flushed; then CUPTI is finalized at the exit of the target's next launch
or synchronize call (detach.py), because CUPTI merely attached costs a graph-replaying process
up to 17% for as long as it stays. Kinds left on for another CUPTI client (torch.profiler, see
controller.CuptiActivity.step_aside) are switched off at the end of the session once that
client has finished, and CUPTI is then left to that client.

CUDA graphs: once kernel activity has been on while a process replays CUDA graphs, finalizing
kills it, so CUPTI could never leave it again. START therefore first listens for graph
launches (GRAPH_PROBE_S); a process that replays graphs gets no kernel activity, and CUPTI is
finalized at that launch's exit, unless START says `graph_kernels` (`--graph-kernels`). A graph
kernel that shows up later (graphs begun after START) stops kernel activity for good.
"""

from __future__ import annotations

import enum
import os
import time

from .constants import (
    DETACH_WAIT_S,
    ENV_ACTIVITIES,
    ENV_PC_FIRST_REFRESH,
    ENV_RELEASE,
    FLUSH_EVERY_S,
    GRAPH_PROBE_S,
    MAX_NAME_CHARS,
    MAX_SESSION_NAME_BYTES,
    MAX_SESSION_NAMES,
    OFFSET_EVERY_S,
    POLL_S,
)
from .controller import Unavailable
from .duty import DutyClock, DutyCycle, PCConfig, parse_activities, sampling_text
from .pcrun import PCState

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from .server import Agent

HELD_CHECK_S = 1.0  # how often an active session looks for another CUPTI client
RELEASE_WAIT_S = 0.2  # how long a window's end waits for the target's next CUDA call
# how long a PC range's beginning or end waits for the target's next CUDA call to run in; an
# idle target (no call meanwhile, so no launch in flight) has them run on the range's thread
PC_EDGE_WAIT_S = 1.0
PC_REFRESH_WAIT_S = 0.5  # how long a PC refresh waits for the target's next CUDA call
RETRY_S = 1.0  # how long a START waits before asking for CUPTI again (another client holds it)
MAPS_RETRY_S = 0.5  # ... before looking again whether CUDA is loaded (/proc/self/maps is ~1 MB)


def active_line(names: str, cycle: DutyCycle) -> str:
    return f"ok: CUPTI activity on, {sampling_text(cycle.describe())} ({names})"


def graphs_line(pid: int, cupti_started: bool = True) -> str:
    how = "CUPTI was detached" if cupti_started else "kdash never started CUPTI in it"
    # the advice before the why: a pane at 80x24 shows the first three lines of it
    return (
        f"kernel activity off: pid {pid} replays CUDA graphs; `--graph-kernels` records "
        "their kernels, but then CUPTI cannot leave the process on this driver (it stays "
        f"8-25% slower until it restarts); {how}"
    )


def tainted_line(pid: int) -> str:
    return (
        f"kernel activity stopped: pid {pid} began replaying CUDA graphs; with their "
        "kernels recorded CUPTI cannot be taken out of it again on this driver, so it "
        "stays attached, idle, until the process exits. `--graph-kernels` keeps recording"
    )


class Phase(enum.Enum):
    IDLE = "idle"
    WAITING = "waiting"
    ACTIVE = "active"


class Session:
    """One client's session; `step(msg)` after each message and at least every POLL_S."""

    def __init__(
        self,
        agent: Agent,
        send: Callable[[bytes], None],
        wire: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agent = agent
        self.send = send
        self.wire = wire
        self.now = clock
        self.strings = wire.StringEncoder(MAX_SESSION_NAMES, MAX_SESSION_NAME_BYTES, MAX_NAME_CHARS)
        self.phase = Phase.IDLE
        self.acts: list[str] = []  # what to switch on once WAITING is over
        self.last_sent: tuple[str, str] | None = None
        self.pc_cfg = PCConfig()
        self.next_pc = 0.0  # when the next PC-sampling range may start
        # the first range CUPTI put in its non-user bucket is followed by one right after the
        # refresh, not a (budget-spaced) period later: the user pressed L to see a hot line
        self.pc_retried = False
        self.pc_started = 0  # PC ranges started in this session
        # CUPTI finalized after each window unless the target's environment says not
        self.release = os.environ.get(ENV_RELEASE, "1") != "0"
        # CUPTI refreshed before the first PC range, unless the target's environment says not
        # (to measure what the refresh changes)
        self.pc_first_refresh = os.environ.get(ENV_PC_FIRST_REFRESH, "1") != "0"
        self.pc_paused_activity = False  # a range paused continuous activity: resume after it
        # armed on torch's CUDAGraph.replay while activity is on (replaywatch.py): the target's
        # first replay switches every kind off before it runs
        self.graph_guard: Any = None
        self.duty = DutyClock(agent.outbox.add_window)
        now = clock()
        self.last_flush = self.last_offset = self.last_held_check = now
        mt = wire.MsgType
        self.handlers: dict[Any, Callable[[Any], bool]] = {
            mt.START: self.on_start,
            mt.SET: self.on_set,
            mt.STOP: self.on_stop,
            mt.STATS: self.on_stats,
        }

    @property
    def ctl(self) -> Any:
        """The agent's CUPTI controller (None until the first START has been tried)."""
        return self.agent.controller

    # ---- talking to the client -----------------------------------------------------------

    def status(self, state: str, line: str, force: bool = False) -> None:
        """Set the agent's state and tell the client, unless it was told exactly that last
        (a START that retries every second does not repeat itself)."""
        self.agent.state, self.agent.line = state, line
        if force or self.last_sent != (state, line):
            self.last_sent = (state, line)
            body = self.agent.status_body(state, line, self.duty.cycle)
            self.send(self.wire.encode_control(self.wire.MsgType.STATUS, body))

    def send_rows(self) -> None:
        c = self.ctl
        d = self.duty
        self.agent.outbox.send(
            self.send,
            self.strings,
            c.offset_ns if c is not None else 0,
            d.start_ns if d.on else None,
        )

    def timeout(self) -> float:
        """How long the session's thread may wait for the client before the next step."""
        if self.phase is Phase.ACTIVE:
            return max(0.0, min(POLL_S, self.duty.next_edge - self.now()))
        return POLL_S

    # ---- one step --------------------------------------------------------------------------

    def step(self, msg: Any = None) -> None:
        """Handle `msg` (if any), then do what is due: start, switch a window, sample, flush,
        send. A handler that refused its message leaves the rest to the next step."""
        try:
            self._step(msg)
        finally:
            if self.phase is not Phase.ACTIVE:  # stopped, stepped aside, or never started
                self.disarm_graph_guard()

    def _step(self, msg: Any) -> None:
        if msg is not None and not self.handlers.get(msg.type, self.on_other)(msg):
            return
        if self.phase is Phase.WAITING:
            self.phase = self.try_start()
            if self.phase is Phase.ACTIVE:
                self.duty.begin(self.now(), self.ctl)
        if self.phase is Phase.ACTIVE and self.ctl is not None and not self.tick(self.now()):
            return
        self.send_rows()

    # ---- the handlers: True when the step goes on ------------------------------------------

    def on_start(self, msg: Any) -> bool:
        if self.phase is not Phase.IDLE:
            self.status(self.agent.state, self.agent.line, force=True)
            return False
        body = msg.body
        env_acts = [a for a in os.environ.get(ENV_ACTIVITIES, "").split(",") if a]
        acts, act_note = parse_activities(body.get("activities") or env_acts)
        if acts is None:
            self.status("error", f"error: START {act_note}")
            return False
        duty, why = DutyCycle.parse(body, DutyCycle())
        pcc, why_pc = PCConfig.parse(body, PCConfig())
        if duty is None or pcc is None:
            self.status("error", f"error: START {why or why_pc}")
            return False
        self.pc_cfg = pcc
        self.agent.pc.reset(PCState.STARTING if pcc.on else PCState.OFF)
        if pcc.on and self.pc_first_refresh:
            self.agent.pc.want_fresh_start()
        self.duty.cycle = duty
        self.agent.graph_kernels = body.get("graph_kernels") is True
        self.phase, self.acts = Phase.WAITING, acts
        self.agent.next_try = 0.0
        self.agent.act_note = act_note
        if self.ctl is not None:
            self.ctl.notes = []
        return True

    def on_set(self, msg: Any) -> bool:
        duty, why = DutyCycle.parse(msg.body, self.duty.cycle)
        if duty is None:
            self.status("error", f"error: SET {why}")
            return False
        pcc, why = PCConfig.parse(msg.body, self.pc_cfg)
        if pcc is None:
            self.status("error", f"error: SET {why}")
            return False
        pc = self.agent.pc
        if pcc.on and not self.pc_cfg.on:
            self.next_pc = 0.0
            pc.set_state(PCState.STARTING)
            if self.pc_first_refresh:
                pc.want_fresh_start()
        elif not pcc.on and self.pc_cfg.on:
            pc.stop()
            pc.set_state(PCState.OFF)
        elif pcc.on and pcc.period_ms != self.pc_cfg.period_ms:
            # a new spacing counts from the last range's start, not from the next one's
            self.next_pc += (pcc.period_ms - self.pc_cfg.period_ms) / 1000
        self.pc_cfg = pcc
        if self.phase is Phase.ACTIVE:
            self.duty.retime(self.now(), duty)
            c = self.ctl
            names = ", ".join(a for a, _ in (c.enabled or []))
            names = names or ", ".join(a for a, _ in c.paused)
            self.status("active", active_line(names, duty), force=True)
        else:
            self.duty.cycle = duty
            self.status(self.agent.state, self.agent.line, force=True)
        return True

    def on_stop(self, msg: Any) -> bool:
        self.agent.pc.stop()
        self.pc_cfg = PCConfig()
        was_active = self.phase is Phase.ACTIVE
        self.phase = Phase.IDLE
        if not was_active:
            self.status("idle", "idle: stopped")
            return True
        c = self.ctl
        err = c.disable() if c is not None else ""
        self.duty.end(c.disabled_at_ns if c is not None else 0)
        if c is not None and not err:
            err = c.detach_cupti(DETACH_WAIT_S)
        self.send_rows()
        self.status("idle", "idle: stopped" + (f" ({err})" if err else ""))
        return True

    def on_stats(self, msg: Any) -> bool:
        body = self.agent.stats(self.duty.cycle)
        self.send(self.wire.encode_control(self.wire.MsgType.STATS, body))
        return True

    def on_other(self, msg: Any) -> bool:
        self.status("error", f"error: {msg.type.name} is not a client message")
        return True

    # ---- WAITING -> ACTIVE -----------------------------------------------------------------

    def try_start(self) -> Phase:
        """One step of START: probe CUPTI, wait for CUDA, enable.

        The phase that follows: ACTIVE once enabled, WAITING (for CUDA to be loaded, or for
        another CUPTI client to finish: checked again every second), IDLE when CUPTI cannot
        be had in this process at all (the STATUS line says why and what to do).
        """
        agent = self.agent
        now = self.now()
        if now < agent.next_try:
            return Phase.WAITING
        c = agent.controller
        if c is None:
            c = agent.controller = agent.make_controller(agent.pid)
        try:
            if c.cupti is None:
                # Nothing may load libcuda or cupti before the target has loaded CUDA itself:
                # until then only what can be seen from outside is checked.
                if not c.cuda_loaded():
                    c.precheck()
                    agent.next_try = now + MAPS_RETRY_S
                    self.status("waiting", f"waiting: pid {agent.pid} has not loaded CUDA yet")
                    return Phase.WAITING
                c.probe()
            else:
                held = c.held_by_other()
                if held:
                    raise Unavailable(f"{held}; kdash waits until it ends", retry=True)
            c.cancel_hook()
            c.graph_kernels = agent.graph_kernels
            if not c.graph_kernels and (c.graphs_seen or c.probe_graphs(GRAPH_PROBE_S)):
                # off by design, not broken: the client shows it as such (code graphs_off)
                cupti_started = getattr(c, "graph_probe", "") != "torch"
                self.status("off", f"off: {graphs_line(agent.pid, cupti_started)}")
                return Phase.IDLE
            c.enable(self.acts, agent.outbox.sink)
            self.arm_graph_guard(c)
        except Unavailable as e:
            self.status("unavailable", f"unavailable: {e}")
            if e.retry:
                agent.next_try = now + RETRY_S
                return Phase.WAITING
            return Phase.IDLE
        except Exception as e:  # noqa: BLE001 - say why in the STATUS line, stay idle
            if c.enabled:
                c.disable(flush=False)
            self.status(
                "unavailable", f"unavailable: enabling CUPTI failed: {type(e).__name__}: {e}"
            )
            return Phase.IDLE
        names = ", ".join(a for a, _ in c.enabled)
        self.status("active", active_line(names, self.duty.cycle))
        return Phase.ACTIVE

    # ---- ACTIVE ----------------------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """What is due while CUPTI is on; False when the session has just left ACTIVE (the
        rows then went out already)."""
        c = self.ctl
        due = not self.duty.on and now >= self.duty.next_edge
        if (now - self.last_held_check >= HELD_CHECK_S or due) and self.other_client_came(now):
            return False
        if c.graph_kernels_recorded and not c.graph_kernels:
            self.stop_for_graphs()
            return False
        if getattr(c, "graph_guarded", False) and not c.graph_kernels:
            self.stop_for_guard()
            return False
        if c.raw_failed and c.mode == "raw" and self.duty.on and not self.reread_as_objects():
            return False
        if now >= self.duty.next_edge:
            was_on = self.duty.on
            self.duty.edge(now, c, self.agent.pc.busy)
            # Not while PC sampling is on: its ranges start right after a window, and a range
            # started just after a finalize found no active context in a live attach on the
            # H200 (bench/results/pcs-s6-h200.json); pcrun refreshes CUPTI when it needs to.
            if was_on and not self.duty.on and not self.pc_cfg.on and self.release:
                c.release_between_windows(RELEASE_WAIT_S)
        self.pc_tick(now)
        if self.duty.on and now - self.last_flush >= FLUSH_EVERY_S:
            c.flush()
            self.last_flush = now
        if now - self.last_offset >= OFFSET_EVERY_S and not c.released:  # would init CUPTI
            try:
                c.measure_offset()
            except Exception as e:  # noqa: BLE001 - keep the previous offset
                c.last_error = f"offset: {type(e).__name__}: {e}"
            self.last_offset = now
        return True

    def other_client_came(self, now: float) -> bool:
        """Another CUPTI client started (e.g. the user's torch.profiler): step aside at once,
        leaving its kinds on for it, and wait until it has ended (back to WAITING)."""
        self.last_held_check = now
        c = self.ctl
        held = c.held_by_other()
        if not held:
            return False
        self.phase = Phase.WAITING
        self.duty.end(time.monotonic_ns())
        c.step_aside()
        self.send_rows()
        self.status(
            "unavailable",
            f"unavailable: {held} (started while kdash was attached; "
            "CUPTI serves one client, so its trace may miss kernels); "
            "kdash paused and resumes when it ends",
        )
        self.acts = [a for a, _ in c.last_enabled]
        self.agent.next_try = now + RETRY_S
        return True

    def arm_graph_guard(self, c: Any) -> None:
        """A process that did not replay CUDA graphs while START listened may begin to (a
        server idle at the attach): its first torch replay switches kernel activity off
        before it runs (controller.graph_guard), so CUPTI can still leave it."""
        if c.graph_kernels or not hasattr(c, "graph_guard"):
            return
        from . import replaywatch

        self.disarm_graph_guard()
        self.graph_guard = replaywatch.guard_torch_replays(c.graph_guard)

    def disarm_graph_guard(self) -> None:
        if self.graph_guard is not None:
            self.graph_guard.disarm()
            self.graph_guard = None

    def stop_for_guard(self) -> None:
        """The target began replaying CUDA graphs and the guard switched activity off before
        the first replay: stop for good, and take CUPTI out (no replay's kernel was
        recorded, so a finalize is safe)."""
        c = self.ctl
        self.phase = Phase.IDLE
        self.disarm_graph_guard()
        c.disable()
        self.duty.end(c.disabled_at_ns)
        err = c.detach_cupti(DETACH_WAIT_S)
        if err:
            self.agent.last_error = err
        self.send_rows()
        self.status("off", f"off: {graphs_line(self.agent.pid)}")

    def stop_for_graphs(self) -> None:
        """A kernel of a CUDA-graph replay was recorded without `graph_kernels`: stop for good."""
        c = self.ctl
        self.phase = Phase.IDLE
        c.disable()
        self.duty.end(c.disabled_at_ns)
        c.detach_state = "attached for good (graph kernels recorded)"
        self.send_rows()
        self.status("off", f"off: {tainted_line(self.agent.pid)}")

    def reread_as_objects(self) -> bool:
        """A raw buffer could not be read: go on with cupti-python's record objects. False
        when CUPTI could not be switched on again (the session is then IDLE)."""
        c = self.ctl
        acts_now = [a for a, _ in c.enabled]
        c.use_raw = False
        c.disable(flush=False)
        try:
            c.enable(acts_now, self.agent.outbox.sink)
        except Exception as e:  # noqa: BLE001 - say so, stay idle
            self.phase = Phase.IDLE
            self.duty.end(c.disabled_at_ns)
            self.status("unavailable", f"unavailable: re-enabling CUPTI failed: {e}")
            return False
        self.status("active", active_line(", ".join(acts_now), self.duty.cycle))
        return True

    def pc_tick(self, now: float) -> None:
        """Start a PC-sampling range when one is due (activity off meanwhile), and switch
        continuous activity back on once a range it was cut for has ended."""
        pc = self.agent.pc
        # the one quick retry after a lossy range; not the refresh before the first range
        retry = not self.pc_retried and self.pc_started > 0 and pc.refresh_due(now)
        due = self.pc_cfg.on and (now >= self.next_pc or retry)
        due = due and not pc.busy and not pc.unavailable
        if due and (not self.duty.on or self.duty.cycle.continuous):
            self.pc_retried = self.pc_retried or retry
            if self.duty.cut(self.ctl):  # continuous: activity must be off during the range
                self.pc_paused_activity = True
            if pc.refresh_due(now):  # modules CUPTI cannot attribute: start it afresh
                pc.refreshed(self.ctl.refresh_for_pc(PC_REFRESH_WAIT_S), self.now())
            # the range's beginning and end on the target's own thread (controller.run_in_target)
            ctl = self.ctl
            pc.at_call = lambda fn: ctl.run_in_target(fn, PC_EDGE_WAIT_S)
            pc.start_range(self.pc_cfg.on_ms / 1000)
            self.pc_started += 1
            self.next_pc = now + self.pc_cfg.period_ms / 1000
        if self.pc_paused_activity and not pc.busy:
            self.pc_paused_activity = False
            self.duty.next_edge = now  # continuous: switch activity back on now

    # ---- the end ---------------------------------------------------------------------------

    def end(self, closing: bool) -> None:
        """Whatever way the session ended, leave CUPTI as if it had never been touched
        (`closing`: the process exits, so there is no "afterwards" to wait for)."""
        agent = self.agent
        agent.pc.stop()
        agent.pc.set_state(PCState.OFF)
        self.disarm_graph_guard()
        try:
            c = self.ctl
            err = ""
            if self.phase is Phase.ACTIVE and c is not None:
                err = c.disable()
                if self.duty.on:
                    agent.outbox.add_window(self.duty.start_ns, c.disabled_at_ns)
                if not err and not closing:
                    err = c.detach_cupti(DETACH_WAIT_S)
            elif c is not None and c.kinds_on() and c.held_by_other() is None:
                # left on by step_aside for a client (torch.profiler) that has ended since
                err = c.release_left_behind()
            if err:
                agent.last_error = err
        except BaseException as e:  # noqa: BLE001 - never into the target
            agent.last_error = f"detach: {type(e).__name__}: {e}"
        self.phase = Phase.IDLE
