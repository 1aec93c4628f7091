"""The subcommands behind `kdash.cli`: each takes its options record (kdash.options) and returns
an exit status."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import BinaryIO

from kdash.errors import UserError
from kdash.options import (
    AttachOptions,
    DemoOptions,
    ExportOptions,
    LiveOptions,
    OpenOptions,
    ReportOptions,
    RunOptions,
)

DEMO_CAPTURE = "demo-h200.kdash"


# -- shared pieces -------------------------------------------------------------------------
def build_sources(
    target,
    gpus: list[int] | None,
    interval_s: float,
    inject_allowed: bool = True,
    try_inject: bool = True,
    pc_sampling: bool = False,
    cost_budget: float | None = None,
    graph_kernels: bool = False,
) -> list:
    """Host sources that work against any pid (scheduler, NVML) and the tree's kdash agents.

    `inject_allowed` False (`attach --no-inject`) is handed to the agent source, which decides
    what the kernel pane says when the tree has no agent; `try_inject` False (`kdash run`,
    whose processes start their own agents) only skips the injection.
    """
    from kdash.collectors.agents import AgentTreeSource
    from kdash.collectors.nvml import NvmlSource
    from kdash.collectors.sched import SchedSource

    _check_gpus(gpus)
    return [
        SchedSource(target, interval_s=interval_s),
        NvmlSource(target, gpus=gpus, interval_s=interval_s),
        AgentTreeSource(
            target,
            inject_allowed=inject_allowed,
            try_inject=try_inject,
            pc_sampling=pc_sampling,
            graph_kernels=graph_kernels,
            **({} if cost_budget is None else {"cost_budget": cost_budget}),
        ),
    ]


def gpu_count() -> int | None:
    """How many GPUs NVML sees here, or None when it cannot say (no driver, no pynvml)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - any failure: NVML cannot say; its pane will tell why
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _check_gpus(gpus: list[int] | None) -> None:
    """`--gpus` names GPUs this machine has (where NVML can tell; else its pane says why)."""
    if not gpus:
        return
    n = gpu_count()
    if n is None:
        return
    missing = [g for g in gpus if g >= n]
    if missing:
        have = f"GPUs 0-{n - 1}" if n > 1 else ("GPU 0" if n == 1 else "no GPU")
        raise UserError(f"--gpus {','.join(map(str, missing))}: this machine has {have}")


def _agent_opts(args: LiveOptions) -> dict:
    """The agent options of `attach` and `run` (and so `demo`), as build_sources takes them."""
    budget = args.cost_budget
    return {
        "pc_sampling": args.pc_sampling,
        "graph_kernels": args.graph_kernels,
        "cost_budget": None if budget is None else budget / 100,
    }


