"""The decode configs the bench's flags ask for (``--decode-tma``, ``--evict-first``,
``--no-evict-first``, ``--max-resident``, ``--max-registers``), what is wrong with a
combination of them, and the one-launch kernel's switches (``--fenced-merge``,
``--opaque-heads``, ``--no-opaque-heads``, ``--warm-tiles``, ``--warm-tiles-fp8``) and the
two-launch kernel's (``--tagged-two``, ``--no-tagged-two``): kept apart from
:mod:`kdash.kernels.bench`, whose ``main`` only reads them."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

from . import decode_fused, decode_tagged
from .decode_attention import DecodeConfig
from .decode_fp8 import Fp8Config
from .decode_gluon import TmaConfig


def flag_error(args: argparse.Namespace) -> str | None:
    """One line saying what is wrong with the decode flags, or None."""
    if args.max_resident is not None and args.max_resident < 0:
        return "--max-resident must be 0 or more"
    for flag in ("warm_tiles", "warm_tiles_fp8"):
        if (getattr(args, flag) or 0) < 0:
            return f"--{flag.replace('_', '-')} must be 0 or more"
    if args.max_registers is not None and not 24 <= args.max_registers <= 255:
        return "--max-registers must be from 24 to 255"
    if args.max_registers is not None and args.decode_tma:
        return "--max-registers is for the Triton kernels, not --decode-tma"
    return None


def apply_flags(args: argparse.Namespace, best: dict[str, DecodeConfig]) -> dict[str, DecodeConfig]:
    """``best`` (per KV dtype) with the flags' changes."""
    if args.decode_tma:
        best = {k: TmaConfig(**asdict(v)) for k, v in best.items()}
    if args.evict_first or args.no_evict_first:
        hint = "l2_evict_first" if args.decode_tma else "evict_first"
        best = {k: replace(v, **{hint: args.evict_first}) for k, v in best.items()}
    if args.max_resident is not None:
        best = {k: replace(v, max_resident_per_sm=args.max_resident) for k, v in best.items()}
    if args.max_registers is not None:  # bf16 only: fp8's kernel needs its 168 (3 an SM)
        capped = Fp8Config(**{**asdict(best["bf16"]), "maxnreg": args.max_registers})
        best = {**best, "bf16": capped}
    return best


def add_switches(ap: argparse.ArgumentParser) -> None:
    """The decode kernels' module switches as flags."""
    ap.add_argument(
        "--fenced-merge",
        action="store_true",
        help="one-launch plans publish and poll with fences (decode_fused.FENCED_MERGE)",
    )
    _on_off(
        ap,
        "opaque-heads",
        "one-launch bf16 plans build stage 1's head mask from an opaque value "
        "(decode_fused.OPAQUE_HEADS on: fewer registers with the L2 hint)",
    )
    ap.add_argument(
        "--warm-tiles",
        type=int,
        metavar="N",
        help="one-launch bf16 plans ask L2 for each split's first N tiles before stage 1 "
        "(decode_fused.WARM_TILES; 0: off)",
    )
    ap.add_argument(
        "--warm-tiles-fp8",
        type=int,
        metavar="N",
        help="the same for one-launch fp8 pair plans (decode_fused.WARM_TILES_FP8; 0: off)",
    )
    _on_off(
        ap,
        "tagged-two",
        "two-launch bf16 plans merge tagged partials in a merge launched while stage 1 runs "
        "(decode_tagged.TAGGED_DEFAULT on)",
    )


def _on_off(ap: argparse.ArgumentParser, name: str, help_on: str) -> None:
    """``--NAME`` and ``--no-NAME``, one or the other (neither: the switch keeps its default)."""
    pair = ap.add_mutually_exclusive_group()
    pair.add_argument(f"--{name}", action="store_true", help=help_on)
    pair.add_argument(f"--no-{name}", action="store_true", help=f"the same, off (--{name})")


def switches() -> dict[str, object]:
    """The module switches a bench run's plans were made under, for its JSON."""
    return {
        "FENCED_MERGE": decode_fused.FENCED_MERGE,
        "OPAQUE_HEADS": decode_fused.OPAQUE_HEADS,
        "WARM_TILES": decode_fused.WARM_TILES,
        "WARM_TILES_FP8": decode_fused.WARM_TILES_FP8,
        "TAGGED_DEFAULT": decode_tagged.TAGGED_DEFAULT,
    }


def apply_switches(args: argparse.Namespace) -> None:
    """Set the switches for the plans made after this (a pair left out keeps its default)."""
    decode_fused.FENCED_MERGE = args.fenced_merge
    if args.opaque_heads or args.no_opaque_heads:
        decode_fused.OPAQUE_HEADS = args.opaque_heads
    if args.warm_tiles is not None:  # checked by flag_error
        decode_fused.WARM_TILES = args.warm_tiles
    if args.warm_tiles_fp8 is not None:
        decode_fused.WARM_TILES_FP8 = args.warm_tiles_fp8
    if args.tagged_two or args.no_tagged_two:
        decode_tagged.TAGGED_DEFAULT = args.tagged_two
