"""Where the CPUs are relative to the GPUs: cpulists, PCI bus ids, NUMA nodes, SMT cores.

A launch thread that runs on a CPU far from its GPU (other socket, other NUMA node) pays for
every launch and every host-device copy with a cross-socket hop. The kernel says which CPUs
are local to a PCI device in `/sys/bus/pci/devices/<bdf>/local_cpulist`; this module reads
that and the few other sysfs files the findings need, and converts between the forms kdash
meets: cpulist strings (`"0-31,64-95"`, what sysfs and `taskset -c` use), sets of ints, and
NVML's CPU-affinity bitmask words.

Pure functions plus tiny readers; every reader takes a `sysfs` root so tests (and replays of
another machine's topology) can point it elsewhere. Readers return None / -1 / empty when a
file is missing or unreadable (containers often mask /sys) and never raise for that.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

# the cpulist form lives in the core: analyses use it too, and must not import a collector
from kdash.cpulist import format_cpulist, parse_cpulist
from kdash.topology import Topology

__all__ = ["format_cpulist", "parse_cpulist"]  # kept importable from here, where they were

SYSFS = "/sys"

_BDF_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<dev>[0-9a-fA-F]{1,2})\.(?P<fn>[0-7])$"
)


def parse_cpumask(text: str) -> set[int]:
    """A sysfs hex mask (`"ffffffff,00000000"`, most significant word first) -> set of CPUs."""
    text = text.strip().replace(",", "")
    if not text:
        return set()
    value = int(text, 16)
    return {i for i in range(value.bit_length()) if value >> i & 1}


def cpus_from_mask_words(words: Iterable[int], bits_per_word: int = 64) -> set[int]:
    """NVML's `nvmlDeviceGetCpuAffinity` array (least significant word first) -> set of CPUs."""
    cpus: set[int] = set()
    for w_index, word in enumerate(words):
        word = int(word)
        base = w_index * bits_per_word
        for b in range(bits_per_word):
            if word >> b & 1:
                cpus.add(base + b)
    return cpus


def normalize_bus_id(bus_id: str) -> str:
    """NVML's `"00000000:18:00.0"` (or `"18:00.0"`, any case) -> sysfs's `"0000:18:00.0"`.

    NVML prints an 8-digit upper-case domain, sysfs a (at least) 4-digit lower-case one.
    Raises ValueError for something that is not a PCI address.
    """
    m = _BDF_RE.match(bus_id.strip())
    if not m:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain = int(m.group("domain") or "0", 16)
    bus, dev = int(m.group("bus"), 16), int(m.group("dev"), 16)
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{m.group('fn')}"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def pci_device_dir(bus_id: str, sysfs: str = SYSFS) -> str:
    return os.path.join(sysfs, "bus", "pci", "devices", normalize_bus_id(bus_id))


def pci_local_cpus(bus_id: str, sysfs: str = SYSFS) -> set[int] | None:
    """CPUs local to a PCI device, or None when sysfs does not say (missing device, masked /sys).

    Prefers `local_cpulist`; falls back to the hex `local_cpus` mask of older kernels.
    """
    d = pci_device_dir(bus_id, sysfs)
    text = _read(os.path.join(d, "local_cpulist"))
    if text is not None:
        return parse_cpulist(text)
    text = _read(os.path.join(d, "local_cpus"))
    if text is not None:
        return parse_cpumask(text)
    return None


def pci_numa_node(bus_id: str, sysfs: str = SYSFS) -> int:
    """The NUMA node of a PCI device; -1 when unknown (single-node machines and VMs say -1)."""
    text = _read(os.path.join(pci_device_dir(bus_id, sysfs), "numa_node"))
    if text is None:
        return -1
    try:
        return int(text.strip())
    except ValueError:
        return -1


def online_cpus(sysfs: str = SYSFS) -> set[int]:
    """Online CPUs from sysfs; falls back to 0..os.cpu_count()-1 when /sys is masked."""
    text = _read(os.path.join(sysfs, "devices", "system", "cpu", "online"))
    if text is not None:
        try:
            cpus = parse_cpulist(text)
        except ValueError:
            cpus = set()
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def numa_node_cpus(node: int, sysfs: str = SYSFS) -> set[int] | None:
    """CPUs of one NUMA node, or None when the node is unknown."""
    if node < 0:
        return None
    text = _read(os.path.join(sysfs, "devices", "system", "node", f"node{node}", "cpulist"))
    return None if text is None else parse_cpulist(text)


def cpu_cores(cpus: Iterable[int] | None = None, sysfs: str = SYSFS) -> dict[int, tuple[int, int]]:
    """CPU -> (package id, core id), so SMT siblings (same physical core) can be told apart.

    CPUs whose topology files are missing are left out.
    """
    out: dict[int, tuple[int, int]] = {}
    for cpu in sorted(online_cpus(sysfs) if cpus is None else cpus):
        base = os.path.join(sysfs, "devices", "system", "cpu", f"cpu{cpu}", "topology")
        pkg = _read(os.path.join(base, "physical_package_id"))
        core = _read(os.path.join(base, "core_id"))
        if pkg is None or core is None:
            continue
        try:
            out[cpu] = (int(pkg.strip()), int(core.strip()))
        except ValueError:
            continue
    return out


def gpu_local_cpus(
    bus_ids: Mapping[int, str],
    nvml_affinity: Mapping[int, set[int]] | None = None,
    sysfs: str = SYSFS,
) -> dict[int, str]:
    """GPU index -> cpulist of its local CPUs, for the findings' `Topology.gpu_local_cpus`.

    sysfs first (it is what the kernel's scheduler and numactl agree on); NVML's CPU affinity
    (`nvml_affinity`, already turned into sets with `cpus_from_mask_words`) where sysfs has
    nothing, e.g. a container without the PCI tree. GPUs with neither are left out, so the
    off-local finding stays silent about them rather than guessing.
    """
    out: dict[int, str] = {}
    for gpu, bus_id in bus_ids.items():
        cpus: set[int] | None
        try:
            cpus = pci_local_cpus(bus_id, sysfs)
        except ValueError:
            cpus = None
        if not cpus and nvml_affinity and nvml_affinity.get(gpu):
            cpus = set(nvml_affinity[gpu])
        if cpus:
            out[gpu] = format_cpulist(cpus)
    return out


def build_topo(
    bus_ids: Mapping[int, str] | None = None,
    gpu_of_pid: Mapping[int, list[int]] | None = None,
    nvml_affinity: Mapping[int, set[int]] | None = None,
    sysfs: str = SYSFS,
) -> Topology:
    """The `Topology` that `kdash.analyses.findings.find_all` takes: every field read, with
    `gpu_of_pid` {pid: [gpu, ...]} when the caller knows it (e.g. from NVML's process list)."""
    bus_ids = dict(bus_ids or {})
    online = online_cpus(sysfs)
    numa: dict[int, int] = {}
    for gpu, bus_id in bus_ids.items():
        try:
            numa[gpu] = pci_numa_node(bus_id, sysfs)
        except ValueError:
            numa[gpu] = -1
    return Topology(
        gpu_local_cpus=gpu_local_cpus(bus_ids, nvml_affinity, sysfs),
        gpu_numa_node=numa,
        cpu_count=len(online),
        online_cpus=format_cpulist(online),
        core_of_cpu=cpu_cores(online, sysfs),
        gpu_of_pid={int(p): [int(g) for g in gs] for p, gs in gpu_of_pid.items()}
        if gpu_of_pid
        else None,
    )
