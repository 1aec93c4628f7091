"""Topology helpers: cpulist forms, PCI bus ids, and the readers on this machine's real /sys.

The CI machine has no GPU, so the readers are checked on what exists: the online CPU list and
any PCI device's local_cpulist / local_cpus / numa_node, reached through an NVML-style bus id.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from kdash.collectors import topology as topo

from kdash.topology import Topology

PCI = Path("/sys/bus/pci/devices")


def _read(p: Path) -> str:
    return p.read_text()


def a_pci_device() -> Path:
    for d in sorted(PCI.glob("*")) if PCI.is_dir() else []:
        if (d / "local_cpulist").exists():
            return d
    pytest.skip("no PCI device with local_cpulist in this machine's /sys")


def nvml_style(bdf: str) -> str:
    """sysfs's "0000:00:05.0" as NVML prints it: 8-digit domain, upper case."""
    domain, rest = bdf.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8", {0, 1, 2, 3, 8}),
        ("5", {5}),
        ("", set()),
        ("\n", set()),
        ("0-1,4-5,7\n", {0, 1, 4, 5, 7}),
        ("0-15:2/4", {0, 1, 4, 5, 8, 9, 12, 13}),
    ],
)
def test_parse_cpulist(text: str, cpus: set[int]):
    assert topo.parse_cpulist(text) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "-1", "0-3:0/4", "2:1/2", "0-3:5/4"])
def test_parse_cpulist_rejects_garbage(bad: str):
    with pytest.raises(ValueError):
        topo.parse_cpulist(bad)


def test_format_cpulist_examples_and_round_trip():
    assert topo.format_cpulist({0, 1, 2, 3, 8}) == "0-3,8"
    assert topo.format_cpulist([]) == ""
    assert topo.format_cpulist([7]) == "7"
    assert topo.format_cpulist([1, 3, 2, 10, 11]) == "1-3,10-11"
    rng = random.Random(1234)
    for _ in range(200):
        cpus = {rng.randrange(256) for _ in range(rng.randrange(0, 40))}
        text = topo.format_cpulist(cpus)
        assert topo.parse_cpulist(text) == cpus
        assert " " not in text


def test_masks():
    assert topo.parse_cpumask("00000000,0000000f") == {0, 1, 2, 3}
    assert topo.parse_cpumask("1,00000001") == {0, 32}
    assert topo.parse_cpumask("0") == set()
    # NVML: least significant 64-bit word first.
    assert topo.cpus_from_mask_words([0b101, 1]) == {0, 2, 64}
    assert topo.cpus_from_mask_words([]) == set()


@pytest.mark.parametrize(
    ("nvml", "sysfs"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("00000000:AB:1F.7", "0000:ab:1f.7"),
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("18:00.0", "0000:18:00.0"),
        ("00010000:01:00.0", "10000:01:00.0"),  # VMD domains are wider than 4 digits
    ],
)
def test_normalize_bus_id(nvml: str, sysfs: str):
    assert topo.normalize_bus_id(nvml) == sysfs


@pytest.mark.parametrize("bad", ["", "GPU-1234", "00000000:18:00", "0000:18:00.8", "x:1:2.3"])
def test_normalize_bus_id_rejects(bad: str):
    with pytest.raises(ValueError):
        topo.normalize_bus_id(bad)


def test_online_cpus_real_sysfs():
    online = topo.online_cpus()
    text = _read(Path("/sys/devices/system/cpu/online"))
    assert online == topo.parse_cpulist(text)
    assert os.sched_getaffinity(0) <= online
    assert topo.format_cpulist(online) == text.strip()


def test_online_cpus_fallback_without_sysfs(tmp_path: Path):
    assert topo.online_cpus(sysfs=str(tmp_path)) == set(range(os.cpu_count() or 1))


def test_pci_readers_on_a_real_device():
    d = a_pci_device()
    bus = nvml_style(d.name)
    expect = topo.parse_cpulist(_read(d / "local_cpulist"))
    assert expect, "a device's local_cpulist is never empty"
    assert topo.pci_local_cpus(bus) == expect
    if (d / "local_cpus").exists():
        assert topo.parse_cpumask(_read(d / "local_cpus")) == expect
    numa = int(_read(d / "numa_node").strip()) if (d / "numa_node").exists() else -1
    assert topo.pci_numa_node(bus) == numa
    assert topo.gpu_local_cpus({3: bus}) == {3: topo.format_cpulist(expect)}


