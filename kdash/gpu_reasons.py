"""NVML clock-event ("throttle") reason bits and their names.

NVML renamed `ClocksThrottleReasons` to `ClocksEventReasons`; the bit values did not change,
so kdash keeps its own table and decodes stored bits without needing NVML at replay time.
"""

from __future__ import annotations

# bit -> (short name shown in the band, plain words)
REASONS: dict[int, tuple[str, str]] = {
    0x1: ("idle", "GPU idle: nothing running, clocks lowered"),
    0x2: ("app-clocks", "applications clocks setting caps the clock"),
    0x4: ("sw-power", "software power cap: board power at its limit"),
    0x8: ("hw-slowdown", "hardware slowdown (thermal or power brake)"),
    0x10: ("sync-boost", "sync boost with other GPUs"),
    0x20: ("sw-thermal", "software thermal slowdown: GPU or memory too hot"),
    0x40: ("hw-thermal", "hardware thermal slowdown"),
    0x80: ("power-brake", "external power brake (hardware)"),
    0x100: ("display-clocks", "display clock setting"),
}

# Reasons that mean "the GPU wanted to run faster and was held back".
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def decode(bits: int) -> list[str]:
    """Short names of the set bits; [] for 0 and for n/a (-1)."""
    if bits is None or bits < 0:
        return []
    return [name for bit, (name, _) in REASONS.items() if bits & bit]


def describe(bits: int) -> list[str]:
    if bits is None or bits < 0:
        return []
    return [words for bit, (_, words) in REASONS.items() if bits & bit]
