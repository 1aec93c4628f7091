"""How many programs of a compiled Triton kernel one SM holds at once, and a cache of the answers.

A split-KV plan that counts in waves needs the real figure: the decode kernel's registers decide
it (120 registers a thread leave room for 4 programs of 4 warps on an H200 SM, 152 for 3), and
only the compiled kernel knows them. The arithmetic is the CUDA occupancy rule for the three
limits that bind here: registers (allocated per warp, 256 at a time), shared memory (plus the
1 KB the driver keeps per block) and threads, capped at 32 blocks an SM.

The cache is keyed by whatever the caller says decides the compiled kernel (for the decode
kernels: the kernel, its compile-time values, the dtypes and the specialisation of the integer
arguments); it is filled once per variant in a process and read by every later plan.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

MAX_BLOCKS_PER_SM = 32
REG_ALLOC_UNIT = 256  # registers per warp are allocated in units of this many
SHARED_RESERVED_PER_BLOCK = 1024


@dataclass(frozen=True)
class Residency:
    """Programs per SM of one compiled kernel, and the figures that decided it."""

    per_sm: int
    registers: int
    spills: int
    shared_bytes: int
    limits: tuple[tuple[str, int], ...] = ()


def programs_per_sm(
    registers: int,
    shared_bytes: int,
    num_warps: int,
    *,
    regs_per_sm: int = 65536,
    shared_per_sm: int = 233472,
    threads_per_sm: int = 2048,
) -> tuple[int, dict[str, int]]:
    """Resident programs per SM (at least 1) and the count each limit alone would allow."""
    warps = max(1, num_warps)
    per_warp = -(-max(0, registers) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by = {
        "registers": regs_per_sm // max(1, warps * per_warp),
        "shared_memory": shared_per_sm // max(1, shared_bytes + SHARED_RESERVED_PER_BLOCK),
        "threads": threads_per_sm // (32 * warps),
    }
    return max(1, min(MAX_BLOCKS_PER_SM, *by.values())), by


def shared_for_cap(cap: int, shared_bytes: int, shared_per_sm: int = 233472) -> int:
    """The shared memory a program asks for so that an SM holds at most ``cap`` of them: its
    own ``shared_bytes``, or more, up to the least amount that leaves no room for ``cap + 1``
    (the SM's ``shared_per_sm``, less the driver's reserve per block). The way to hold fewer
    programs than the registers allow; at the decode defaults it did not pay on an H100 or an
    H200 (bench/NOTES-kernels.md, session 22)."""
    need = shared_per_sm // (max(1, cap) + 1) - SHARED_RESERVED_PER_BLOCK + 1
    return max(shared_bytes, need)


def of_compiled(
    compiled: Any, num_warps: int, device_index: int = 0, shared: int | None = None
) -> Residency:
    """The residency of a Triton ``CompiledKernel`` on CUDA device ``device_index``, its
    launches asking for ``shared`` bytes of shared memory (None: the kernel's own figure).

    Loads the kernel's module if it is not loaded yet (the register count is only known then):
    call it at plan time, never inside a CUDA-graph capture.
    """
    import torch

    compiled.run  # noqa: B018 - loading the module fills n_regs and n_spills
    regs = int(compiled.n_regs)
    shared = int(compiled.metadata.shared) if shared is None else shared
    p = torch.cuda.get_device_properties(device_index)
    per_sm, by = programs_per_sm(
        regs,
        shared,
        num_warps,
        regs_per_sm=getattr(p, "regs_per_multiprocessor", 65536),
        shared_per_sm=getattr(p, "shared_memory_per_multiprocessor", 233472),
        threads_per_sm=getattr(p, "max_threads_per_multi_processor", 2048),
    )
    return Residency(per_sm, regs, int(getattr(compiled, "n_spills", 0)), shared, tuple(by.items()))


_CACHE: dict[Hashable, Residency] = {}
_CACHE_LIMIT = 1024


def lookup(key: Hashable) -> Residency | None:
    """The residency recorded for ``key``, or None."""
    return _CACHE.get(key)


def record(key: Hashable, residency: Residency) -> None:
    """Remember ``residency`` for ``key`` (bounded: a full cache starts over)."""
    if len(_CACHE) >= _CACHE_LIMIT and key not in _CACHE:
        _CACHE.clear()
    _CACHE[key] = residency


def forget(key: Hashable | None = None) -> None:
    """Drop one entry, or every entry with ``None``."""
    if key is None:
        _CACHE.clear()
    else:
        _CACHE.pop(key, None)
