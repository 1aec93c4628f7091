"""The optional capabilities of sources (collectors.base) and recorders (session_control) are
declared Protocols, and the classes that have their methods satisfy them: a method renamed in a
source, or a Protocol changed without its sources, fails here instead of silently switching a
key off in the dashboard (the app tests `isinstance` and calls the method)."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from collections.abc import Callable

import kdash.collectors as collectors
import pytest
from kdash.collectors.base import (
    CAPABILITIES,
    ActiveAgents,
    ContinuousSwitch,
    CostEstimating,
    DescribesGpus,
    ExtraHealth,
    Paced,
    PausableAgents,
    PcSamplingStatus,
    PcSamplingSwitch,
)
from test_sglang_attach import _recorder, _server

from kdash.session import Recorder
from kdash.session_control import (
    RECORDER_CAPABILITIES,
    CaptureDetail,
    DescribesServer,
    ServerCapture,
)
from kdash.store import Store
from kdash.target import Target


def _methods(proto: type) -> dict[str, Callable]:
    return {n: f for n, f in vars(proto).items() if inspect.isfunction(f) and not n.startswith("_")}


def _source_classes() -> dict[str, type]:
    """Every class in collectors/ that is a source (start, poll and stop), by qualified name."""
    out = {}
    for info in pkgutil.walk_packages(collectors.__path__, "kdash.collectors."):
        mod = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__ or getattr(cls, "_is_protocol", False):
                continue
            if all(callable(getattr(cls, m, None)) for m in ("start", "poll", "stop")):
                out[f"{cls.__module__}.{cls.__name__}"] = cls
    return out


def _instances() -> dict[str, object]:
    """One instance of each source class, built without starting it (nothing is read)."""
    from kdash.collectors.agent.client import AgentSource
    from kdash.collectors.agents import AgentTreeSource
    from kdash.collectors.nvml import NvmlSource
    from kdash.collectors.sched import SchedSource
    from kdash.collectors.sglang_http import SglangMetricsSource

    me = Target.from_pid(os.getpid())
    made = [
        AgentTreeSource(me),
        AgentSource(os.getpid()),
        NvmlSource(me),
        SchedSource(me),
        SglangMetricsSource("http://127.0.0.1:9"),
    ]
    return {f"{type(o).__module__}.{type(o).__name__}": o for o in made}


# What the app, the recorder and the exporters rely on each source for.
EXPECTED = {
    "kdash.collectors.agents.AgentTreeSource": {
        Paced,
        ExtraHealth,
        CostEstimating,
        ActiveAgents,
        ContinuousSwitch,
        PcSamplingSwitch,
        PcSamplingStatus,
        PausableAgents,
    },
    "kdash.collectors.agent.client.AgentSource": {
        ContinuousSwitch,
        PcSamplingSwitch,
        PcSamplingStatus,
    },
    "kdash.collectors.nvml.NvmlSource": {Paced, DescribesGpus},
    "kdash.collectors.sched.SchedSource": {Paced},
    "kdash.collectors.sglang_http.SglangMetricsSource": {Paced},
}


def _check_signatures(obj: object, proto: type) -> None:
    """Each of the Protocol's methods takes, on `obj`, the arguments the Protocol passes."""
    for name, f in _methods(proto).items():
        want = [
            p
            for p in list(inspect.signature(f).parameters.values())[1:]
            if p.default is inspect.Parameter.empty
        ]
        have = inspect.signature(getattr(obj, name))
        have.bind(*[None] * len(want))  # raises TypeError when the arity differs


def test_every_source_class_with_a_capability_method_satisfies_its_protocol():
    classes = _source_classes()
    instances = _instances()
    assert set(classes) == set(instances), "add the new source class to _instances()"
    checked = 0
    for qual, cls in classes.items():
        obj = instances[qual]
        for proto in CAPABILITIES:
            if not any(hasattr(cls, m) for m in _methods(proto)):
                continue
            assert isinstance(obj, proto), f"{qual} has a method of {proto.__name__}, not all"
            _check_signatures(obj, proto)
            checked += 1
    assert checked >= 10  # the agents' tree alone has seven


@pytest.mark.parametrize("qual", sorted(EXPECTED))
def test_each_source_offers_what_its_callers_rely_on(qual):
    obj = _instances()[qual]
    have = {p for p in CAPABILITIES if isinstance(obj, p)}
    assert have == EXPECTED[qual], sorted(p.__name__ for p in have ^ EXPECTED[qual])


def test_the_sglang_recorder_satisfies_the_recorder_protocols(tmp_path):
    rec = _recorder(tmp_path, _server(None))
    for proto in RECORDER_CAPABILITIES:
        assert isinstance(rec, proto), proto.__name__
        _check_signatures(rec, proto)
    plain = Recorder([], Store(), None)
    assert not any(isinstance(plain, p) for p in (DescribesServer, CaptureDetail, ServerCapture))


def test_no_caller_looks_a_capability_up_by_name():
    """The capabilities are asked by `isinstance`, not by `getattr(src, name)`/`hasattr`."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = {n for p in (*CAPABILITIES, *RECORDER_CAPABILITIES) for n in _methods(p)}
    names |= {"interval_s", "continuous", "pc_sampling", "server_job"}
    found = []
    for folder in ("tui", "kdash", "collectors"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            for n in names:
                for probe in (f'getattr(s, "{n}"', f'getattr(src, "{n}"', f'hasattr(src, "{n}"'):
                    if probe in text:
                        found.append(f"{path.relative_to(root)}: {probe}")
            if "getattr(src, setter)" in text or 'getattr(self.recorder, "' in text:
                found.append(f"{path.relative_to(root)}: getattr by a computed name")
    assert found == []