def _need_terminal(command: str, instead: str) -> None:
    """The dashboard draws on a terminal: into a pipe or a file it would write screen codes
    and never end. Say so at once, and what does work there."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UserError(f"`kdash {command}` draws a dashboard and needs a terminal; {instead}")


LIVE_INSTEAD = "without one use `--headless --duration S --output PATH`, or `kdash snapshot`"


def _check_output(path: Path) -> Path:
    from kdash.capture import check_new_path

    return check_new_path(path)


def _check_capture_dir(d: Path | None) -> Path:
    """Where `c` saves: checked as `--output`'s folder is (it must exist: a typo must not
    quietly make a folder the user then cannot find their captures in)."""
    d = Path.cwd() if d is None else d
    if d.exists() and not d.is_dir():
        raise UserError(f"--capture-dir {d} is not a folder")
    if not d.exists():
        raise UserError(f"no such folder: --capture-dir {d} (make it first)")
    if not os.access(d, os.W_OK):
        raise UserError(f"cannot write in --capture-dir {d}: permission denied")
    from kdash.capture import check_writable_folder

    try:
        check_writable_folder(d)
    except UserError as e:
        raise UserError(f"--capture-dir: {e}") from None
    return d


def _theme(name: str | None):
    """Theme to start with: --theme, else the saved one, else mono under NO_COLOR."""
    from kdash.config import load_config
    from kdash.tui.app import resolve_theme

    cfg = load_config()
    if name is not None:
        return cfg, resolve_theme(name)
    if os.environ.get("NO_COLOR"):
        return cfg, resolve_theme("mono")
    try:
        return cfg, resolve_theme(cfg.theme)
    except UserError:
        return cfg, resolve_theme("dark")


def _progress(total: float):
    tty = sys.stderr.isatty()

    def show(elapsed: float) -> None:
        if tty:
            print(f"\rkdash: recording {elapsed:4.0f}/{total:.0f} s", end="", file=sys.stderr)
        elif int(elapsed) % 5 == 0:
            print(f"kdash: recording {elapsed:.0f}/{total:.0f} s", file=sys.stderr)

    return show


def _make_recorder(sources: list, store, target, opts, server=None):
    """A plain Recorder, or the SGLang one (meta["sglang"], `c` through the server)."""
    from kdash.session import Recorder

    if server is None:
        return Recorder(sources, store, target, opts)
    from kdash.sglang import SglangRecorder

    return SglangRecorder(sources, store, target, opts, server)


def _sglang_sources(server, interval_s: float) -> list:
    """The server's metrics source, at most once a second: each scrape costs the server.

    A server kdash itself just started is still loading its model and refuses connections
    (an instant answer), so it is retried every 2 s instead of every 5 s: its first rows come
    soon after it is up.
    """
    from kdash.collectors.sglang_http import SglangMetricsSource

    if server is None or server.url is None:
        return []
    starting = not server.server_info and not server.tree.schedulers
    return [
        SglangMetricsSource(
            server.url,
            interval_s=max(1.0, interval_s),
            api_key=server.api_key,
            retry_s=2.0 if starting else 5.0,
        )
    ]


def _check_headless(args: LiveOptions) -> None:
    """The options of `attach`/`run` that go together (one line each when they do not)."""
    if args.headless and not args.exporting and (args.duration is None or args.output is None):
        raise UserError(
            "--headless needs --duration S and --output PATH (or --prometheus/--jsonl, "
            "to serve until stopped)"
        )
    if args.headless and args.output is not None and args.duration is None:
        raise UserError("--output needs --duration S")
    if not args.headless and (args.duration is not None or args.output is not None):
        raise UserError("--duration and --output go with --headless")
    if not args.headless and args.jsonl == "-":
        raise UserError(
            "--jsonl - writes to stdout, where the dashboard draws: give a file, or --headless"
        )
    if args.prometheus:
        from kdash.prom import parse_listen

        parse_listen(args.prometheus)


def _exporter(args: LiveOptions, store, sources):
    """`--prometheus`/`--jsonl` while the recorder runs (a no-op context without them)."""
    if not args.exporting:
        return contextlib.nullcontext(None)
    from kdash.prom import Exporter

    return Exporter(store, sources, args.prometheus, args.jsonl)


def _serve_headless(target, args: LiveOptions, sources: list, server=None) -> int:
    """`--headless --prometheus/--jsonl` without `--output`: serve until stopped (SIGINT or
    SIGTERM) or for --duration, and write no capture."""
    import signal

    from kdash.session import RecorderOptions
    from kdash.store import Store

    store = Store(retention_s=120.0)
    opts = RecorderOptions(interval_s=args.interval)
    rec = _make_recorder(sources, store, target, opts, server)
    old = {
        sig: signal.signal(sig, lambda *a: rec.stop()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        with _exporter(args, store, sources) as ex:
            if ex is not None and ex.address is not None:
                host, port = ex.address
                print(f"kdash: metrics on http://{host}:{port}/metrics", file=sys.stderr)
            rec.run_for(args.duration if args.duration is not None else float("inf"))
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    print("kdash: stopped", file=sys.stderr)
    return 0


def _record_headless(
    target, args: LiveOptions, sources: list, extra_meta: dict | None = None, server=None
) -> int:
    """`--headless`: record for --duration and write --output (or serve, without --output)."""
    from kdash import clock
    from kdash.analyses.cost import cost_text
    from kdash.session import RecorderOptions
    from kdash.store import Store

    if args.output is None:
        return _serve_headless(target, args, sources, server=server)
    out = _check_output(args.output)
    store = Store(retention_s=args.duration + 60, max_rows=20_000_000)
    opts = RecorderOptions(interval_s=args.interval)
    rec = _make_recorder(sources, store, target, opts, server)
    start = clock.now_ns()
    show = _progress(args.duration)
    costs: list[float] = []

    from kdash.collectors.base import CostEstimating

    def progress(elapsed: float) -> None:
        # the estimate exists only while the agents are connected: read it as the run goes
        for s in sources:
            value = s.cost_estimate() if isinstance(s, CostEstimating) else None
            if value is not None:
                costs.append(value)
        show(elapsed)

    with _exporter(args, store, sources) as ex:
        if ex is not None and ex.address is not None:
            print(
                f"kdash: metrics on http://{ex.address[0]}:{ex.address[1]}/metrics", file=sys.stderr
            )
        rec.run_for(args.duration, progress=progress)
    end = clock.now_ns()
    if sys.stderr.isatty():
        print(file=sys.stderr)
    extra = dict(extra_meta or {})
    if costs:
        extra["cost_estimate"] = {"last": costs[-1], "max": max(costs)}
    path = rec.write_window(start, end, out, extra_meta=extra)
    rows = {k: v["rows"] for k, v in store.stats().items() if v["rows"]}
    health = ", ".join(f"{s.name}: {s.health}" for s in sources)
    cost = f"; {cost_text(costs[-1])}" if costs else ""
    print(
        f"kdash: saved {path} ({(end - start) / 1e9:.1f} s; rows {rows}{cost}; {health})",
        file=sys.stderr,
    )
    if not target.alive():
        print(f"kdash: note: pid {target.pid} exited during the recording", file=sys.stderr)
    return 0


# -- attach ----------------------------------------------------------------------------------
def cmd_attach(args: AttachOptions) -> int:
    """`attach --pid` (an SGLang server's pid is recognised) or `attach --sglang URL`.

    An SGLang server is watched from its root, so the schedulers (where the GPU work runs)
    are in the tree every source reads; the server's /metrics is one more source.
    """
    from kdash.target import Target

    _check_headless(args)
    server = None
    api_key, admin_key = args.api_key, args.admin_api_key
    if args.sglang is not None:
        from kdash.sglang import discover_from_url

        server = discover_from_url(args.sglang, api_key, admin_key)
    else:
        Target.from_pid(args.pid)  # a dead or bad pid is refused first, in its own words
        from kdash.sglang import discover_from_pid

        server = discover_from_pid(args.pid, api_key, admin_key)
    root = server.tree.root.pid if server is not None and server.tree.root else args.pid
    target = Target.from_pid(root)
    sources = build_sources(
        target,
        args.gpus,
        args.interval,
        not args.no_inject,
        **_agent_opts(args),
    )
    sources += _sglang_sources(server, args.interval)
    if args.headless:
        return _record_headless(target, args, sources, server=server)
    cap_dir = _check_capture_dir(args.capture_dir)
    cfg, theme = _theme(args.theme)
    _need_terminal("attach", LIVE_INSTEAD)  # after every check of the options and the target
    title = None
    if server is not None:
        tp = server.server_info.get("tp_size") or server.tree.tp_size() or "?"
        title = f"SGLang server {server.url or f'pid {root}'} (TP {tp})"
    return _run_live(target, args, cfg, theme, cap_dir, title=title, server=server, sources=sources)


def _run_live(
    target,
    args: LiveOptions,
    cfg,
    theme,
    cap_dir: Path,
    title: str | None = None,
    server=None,
    sources: list | None = None,
) -> int:
    from kdash.session import RecorderOptions
    from kdash.session_control import LiveSession
    from kdash.store import Store
    from kdash.tui.app import KdashApp

    store = Store(retention_s=max(120.0, args.pre + args.post + 60))
    opts = RecorderOptions(
        interval_s=args.interval,
        pre_s=args.pre,
        post_s=args.post,
        capture_dir=cap_dir,
        thresholds=cfg.thresholds,
    )
    if sources is None:
        sources = build_sources(target, args.gpus, args.interval, **_agent_opts(args))
    rec = _make_recorder(sources, store, target, opts, server)
    meta = {"target": target.describe(), "title": title}
    if server is not None:
        meta["sglang"] = rec.sglang_meta()
    app = KdashApp(store=store, session=LiveSession(rec), meta=meta, config=cfg, theme=theme)
    with _exporter(args, store, sources):
        app.run()
    return 0


# -- run ---------------------------------------------------------------------------------------
def cmd_run(args: RunOptions, title: str | None = None, extra_meta: dict | None = None) -> int:
    """Run CMD with the agent armed in it and its Python children, and watch (or record) it.

    kdash owns the command it started: when the dashboard quits or the recording ends, the
    command is stopped (SIGINT, then SIGTERM, then SIGKILL), so nothing is left running.
    """
    from kdash.collectors.agent.bootstrap import run_env
    from kdash.target import Target

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UserError("give the command to run after `--`, e.g. kdash run -- python app.py")
    _check_headless(args)
    import shutil

    if shutil.which(cmd[0]) is None:
        raise UserError(f"cannot run {cmd[0]}: no such program (or not executable)")
    out_check = _check_output(args.output) if args.headless else None
    cap_dir = None if args.headless else _check_capture_dir(args.capture_dir)
    cfg = theme = None
    if not args.headless:
        cfg, theme = _theme(args.theme)
        _need_terminal("run", "without one use `--headless --duration S --output PATH`")
    chosen = os.environ.get("KDASH_RUN_LOG")
    log_path = Path(chosen or f"kdash-run-{os.getpid()}.log")
    log, created = open_run_log(log_path, chosen=bool(chosen))
    try:
        proc = subprocess.Popen(cmd, env=run_env(os.environ), stdout=log, stderr=subprocess.STDOUT)
    except OSError as e:
        log.close()
        raise UserError(f"cannot run {cmd[0]}: {e.strerror or e}") from None
    try:
        time.sleep(0.2)
        if proc.poll() is not None:
            raise UserError(
                f"{cmd[0]} exited at once (status {proc.returncode}); its output is in {log_path}"
            )
        target = Target.from_pid(proc.pid)
        from kdash.sglang import starting_server

        server = starting_server(proc.pid, cmd)  # `kdash run -- python -m sglang.launch_server`
        sources = build_sources(
            target,
            args.gpus,
            args.interval,
            try_inject=False,
            **_agent_opts(args),
        )
        sources += _sglang_sources(server, args.interval)
        if server is not None and title is None:
            title = f"SGLang server {server.url} (started by kdash run)"
        if args.headless:
            return _record_headless(
                target,
                replace(args, output=out_check),
                sources,
                extra_meta=extra_meta,
                server=server,
            )
        return _run_live(
            target, args, cfg, theme, cap_dir, title=title, server=server, sources=sources
        )
    finally:
        _stop_child(proc)
        log.close()
        # a command that printed nothing leaves no empty log behind in the user's folder; only
        # the file made here, and only while the name still leads to it
        with contextlib.suppress(OSError):
            st = log_path.lstat()
            if created and st.st_size == 0 and (st.st_dev, st.st_ino) == created:
                log_path.unlink()


def open_run_log(path: Path, chosen: bool = False) -> tuple[BinaryIO, tuple[int, int] | None]:
    """Open `kdash run`'s command log: the file, and its (device, inode) when made here.

    The default name sits in the current folder, which may be world-writable (/tmp): someone
    could plant a symlink or a file under the name for a root kdash to append to. So the
    default is always a new file (O_EXCL, 0600) and no name is followed (O_NOFOLLOW). A path
    the user chose with $KDASH_RUN_LOG may already exist: then it must be a plain file of
    theirs with no other links, or a device such as /dev/null.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if not chosen:
        flags |= os.O_EXCL
    what = f"the command's log {path}"
    existed = chosen and os.path.lexists(path)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise UserError(
            f"cannot write {what}: the name is taken by something else (remove it, or set "
            "KDASH_RUN_LOG to a new file)"
        ) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(
                f"cannot write {what}: it is a symlink, which kdash does not follow"
            ) from None
        raise UserError(f"cannot write {what}: {e.strerror or e}") from None
    st = os.fstat(fd)
    fresh = not existed and stat.S_ISREG(st.st_mode)
    ok = stat.S_ISCHR(st.st_mode) or (
        stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
    )
    if not ok:
        os.close(fd)
        raise UserError(
            f"cannot write {what}: it is not a plain file of yours (a FIFO, a file with other "
            "links, or another user's); kdash does not append to it"
        )
    os.set_blocking(fd, True)  # O_NONBLOCK only kept a planted FIFO from blocking the open
    created = (st.st_dev, st.st_ino) if fresh else None
    return os.fdopen(fd, "ab"), created


def _stop_child(proc: subprocess.Popen) -> None:
    import signal

    for sig, wait in ((signal.SIGINT, 5), (signal.SIGTERM, 5)):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait()


# -- open / report / export ------------------------------------------------------------------
def _load(path: Path):
    from kdash.capture import load_capture

    return load_capture(path)


def _store_from_capture(cap):
    from kdash import schema
    from kdash.store import Store

    store = Store(retention_s=10**7, max_rows=10**9)
    for t in schema.TABLES:
        store.append(t, cap.batch(t))
    return store


def open_capture(path: Path, theme_name: str | None, title: str | None = None) -> int:
    cap = _load(path)  # a bad file is reported before any UI starts
    _need_terminal("open", f"without one use `kdash report {path}`")

    from kdash.session_control import ReplaySession
    from kdash.tui.app import KdashApp

    cfg, theme = _theme(theme_name)
    meta = dict(cap.meta)
    if title:
        meta["title"] = title
    meta["capture_path"] = str(path)
    store = _store_from_capture(cap)
    app = KdashApp(
        store=store,
        session=ReplaySession(meta, store),
        meta=meta,
        config=cfg,
        theme=theme,
    )
    app.run()
    return 0


def cmd_open(args: OpenOptions) -> int:
    return open_capture(args.path, args.theme)


def cmd_report(args: ReportOptions) -> int:
    import json

    from rich.console import Console

    from kdash.report import DEFAULT_TOP, render, summarize

    top = args.top
    if top is not None and top < 1:
        raise UserError(f"--top must be at least 1, not {top}")
    summary = summarize(_load(args.path), top=top or DEFAULT_TOP)
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=1, default=str) + "\n")
    else:
        render(summary, Console(width=report_width(args.width)))
    return 0