def test_missing_device_says_nothing():
    ghost = "0000FFFF:FF:1F.7"
    assert not os.path.exists(topo.pci_device_dir(ghost))
    assert topo.pci_local_cpus(ghost) is None
    assert topo.pci_numa_node(ghost) == -1
    assert topo.gpu_local_cpus({0: ghost}) == {}
    # NVML's affinity fills in where sysfs has nothing.
    assert topo.gpu_local_cpus({0: ghost}, nvml_affinity={0: {4, 5, 6}}) == {0: "4-6"}
    assert topo.gpu_local_cpus({0: "not-a-bus-id"}, nvml_affinity={0: {1}}) == {0: "1"}


def test_cores_and_numa_on_real_sysfs():
    cores = topo.cpu_cores()
    online = topo.online_cpus()
    base = Path("/sys/devices/system/cpu")
    for cpu in online:
        core_file = base / f"cpu{cpu}" / "topology" / "core_id"
        if core_file.exists():
            assert cores[cpu][1] == int(_read(core_file))
    node0 = Path("/sys/devices/system/node/node0/cpulist")
    if node0.exists():
        assert topo.numa_node_cpus(0) == topo.parse_cpulist(_read(node0))
    assert topo.numa_node_cpus(-1) is None


def test_build_topo_is_complete_and_stores_as_json():
    d = a_pci_device()
    t = topo.build_topo({0: nvml_style(d.name)}, gpu_of_pid={"123": ["0"]})
    assert t.gpu_local_cpus == {
        0: topo.format_cpulist(topo.parse_cpulist(_read(d / "local_cpulist")))
    }
    assert t.cpu_count == len(topo.online_cpus())
    assert t.online_cpus == topo.format_cpulist(topo.online_cpus())
    assert t.gpu_of_pid == {123: [0]}
    assert set(t.core_of_cpu or {}) <= topo.online_cpus()
    # it goes into a capture's metadata: JSON and back gives the same record
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_build_topo_without_gpus_reads_the_cpus():
    """No GPU on the CI machine is needed for the CPU half: every CPU field is read."""
    t = topo.build_topo()
    assert t.gpu_local_cpus == {} and t.gpu_numa_node == {} and t.gpu_of_pid is None
    assert t.cpu_count == len(topo.online_cpus()) > 0
    assert topo.parse_cpulist(t.online_cpus or "") == topo.online_cpus()
    assert list(t.to_dict()) == [
        "gpu_local_cpus", "gpu_numa_node", "cpu_count", "online_cpus", "core_of_cpu"
    ]  # fmt: skip


# A capture's `topology` as build_topo's dict was written by json.dumps (int keys -> strings).
STORED = {
    "gpu_local_cpus": {"0": "0-15", "1": "16-31"},
    "gpu_numa_node": {"0": 0, "1": -1},
    "cpu_count": 32,
    "online_cpus": "0-31",
    "core_of_cpu": {"0": [0, 0], "16": [1, 0]},
}


def test_a_stored_topology_reads_into_the_record_and_back():
    t = Topology.from_dict(STORED)
    assert t.gpu_local_cpus == {0: "0-15", 1: "16-31"} and t.gpu_numa_node == {0: 0, 1: -1}
    assert t.core_of_cpu == {0: (0, 0), 16: (1, 0)} and t.gpu_of_pid is None
    assert t.extra == {}
    assert t.to_dict() == STORED
    assert json.dumps(t.to_dict()) == json.dumps(STORED)  # same keys, same order


def test_a_sparse_topology_keeps_only_its_keys():
    """The recorder's fallback when sysfs cannot be read has two keys, and writes two."""
    t = Topology(gpu_local_cpus={}, cpu_count=8)
    assert t.to_dict() == {"gpu_local_cpus": {}, "cpu_count": 8}
    assert Topology.from_dict(t.to_dict()) == t
    assert Topology.from_dict(None) == Topology() and Topology().to_dict() == {}


def test_a_malformed_topology_is_kept_as_it_came_and_never_raises():
    odd = {
        "cpu_count": "many",
        "core_of_cpu": {"x": [0, 0]},
        "gpu_of_pid": [1, 2],
        "gpu_local_cpus": {"0": "0-3"},
        "later": {"a": 1},
    }
    t = Topology.from_dict(odd)
    assert t.gpu_local_cpus == {0: "0-3"}
    assert t.cpu_count is None and t.core_of_cpu is None and t.gpu_of_pid is None
    assert set(t.extra) == {"cpu_count", "core_of_cpu", "gpu_of_pid", "later"}
    assert t.to_dict() == odd  # lossless: what could not be read is written back as it was


def test_a_topology_record_passes_through_from_dict():
    t = Topology(cpu_count=4)
    assert Topology.from_dict(t) is t
