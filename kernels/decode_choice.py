"""Which stage-1 kernel a :class:`~kdash.kernels.decode_plan.DecodePlan` launches, its
compile-time values, and the arguments that compile it before the first run.

Functions of the plan rather than its methods so that the plan module keeps to its per-call
path and its buffers; each reads the plan's settled attributes (``tma``, ``fused``,
``persistent``, ``pairs``, ``cvt``, ``upcast``, ``config``) and changes nothing but ``meta``
and, where the config asks for the L2 hint, the plan's ``l2_refused``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import decode_fp8, decode_fused, decode_gluon, decode_persist, l2_hint
from ._common import capability_of
from .decode_attention import LOG2E, _decode_stage1, _decode_stage1_fp8_pairs
from .decode_fp8 import CVT_MODES, _decode_stage1_fp8_cvt
from .decode_fused import _decode_fused, merge_chunk

if TYPE_CHECKING:
    from .decode_plan import DecodePlan


def choose_kernel(plan: DecodePlan, meta: dict):
    """The stage-1 kernel (or the one-launch one) for ``plan``, its KV-dtype constexprs added to
    ``meta``."""
    config = plan.config
    if plan.tma:
        fp8 = plan.is_fp8
        meta.update(STAGES=config.stages, KV_LAYOUT=decode_gluon.kv_layout(fp8), IS_FP8=fp8)
        if config.warps != 1:
            meta["W"] = config.warps
        hint, plan.l2_refused = decode_gluon.l2_meta(config)
        meta.update(hint)
        if plan.fused:
            return decode_gluon._decode_fused_gluon
        return decode_gluon._decode_stage1_gluon
    asm = plan.pairs and config.fp8_compute in ("pairs_asm", *CVT_MODES) and not plan.upcast
    fp16 = config.fp8_compute != "bf16"
    meta.update(EVICT=_evict(plan), UPCAST=plan.upcast)
    if plan.persistent:
        meta.update(IS_FP8=plan.is_fp8, ASM=asm)
        return decode_persist._decode_persistent
    kmma = plan.cvt and config.fp8_compute == "kmma"
    if plan.fused:
        meta.update(PAIRS=plan.pairs, IS_FP8=plan.is_fp8, FP8_FP16=fp16, ASM=asm)
        if plan.cvt:  # KV_SAME: as the plan's residency compile assumes (_bind checks)
            meta.update(CVT=True, KMMA=kmma, KV_SAME=decode_fp8.KV_SAME_DEFAULT)
        return _decode_fused
    if plan.cvt:
        meta.update(ASM=asm, KMMA=kmma, KV_SAME=decode_fp8.KV_SAME_DEFAULT)
        return _decode_stage1_fp8_cvt
    if plan.pairs:
        meta["ASM"] = asm
        return _decode_stage1_fp8_pairs
    meta.update(IS_FP8=plan.is_fp8, FP8_FP16=fp16)
    if plan.tagged:
        meta["TAGGED"] = True
    return _decode_stage1


def _evict(plan: DecodePlan) -> str:
    """The K/V loads' ``eviction_policy``: ``"evict_first"`` where the config asks for it and
    the copies will carry it (:func:`kdash.kernels.l2_hint.cp_async_refusal`), else none, with
    the reason in the plan's ``l2_refused``. Triton drops the policy from the pipelined copies,
    so the ask is only worth compiling where the hook puts it back."""
    if not plan.config.evict_first:
        return ""
    cap = capability_of(plan.device)
    if cap is not None and cap[0] != 9:
        # the probe and the SASS reader are sm_90's: elsewhere nothing says the copies are right
        plan.l2_refused = f"the hint is checked for sm_90 only, not sm_{cap[0]}{cap[1]}"
        return ""
    plan.l2_refused = l2_hint.cp_async_refusal()
    return "" if plan.l2_refused else "evict_first"


def finish_meta(plan: DecodePlan, meta: dict) -> None:
    """The launch options that depend on the kernel chosen: the TMA kernel runs the config's
    warps (one unless asked) and its ring's depth is the config's (no software pipeline, no
    prefetch switch); the one-launch kernels' merge shape; decode_fp8.Fp8Config's register cap
    (the persistent fp8 kernel's own by default) is a compile option, so not for the
    interpreter."""
    if plan.tma:
        del meta["PREFETCH"], meta["num_stages"]
        meta["num_warps"] = plan.config.warps
    if plan.persistent:
        meta.update(decode_persist.merge_meta(meta["GROUP"], meta["HEAD_DIM"]))
    elif plan.fused:
        meta["CHUNK"] = merge_chunk(meta["HEAD_DIM"])
        fenced = decode_fused.FENCED_MERGE
        if plan.tma:
            meta["FENCED"] = fenced
        else:
            meta.update(PUBLISH_FENCE=fenced, ACQUIRE_POLL=not fenced)
            if not plan.pairs:  # the bf16 stage 1 (fp8 pairs keep their own mask)
                meta["OPAQUE_HEADS"] = decode_fused.OPAQUE_HEADS
            tiles = decode_fused.WARM_TILES_FP8 if plan.pairs else decode_fused.WARM_TILES
            if tiles:
                row = plan.head_dim * plan.kv_dtype.itemsize  # bytes of one token's head
                meta.update(WARM=tiles, WARM_LINES=max(1, row // 128))
    maxnreg = getattr(plan.config, "maxnreg", None)
    if plan.persistent and plan.is_fp8:
        maxnreg = maxnreg or decode_persist.FP8_MAXNREG
    if maxnreg and not plan.upcast:
        meta["maxnreg"] = int(maxnreg)


def warmup_args(plan: DecodePlan, splits: int, split_len: int) -> tuple:
    """Stage 1's arguments for Triton's ``warmup`` at ``splits``: dtype placeholders for q, the
    caches and the partials (their pointers taken as 16-byte aligned, as the fast path
    requires), and the integers a run passes for contiguous q and caches, so that the kernel
    compiled here is the one the first run finds in Triton's cache."""
    d = plan.head_dim
    ks = (plan.page_size * plan.kv_heads * d, plan.kv_heads * d, d)
    if plan.pairs:
        ks = tuple(x // 2 for x in ks)
    scale_t = torch.float32 if plan.is_fp8 else torch.int32
    outs: tuple = ()
    if plan.fused:
        outs = (plan.q_dtype, torch.float32, torch.int32)
    return (
        plan.q_dtype,
        plan.kv_dtype,
        plan.kv_dtype,
        plan.page_table,
        plan.seq_lens,
        scale_t,
        scale_t,
        torch.float32,
        torch.float32,
        *outs,
        plan.sm_scale * LOG2E,
        splits,
        split_len,
        plan._sms,
        plan.q_heads * d,
        d,
        *ks,
        *ks,
        plan.page_table.stride(0),
        *((plan.out.stride(0), plan.out.stride(1)) if plan.fused else ()),
        *plan._sizes(),
    )
