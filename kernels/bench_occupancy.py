"""The stage-1 kernel's registers, shared memory and residency as the decode bench reports them
(:mod:`kdash.kernels.bench` and the scripts in bench/ read them from here)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from . import residency

if TYPE_CHECKING:
    from .decode_plan import DecodePlan


def stage1_occupancy(plan: DecodePlan) -> dict[str, Any]:
    """Registers, spills and shared memory of the plan's compiled stage-1 kernel, the programs
    that fit one SM by each limit, and the grid in waves of resident programs."""
    ck = plan._s1._compiled if plan._s1 is not None else None
    if ck is None:
        return {}
    smem = int(ck.metadata.shared)
    # a capped plan's launches ask for more (the config's max_resident_per_sm)
    asked = smem if plan._s1.shared_refused else max(smem, plan._s1.shared)
    res = residency.of_compiled(ck, plan.config.num_warps, 0, asked)
    regs, resident, by = res.registers, res.per_sm, dict(res.limits)
    programs = math.prod(plan._grid1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {
        "registers": regs,
        "spills": res.spills,
        "shared_bytes": smem,
        "shared_asked": asked,
        "shared_refused": plan._s1.shared_refused,
        "resident_per_sm_by": by,
        "resident_per_sm": resident,
        "programs": programs,
        "waves": programs / (resident * sms),
    }


def occupancy_or_error(plan: DecodePlan) -> dict[str, Any]:
    """:func:`stage1_occupancy`, or why it could not be read (the timings matter more)."""
    try:
        return stage1_occupancy(plan)
    except Exception as e:  # noqa: BLE001 - reported in the JSON; the row's timings stay
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def occ(side: dict) -> str:
    o = side.get("stage1") or {}
    if "registers" not in o:
        return "?"
    return f"{o['registers']}/{o['waves']:.2f}"
