"""How the agent is put together: one loader that brings every module of the agent into a
process without the `kdash` package, standard library only at module level; the one record
field map covering the schema; modules small enough to read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fakes import fake_cupti_module
from kdash.collectors.agent import fields, loader

import kdash.schema

AGENT_DIR = Path(loader.__file__).resolve().parent


def test_the_loader_brings_the_agent_in_without_the_kdash_package():
    """What sitecustomize and the injected boot code do: load loader.py by path, then the
    agent. A module missing from AGENT_MODULES, or imported as `from . import x`, would pull
    the `kdash` package in; a third-party import at module level would show up as well."""
    code = (
        "import importlib.util, json, sys\n"
        "name = 'kdash.collectors.agent.loader'\n"
        f"spec = importlib.util.spec_from_file_location(name, {str(AGENT_DIR / 'loader.py')!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "server = mod.load_agent()\n"
        "print(json.dumps({'modules': sorted(sys.modules), 'agent': hasattr(server, "
        "'start_agent'), 'order': list(mod.AGENT_MODULES)}))\n"
    )
    r = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    mods = out["modules"]
    assert out["agent"]
    assert "kdash" not in mods and "kdash.collectors" not in mods
    agent = {m.rsplit(".", 1)[1] for m in mods if m.startswith("kdash.collectors.agent.")}
    assert agent == set(out["order"])
    tops = {m.split(".")[0] for m in mods} - {"kdash"}
    foreign = sorted(t for t in tops - set(sys.stdlib_module_names) if not t.startswith("_"))
    assert foreign == []
    assert "typing" not in mods  # every armed process would pay for it


def test_every_loaded_module_is_a_file_of_the_agent():
    for name in loader.AGENT_MODULES:
        assert (AGENT_DIR / f"{name}.py").is_file(), name


def test_the_field_map_covers_every_column_the_agent_sends():
    for table, cols in fields.ROW_COLUMNS.items():
        schema_cols = [c for c, _t in kdash.schema.TABLES[table]]
        # "pid" is the agent's own where a record has none; every other column comes from
        # the map (or, for markers, from the pairing of NVTX records)
        assert set(schema_cols) - {"pid"} <= set(cols) <= set(schema_cols), table
    for table, kinds, row in fields.RECORDS:
        cols = [c for c, _a, _h in row]
        assert set(cols) <= set(fields.ROW_COLUMNS[table]), (table, kinds)
        missing = set(fields.ROW_COLUMNS[table]) - set(cols) - {"pid", "tid"}
        for kname in kinds:
            assert missing <= set(fields.CONSTANTS.get(kname, {})), (kname, missing)


def test_the_field_map_names_fields_that_the_record_layouts_have():
    """Against the stand-in cupti's dtypes, which copy cupti-python 13.0's layouts."""
    fake = fake_cupti_module()
    for _table, kinds, row in fields.RECORDS:
        for kname in kinds:
            dt = getattr(fake, fields.RECORD_DTYPES[kname])
            assert {a for _c, a, _h in row} <= set(dt.names), kname


def test_agent_modules_stay_small():
    for path in sorted(AGENT_DIR.glob("*.py")):
        assert len(path.read_text().splitlines()) <= 800, path.name


def test_the_boot_code_fits_the_page_it_is_written_to():
    from kdash.collectors.agent import inject, ptrace_session

    code = inject.boot_code(4194303)
    assert len(code.encode()) + 1 <= 4096 - ptrace_session.D_CODE
    assert "loader.py" in code and "load_agent()" in code
    compile(code, "boot", "exec")


def test_an_armed_process_imports_nothing_heavy_until_a_client_comes():
    from kdash.collectors.agent import bootstrap

    code = (
        "import sys, time\n"
        "time.sleep(1.0)  # the agent's listener thread has long been waiting by now\n"
        "s = sys.modules['kdash.collectors.agent.server']\n"
        "print(s.current_agent() is not None, 'numpy' in sys.modules, 'kdash' in sys.modules)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=bootstrap.run_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "False"]


def test_the_socket_appears_only_once_it_listens(tmp_path):
    """Bound under a hidden name and moved into place after listen(): a client that finds
    `<pid>.sock` is never refused by a socket still being set up."""
    import os
    import socket

    from kdash.collectors.agent import security, server

    folder = tmp_path / "kd"
    path = folder / "4194301.sock"
    folder.mkdir(mode=0o700)
    dead = folder / ".4194302.binding"  # left by a process killed mid-listen
    dead.write_text("")
    agent = server.Agent(str(path))
    agent.listen()
    try:
        assert sorted(os.listdir(folder)) == ["4194301.sock"]  # the leftover was swept too
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(path))  # accepted: it was listening before it had this name
    finally:
        agent.close()
    assert not path.exists()
    assert security.sweep_stale(str(folder)) == 0