PIPE_WIDTH = 200  # into a pipe or file nobody's window cuts the tables: wide enough for them


def report_width(asked: int | None) -> int | None:
    """The text report's width: --width N, else the terminal's (None lets rich measure it),
    else $COLUMNS, else PIPE_WIDTH (rich would take 80 and cut names and columns)."""
    if asked is not None:
        if asked < 40:
            raise UserError(f"--width must be at least 40, not {asked}")
        return asked
    if sys.stdout.isatty():
        return None
    cols = os.environ.get("COLUMNS", "")
    return int(cols) if cols.isdigit() and int(cols) >= 40 else PIPE_WIDTH


def cmd_export(args: ExportOptions) -> int:
    from kdash.export import write_perfetto

    cap = _load(args.path)
    out = args.perfetto
    if not (out.name.endswith(".json") or out.name.endswith(".json.gz")):
        raise UserError(f"--perfetto {out}: the name must end .json or .json.gz")
    if (out.exists() or out.is_symlink()) and not args.force:
        raise UserError(f"{out} exists; remove it, choose another name, or pass --force")
    path, n = write_perfetto(cap, out)
    size = path.stat().st_size
    print(
        f"kdash: wrote {path} ({n} events, {size / 1e6:.1f} MB); open it in ui.perfetto.dev",
        file=sys.stderr,
    )
    if size > 300e6:
        print(
            "kdash: note: over 300 MB; the Perfetto web UI may struggle — export a shorter capture",
            file=sys.stderr,
        )
    return 0


# -- demo ------------------------------------------------------------------------------------
def has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any NVML failure means "no usable GPU here"
        return False


def bundled_demo() -> Path:
    ref = resources.files("kdash").joinpath("data", DEMO_CAPTURE)
    path = Path(str(ref))
    if not path.exists():
        raise UserError(
            "this kdash install has no bundled demo capture (kdash/data/"
            f"{DEMO_CAPTURE}); reinstall, or run `kdash demo` on a GPU machine"
        )
    return path


def workload_missing() -> str:
    """Why the live demo workload cannot run in this interpreter ("" when it can).

    torch and triton are not kdash's runtime dependencies (they are large and the user's GPU
    stack picks their builds), so a plain `pip install kdash` on a GPU machine may lack them.
    """
    import importlib.util

    missing = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
    if missing:
        return f"the live demo needs {' and '.join(missing)} with CUDA in this Python"
    return ""


def cmd_demo(args: DemoOptions) -> int:
    gpu = has_gpu()
    why_not_live = workload_missing() if gpu else ""
    live = gpu and not args.replay and not why_not_live
    if args.headless:
        if gpu and why_not_live:
            raise UserError(f"`kdash demo --headless` records the live workload: {why_not_live}")
        if not live:
            raise UserError(
                "`kdash demo --headless` records the live workload: needs an "
                "NVIDIA GPU (use `kdash report` on the bundled capture instead)"
            )
        if args.duration is None or args.output is None:
            raise UserError("--headless needs --duration S and --output PATH")
    if not live:
        path = bundled_demo()
        from kdash.capture import read_meta
        from kdash.meta import CaptureMeta

        recorded = CaptureMeta.from_dict(read_meta(path)).title
        title = recorded or "replay of the kdash demo workload recorded on an H200"
        if why_not_live:
            reason = f"replay ({why_not_live})"
        elif args.replay:
            reason = "replay"
        else:
            reason = "replay (no GPU here)"
        # "replay" first: an 80-column header cuts the end of a long title
        return open_capture(path, args.theme, title=f"{reason} — {title}")
    return _demo_live(args)


def _demo_live(args: DemoOptions) -> int:
    """`kdash run -- python -m kdash.kernels`: the attention workload under the agent.

    Decode steps replay from CUDA graphs as a real server's do, so the agent is asked for the
    kernels of graph replays (`--graph-kernels`): the CUPTI it leaves in the process costs that
    process until it exits, which is the demo's own and exits with kdash. `--eager-decode`
    launches every kernel from Python instead (the host-bound pathology). Every other option
    of `kdash run` keeps its default."""
    eager = args.eager_decode
    mode = "--eager-decode" if eager else "--graph-decode"
    run_args = RunOptions(
        cmd=[sys.executable, "-m", "kdash.kernels", mode],
        graph_kernels=not eager,
        theme=args.theme,
        headless=args.headless,
        duration=args.duration,
        output=args.output,
    )
    gpu = _gpu_name()
    return cmd_run(
        run_args,
        title=f"kdash demo: attention workload (kdash.kernels) on {gpu}",
        extra_meta={"title": f"kdash demo workload (paged decode + prefill) on {gpu}"},
    )


def _gpu_name() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - only used for a title
        return "an NVIDIA GPU"
