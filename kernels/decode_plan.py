"""The host side of decode attention: :class:`DecodePlan` (plan once, run per layer and step)
and :func:`decode_attention`, the one-call form.

The kernels live in :mod:`kdash.kernels.decode_attention` (whose module docstring describes the
algorithm, the layout and the split model); this module decides everything a launch needs
(split count, grid, compile-time values, buffers, the stage-1 kernel's residency) once per batch
composition and keeps the per-call path to a few attribute reads and the launches.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable

import torch

from . import decode_choice, decode_gluon, decode_persist, decode_tagged, graph_launch, residency
from ._common import capability_of, cdiv, interpreting, next_pow2, sm_count
from .decode_attention import (
    DEFAULT_CONFIG,
    FP8_DTYPES,
    LOG2E,
    MAX_DEVICE_PLAN_BATCH,
    WAVES_MAX,
    DecodeConfig,
    _decode_stage2,
    _plan,
    default_config,
    merge_tokens,
    split_class,
)
from .decode_fp8 import CVT_MODES, runnable_config
from .kv_cache import scale_per_head
from .launch import BoundKernel, hooks_installed
from .residency import MAX_BLOCKS_PER_SM, Residency


def max_splits_for(
    kv_heads: int,
    max_seq_len: int,
    *,
    config: DecodeConfig = DEFAULT_CONFIG,
    sms: int | None = None,
    resident_per_sm: int | None = None,
) -> int:
    """The most splits the device-side cut gives any request of up to ``max_seq_len`` tokens.

    Whatever the other lengths are, a request's split length is at least ``min_tokens_per_split``
    and the wave model picks a count whose splits are that long (a count whose rounding leaves a
    split empty never wins: one fewer gives the same splits in no more waves), so no request needs
    more than ``ceil(max_seq_len / min_tokens_per_split)``. The wave model also stops at
    ``WAVES_MAX`` waves of ``resident_per_sm x sms`` programs (at least ``kv_heads`` a split), and
    a batch of unequal lengths gives a request at most ``ceil(target / kv_heads) + 1`` splits
    (its split length is at least its own ``len * kv_heads / target``). A plan for lengths
    unknown at plan time (a CUDA graph replayed as requests grow) sizes its grid by this;
    programs past a request's cut return at once.
    """
    sms = sms if sms is not None else sm_count()
    pps = resident_per_sm if resident_per_sm is not None else config.programs_per_sm
    by_len = cdiv(max(1, max_seq_len), config.min_tokens_per_split)
    by_work = cdiv(max(1, config.programs_per_sm_varlen * sms), max(1, kv_heads)) + 1
    by_waves = WAVES_MAX.value * max(1, pps * sms) // max(1, kv_heads)
    return max(1, min(by_len, max(by_work, by_waves), config.max_splits))


@functools.lru_cache(maxsize=512)
def _stage2_meta(splits: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_S, num_warps)`` of the merge: all splits in one chunk, and the [BLOCK_S, D] fp32
    tile of partials at <= 64 registers a thread."""
    return min(256, next_pow2(splits)), max(1, min(8, next_pow2(splits) * head_dim // 2048))


_NO_SCALE = object()
# Whether a plan launches one fused kernel (stage 1 and the merge) rather than two: True, False,
# "persistent" (decode_persist's kernel wherever it can run), or "auto", where each plan decides
# by :func:`fused_pays`; a plan's ``fused`` argument overrides it. On the H200 the fused kernel
# passes the same gates and costs ~6 us of host time a run against ~10; at a few long requests
# (one wave of stage 1, few merge programs) it is 1-2.6 us faster by do_bench and within 1.6 us
# either way replayed from a graph; but every stage-1 program waits for its stores before it
# raises its flags, once a wave, and its merge programs carry stage 1's warps and registers, so
# with many waves or many merge programs it is 9-40% slower (bench/NOTES-kernels.md, session 14).
FUSED_DEFAULT: bool | str = "auto"


def fused_pays(batch: int, q_heads: int, programs: int, capacity: int, sms: int) -> bool:
    """The auto rule: one launch when stage 1's ``programs`` fit one wave of ``capacity`` and
    its merge programs (one per request and query head) are at most half the SMs: where the
    merge overlaps stage 1 and the flags' fences are paid once."""
    return programs <= capacity and batch * q_heads <= sms // 2


def _aligned(*ts: torch.Tensor) -> bool:
    """Every pointer on 16 bytes, as the compiled kernels assume (a misaligned view re-JITs)."""
    bits = 0
    for t in ts:
        bits |= t.data_ptr()
    return not bits & 15


class DecodePlan:
    """Decode attention for one batch composition: planned once, then run per layer and step.

    As FlashInfer's decode wrappers split the work: everything that depends only on the batch
    (its size, the head layout, the page size, the longest length it may reach) is worked out
    here once: the split count and grid, the compile-time parameters, the output and scratch
    buffers. :meth:`run` then only launches the kernels on the caller's ``q`` and caches: no
    allocation, no host synchronisation, no per-argument inspection, so it costs a few
    microseconds of host time and can be captured in a CUDA graph. After the first run every
    argument but the pointers of q, the caches and the scales is packed once, and a run hands
    the pointers to Triton's C launcher (see :meth:`kdash.kernels.launch.BoundKernel.launcher`).

    ``fused`` (default :data:`FUSED_DEFAULT`, ``"auto"``: :func:`fused_pays` decides for the
    batch): one launch, the split merge done by merge programs of the same grid that fold each
    split's partial once it is written (:mod:`kdash.kernels.decode_fused`), instead of stage 1
    then a merge kernel; ``"persistent"``: one launch of resident programs that take stage-1
    work and then the merge off a counter (:mod:`kdash.kernels.decode_persist`). Same results
    up to the order of the merge's additions; :attr:`path` says which (``"two"``, ``"fused"``,
    ``"persistent"``).

    ``page_table`` (``[B, max_pages]`` int32) and ``seq_lens`` (``[B]`` int32) are kept by
    reference and read on the GPU at every run: a caller (or a CUDA graph replay) may rewrite them
    in place between runs, within the plan's limits: the same batch size, no length above
    ``max_seq_len``, no page past the table's width. Each request's cut into splits is computed on
    the GPU from the lengths in memory at that run (see the kernels' ``_device_split_len``), so
    a replay is balanced for its own lengths. With ``total_tokens`` the grid is sized for lengths
    like the ones given (the eager case); without it, for any lengths up to ``max_seq_len``
    (:func:`max_splits_for`; the replay case). ``num_splits`` overrides either.

    Waves need the residency of the stage-1 kernel that will run (programs per SM, from its
    registers and shared memory; :mod:`kdash.kernels.residency`), which only the compiled kernel
    knows. The plan finds it before it sizes anything: from a per-process cache keyed by what
    decides the compiled kernel (:meth:`variant_key`), else by compiling that kernel here with
    Triton's ``warmup`` (no launch; the first run then finds it in Triton's cache). Compiling at
    plan time rather than re-planning after a first run is deliberate: a re-plan could need a
    larger workspace (an allocation in :meth:`run`) and a kernel compiled, and its module
    loaded, while a CUDA graph may be capturing. The grid, the buffers and the kernel's
    ``capacity`` argument (the device-side search's wave size, not specialised on, so it never
    selects another compiled kernel) are therefore fixed before the first run. In the CPU
    interpreter, during a capture, or if compiling fails (``residency_source`` says why), the
    config's ``programs_per_sm`` stands in. ``capacity``, ``resident_per_sm`` and ``residency``
    report what was used.

    :meth:`run` writes into the plan's output buffer (``out`` at plan time, else one allocated
    here) and returns it: the next run overwrites it. fp8 KV takes ``k_scale``/``v_scale`` here
    (one float, or ``[Hkv]``) or per run (``[Hkv]`` fp32 tensors, e.g. per layer).

    ``graph`` (default :data:`~kdash.kernels.graph_launch.GRAPH_LAUNCH_DEFAULT`): runs start
    the plan's launches as a CUDA graph the plan captured itself, one per set of q, cache and
    scale pointers (one per layer when a plan serves a step's layers), with one driver call
    (:mod:`kdash.kernels.graph_launch`); ``graph_refused`` says why a plan's runs do not.

    ``config`` (default :func:`default_config` of ``kv_dtype``) is kept as the GPU can run it
    (:func:`runnable_config`): ``config`` on the plan says what runs. A
    :class:`~kdash.kernels.decode_gluon.TmaConfig` asks for the Gluon kernels that read the
    cache by TMA (``tma``; ``tma_refused`` says why a plan could not take them). A config's
    ``evict_first`` (``l2_evict_first`` of a TmaConfig) asks for an L2 evict-first hint on the
    K/V copies (:mod:`kdash.kernels.l2_hint`), given where the compiler can encode it;
    ``l2_refused`` says why a plan's copies could not take it.
    """

    l2_refused: str | None = None

    def __init__(
        self,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        max_seq_len: int,
        total_tokens: int | None = None,
        kv_dtype: torch.dtype = torch.bfloat16,
        q_dtype: torch.dtype = torch.bfloat16,
        sm_scale: float | None = None,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        num_splits: int | None = None,
        config: DecodeConfig | None = None,
        out: torch.Tensor | None = None,
        fused: bool | str | None = None,
        graph: bool | None = None,
    ) -> None:
        if seq_lens.dim() != 1 or page_table.dim() != 2:
            raise ValueError("seq_lens must be [B] and page_table [B, max_pages]")
        batch = seq_lens.shape[0]
        if page_table.shape[0] != batch:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for {batch} requests")
        if seq_lens.dtype != torch.int32 or page_table.dtype != torch.int32:
            raise ValueError("seq_lens and page_table must be int32")
        if page_table.stride(1) != 1 or not seq_lens.is_contiguous():
            raise ValueError("page_table rows and seq_lens must be contiguous")
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"query heads {num_q_heads} not a multiple of KV heads {num_kv_heads}")
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError("head_dim must be a power of two (64 and 128 are supported)")
        dev = seq_lens.device
        self.device = dev
        cap = capability_of(dev)
        config = config or decode_gluon.default_for(default_config(kv_dtype), cap, kv_dtype)
        self.config = config = runnable_config(config, cap)
        self.batch, self.q_heads, self.kv_heads = batch, num_q_heads, num_kv_heads
        self.head_dim, self.page_size = head_dim, page_size
        self.kv_dtype, self.q_dtype = kv_dtype, q_dtype
        self.is_fp8 = kv_dtype in FP8_DTYPES
        # The candidates of decode_fp8 read fp8 as int16 pairs too (the same layout and strides).
        self.pairs = self.is_fp8 and config.fp8_compute in ("pairs", "pairs_asm", *CVT_MODES)
        if self.pairs and head_dim % 32:
            raise ValueError("fp8 pairs path needs head_dim a multiple of 32")
        self.upcast = interpreting(seq_lens)
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.page_table, self.seq_lens = page_table, seq_lens
        self.max_seq_len = max(1, int(max_seq_len))
        sms = sm_count()
        group = num_q_heads // num_kv_heads
        meta: dict = dict(
            GROUP=group,
            BLOCK_H=max(16, next_pow2(group)),
            HEAD_DIM=head_dim,
            BLOCK_N=config.block_n,
            PAGE=page_size,
        )
        self._merge = merge_tokens(group, 1 if self.is_fp8 else 2)
        self._sms = sms
        self.tma, self.tma_refused = decode_gluon.plan_choice(
            config, kv_dtype, head_dim, page_size, group, None if self.upcast else cap
        )
        self.pairs = self.pairs and not self.tma  # TMA copies fp8 bytes as they are
        self.cvt = self.pairs and config.fp8_compute in CVT_MODES  # decode_fp8's kernel
        self.path = self._launch_path(fused, total_tokens, num_splits)
        self.fused, self.persistent = self.path != "two", self.path == "persistent"
        # the tagged merge (decode_tagged): two launches of the bf16 Triton stage 1
        self.tagged = decode_tagged.TAGGED_DEFAULT and self.path == "two"
        self.tagged = self.tagged and not (self.tma or self.is_fp8)
        self._kern1 = decode_choice.choose_kernel(self, meta)
        programs = max(1, batch * num_kv_heads)
        meta.update(
            PREFETCH=config.prefetch_pages,
            DEVICE_PLAN=batch <= MAX_DEVICE_PLAN_BATCH,
            TARGET_VARLEN=max(1, config.programs_per_sm_varlen * sms),
            MIN_SPLIT=config.min_tokens_per_split,
            BLOCK_B=min(MAX_DEVICE_PLAN_BATCH, max(16, next_pow2(batch))),
            MAX_SPLITS=config.max_splits,
            MERGE=self._merge,
            # Lanes of the device's split search: every count the wave model may pick for any
            # residency (at most MAX_BLOCKS_PER_SM an SM), so no residency needs a recompile.
            SEARCH=next_pow2(
                max(
                    1, min(config.max_splits, WAVES_MAX.value * MAX_BLOCKS_PER_SM * sms // programs)
                )
            ),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        decode_choice.finish_meta(self, meta)
        self._meta1 = meta
        if out is None:
            out = torch.empty(batch, num_q_heads, head_dim, device=dev, dtype=q_dtype)
        elif out.shape != (batch, num_q_heads, head_dim) or out.stride(2) != 1:
            raise ValueError("out must be [B, Hq, D] with a contiguous head dimension")
        self.out = out
        plan_args = (batch, num_kv_heads, self.max_seq_len, total_tokens, num_splits)
        splits, split_len = self._plan_waves(*plan_args)
        self.num_splits, self.split_len = splits, split_len
        # One workspace: partial O [B, Hq, splits, D], partial LSE, final LSE, each part on 16
        # bytes (the compiled kernels assume it of every pointer they are armed with).
        # tagged partials take two fp32 a value and start at tag 0 (decode_tagged)
        wide = 2 if self.tagged else 1
        n_l = batch * num_q_heads * splits * wide
        n_o = n_l * head_dim
        pad = -n_l % 4
        n_f = batch * num_q_heads
        make = torch.zeros if self.tagged else torch.empty
        ws = make(n_o + n_l + pad + n_f, device=dev, dtype=torch.float32)
        self.o_part, self.lse_part, _, lse = ws.split_with_sizes((n_o, n_l, pad, n_f))
        self.lse = lse.view(batch, num_q_heads)
        self._ks = self._vs = seq_lens  # never read without fp8; any pointer does
        # What the scale tensors were made from: a run passing the same object (or none) uses them
        # as they are. _NO_SCALE until a scale is given, so an fp8 run without one is refused.
        self._ks_src: object = _NO_SCALE
        self._vs_src: object = _NO_SCALE
        self._scales_aligned = True
        if self.is_fp8 and k_scale is not None and v_scale is not None:
            self._ks, self._ks_src = scale_per_head(k_scale, num_kv_heads, dev), k_scale
            self._vs, self._vs_src = scale_per_head(v_scale, num_kv_heads, dev), v_scale
            self._scales_aligned = _aligned(self._ks, self._vs)
        self._ksp = self._vsp = seq_lens.data_ptr()
        if self.is_fp8 and self._ks_src is not _NO_SCALE:
            self._ksp, self._vsp = self._ks.data_ptr(), self._vs.data_ptr()
        # The fused grid's last GROUP slices of the split axis are its merge programs; the
        # persistent grid is what the GPU holds at once.
        self._grid1 = (batch, num_kv_heads, splits + (group if self.fused else 0))
        if self.persistent:
            work = (self.capacity, batch, num_kv_heads, splits)
            self._grid1 = (decode_persist.programs(*work),)
        # The TMA kernel's descriptors live in global scratch: one buffer for every run.
        self._scratch = decode_gluon.scratch(self._grid1, dev) if self.tma else None
        self._q_stride: tuple | None = None
        self._q_shape: tuple | None = None
        self._cache_layout: tuple | None = None
        # id of a cache tensor seen before -> (weak reference, data pointer)
        self._known: dict[int, tuple[weakref.ref, int]] = {}
        self._s1: BoundKernel | None = None
        self._rest1: tuple = ()
        # The launches with every argument fixed but q, the caches and the scales, pointers as
        # ints (see kdash.kernels.launch); made once the kernels are armed, None until then.
        self._fire: Callable[..., None] | None = None
        # Those launches as one CUDA graph per key of pointers (kdash.kernels.graph_launch),
        # made with _fire when ``graph`` (default GRAPH_LAUNCH_DEFAULT) and the driver allow.
        self.graph = graph_launch.GRAPH_LAUNCH_DEFAULT if graph is None else bool(graph)
        self._slot: graph_launch.GraphSlot | None = None
        self._pt_ptr, self._sl_ptr = page_table.data_ptr(), seq_lens.data_ptr()
        self._outs: tuple = (out, lse, out.stride(0), out.stride(1))
        self._bind_merge(n_l, out, lse, splits)

    def _bind_merge(self, n_l: int, out: torch.Tensor, lse: torch.Tensor, splits: int) -> None:
        """The merge of the plan's path: the one-launch kernels' flags (or the persistent one's
        counters), or the second launch, plain or over tagged partials (decode_tagged)."""
        batch, num_q_heads, head_dim, dev = self.batch, self.q_heads, self.head_dim, self.device
        if self.fused:
            # The merge's flags, one per partial (request, query head, split), or the
            # persistent kernel's counters: zero between launches.
            n_flags = decode_persist.COUNTERS if self.persistent else max(1, n_l)
            self._flags = torch.zeros(n_flags, device=dev, dtype=torch.int32)
            self._s2 = None
            self._args2: tuple = ()
        elif self.tagged:
            # each (request, query head)'s last tag, raised by its merge program
            self._ep = torch.zeros(batch * num_q_heads, device=dev, dtype=torch.int32)
            meta2: dict = dict(
                HEAD_DIM=head_dim, CHUNK=decode_tagged.CHUNK, POLL_NS=decode_tagged.POLL_NS,
                MAX_POLLS=2 if self.upcast else decode_tagged.MAX_POLLS,
                GPU=not self.upcast, EMULATE_RTNE=self.upcast, num_warps=4,
            )  # fmt: skip
            if not self.upcast and decode_tagged.PDL:  # the interpreter has no PDL
                meta2["launch_pdl"] = True
            self._s2 = BoundKernel(decode_tagged._decode_merge_tagged, (batch, num_q_heads), meta2)
            bufs2 = (self.o_part, self.lse_part, out, lse, self._ep)
            self._args2 = (*bufs2, splits, *self._outs[2:])
        else:
            block_s, warps2 = _stage2_meta(splits, head_dim)
            self._s2 = BoundKernel(
                _decode_stage2,
                (batch, num_q_heads),
                dict(
                    HEAD_DIM=head_dim, BLOCK_S=block_s, EMULATE_RTNE=self.upcast, num_warps=warps2
                ),
            )
            self._args2 = (self.o_part, self.lse_part, out, lse, splits, *self._outs[2:])

    def _launch_path(
        self, fused: bool | str | None, total_tokens: int | None, num_splits: int | None
    ) -> str:
        """``"two"``, ``"fused"`` or ``"persistent"``: ``fused``, else :data:`FUSED_DEFAULT`,
        where ``"auto"`` asks :func:`fused_pays`, judged at the config's residency before any
        kernel is compiled (the chosen kernel's own residency is found after, as always), and
        where that says no, takes the persistent kernel if ``decode_persist.PERSISTENT_DEFAULT``
        and this plan can run it."""
        choice = FUSED_DEFAULT if fused is None else fused
        why = decode_persist.unsupported_reason(
            self.tma, self.is_fp8, self.cvt and self.config.fp8_compute == "cvt", self.batch
        )
        if choice == "persistent":
            if why and fused is not None:
                raise ValueError(f"fused='persistent': {why}")
            return "two" if why else "persistent"  # a module-wide default fits what it can
        if choice != "auto":
            return "fused" if choice else "two"
        per_sm, sms = max(1, self.config.programs_per_sm), self._sms
        per_sm = min(per_sm, self.config.max_resident_per_sm or per_sm)
        est = (self.batch, self.kv_heads, self.max_seq_len, total_tokens, num_splits, per_sm)
        programs = self.batch * self.kv_heads * self._splits(*est)[0]
        if fused_pays(self.batch, self.q_heads, programs, per_sm * sms, sms):
            return "fused"
        return "persistent" if decode_persist.PERSISTENT_DEFAULT and not why else "two"

    def _plan_waves(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        total_tokens: int | None,
        num_splits: int | None,
    ) -> tuple[int, int]:
        """The split plan at the stage-1 kernel's residency: the compiled kernel's (cached per
        variant, else compiled here), else the config's ``programs_per_sm``. A split count of
        another specialisation class is another kernel, so the figure is read again for the
        chosen count until it stops changing (there are 3 classes)."""
        cap = self.config.max_resident_per_sm or MAX_BLOCKS_PER_SM
        per_sm = min(MAX_BLOCKS_PER_SM, cap, max(1, self.config.programs_per_sm))
        self.residency_source = "config"
        self.residency: Residency | None = None
        plan_args = (batch, kv_heads, max_len, total_tokens, num_splits)
        splits, split_len = self._splits(*plan_args, per_sm)
        for _ in range(3):
            found = self._residency_of(splits, split_len)
            if found is None:
                break
            self.residency = found
            if min(found.per_sm, cap) == per_sm:
                break
            per_sm = min(found.per_sm, cap)
            splits, split_len = self._splits(*plan_args, per_sm)
        # The config's cap, where the kernel would fit more: its launches ask for the shared
        # memory that leaves room for no more (residency.shared_for_cap).
        self._shared = 0
        capped = self.residency is not None and self.residency.per_sm > per_sm
        if capped and self.device.type == "cuda":
            smem_sm = torch.cuda.get_device_properties(self.device).shared_memory_per_multiprocessor
            self._shared = residency.shared_for_cap(per_sm, self.residency.shared_bytes, smem_sm)
        self.resident_per_sm = per_sm
        self.capacity = per_sm * self._sms  # stage-1 programs resident at once, as planned
        return splits, split_len

    def _splits(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        total_tokens: int | None,
        num_splits: int | None,
        per_sm: int,
    ) -> tuple[int, int]:
        """``(grid splits, split-length hint)`` at ``per_sm`` resident programs an SM."""
        config, sms = self.config, self._sms
        capacity = per_sm * sms
        args = (batch, kv_heads, max_len, total_tokens or None, config, sms, capacity)
        _, split_len = _plan(*args, self._merge)
        if num_splits is not None:
            splits = max(1, int(num_splits))
        elif total_tokens is not None:
            splits = _plan(
                batch, kv_heads, max_len, total_tokens, config, sms, capacity, self._merge
            )[0]
        else:
            splits = max_splits_for(
                kv_heads, max_len, config=config, sms=sms, resident_per_sm=per_sm
            )
        return splits, split_len

    def variant_key(self, splits: int, split_len: int | None = None) -> tuple:
        """What decides the compiled stage-1 kernel of this plan at ``splits`` splits: the kernel,
        its compile-time values, the dtypes, the device and the specialisation of the integer
        arguments known at plan time (q and the caches are assumed contiguous, as the workload's
        are: a layout of other stride classes compiles another kernel, whose figure this plan
        does not see). The key of :mod:`kdash.kernels.residency`'s cache."""
        hint = split_len if split_len is not None else self.split_len
        return (
            self._kern1.__name__,
            tuple(sorted(self._meta1.items())),
            str(self.q_dtype),
            str(self.kv_dtype),
            str(self.device),
            split_class(splits),
            split_class(hint),
            split_class(self.page_table.stride(0)),
        )

    def _residency_of(self, splits: int, split_len: int) -> Residency | None:
        """The cached residency of the kernel for ``splits``, or that of the kernel compiled now.

        Plan time may compile (and wait): Triton's ``warmup`` compiles the very kernel the first
        run will launch (same arguments' specialisation: dtype placeholders stand for q and the
        caches, their pointers taken as 16-byte aligned as the fast path requires) and the first
        run then finds it in Triton's cache. None in the CPU interpreter (nothing is compiled:
        the config's figure stays) or when compiling here failed (the reason is kept in
        ``residency_source``; the first run compiles as before).
        """
        key = self.variant_key(splits, split_len)
        found = residency.lookup(key)
        if found is not None:
            self.residency_source = "cache"
            return found
        if self.upcast or self.device.type != "cuda":
            return None
        if torch.cuda.is_current_stream_capturing():
            return None  # no module is loaded inside a capture; the config's figure stays
        args = decode_choice.warmup_args(self, splits, split_len)
        grid = (self.batch, self.kv_heads, splits)
        try:
            with torch.cuda.device(self.device):
                compiled = self._kern1.warmup(*args, grid=grid, **self._meta1)
                found = residency.of_compiled(
                    compiled, self._meta1["num_warps"], self.device.index or 0
                )
        except Exception as e:  # noqa: BLE001 - any failure leaves the config's figure, said why
            self.residency_source = f"config ({type(e).__name__}: {str(e)[:160]})"
            return None
        residency.record(key, found)
        self.residency_source = "compiled"
        return found

    def _bind(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Check a new layout of q and the caches and derive the stage-1 arguments from it."""
        if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
            raise ValueError("q must be [B, Hq, D] and the caches [pages, page_size, Hkv, D]")
        if tuple(q.shape) != (self.batch, self.q_heads, self.head_dim):
            raise ValueError(
                f"q is {tuple(q.shape)}; the plan is for "
                f"{(self.batch, self.q_heads, self.head_dim)}"
            )
        want = (self.page_size, self.kv_heads, self.head_dim)
        if tuple(k_cache.shape[1:]) != want or v_cache.shape != k_cache.shape:
            raise ValueError(f"K/V caches must be [pages, {want[0]}, {want[1]}, {want[2]}]")
        if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
            raise ValueError("the head dimension must be contiguous")
        if q.dtype != self.q_dtype:
            raise ValueError(f"q is {q.dtype}; the plan is for {self.q_dtype}")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            raise ValueError(f"K/V caches must be {self.kv_dtype} (the plan's kv_dtype)")
        if self.tma:
            decode_gluon.check_caches(k_cache, v_cache, self.page_size, self.head_dim)
        ks, vs = k_cache.stride()[:3], v_cache.stride()[:3]
        if self.pairs:
            if any(x % 2 for x in (*ks, *vs)):
                raise ValueError("fp8 pairs path needs even cache strides")
            ks, vs = tuple(x // 2 for x in ks), tuple(x // 2 for x in vs)  # int16 units
        scalars = (
            self.sm_scale * LOG2E,
            self.num_splits,
            self.split_len,
            self.capacity,
            q.stride(0),
            q.stride(1),
            *ks,
            *vs,
            self.page_table.stride(0),
        )
        out, lse, so_b, so_h = self._outs
        if self.fused:
            bufs: tuple = (self.o_part, self.lse_part, out, lse, self._flags)
            self._rest1 = (*bufs, *scalars, so_b, so_h, *self._sizes())
        else:
            bufs = (self.o_part, self.lse_part)
            self._rest1 = (*bufs, *scalars)
        # The same arguments with the buffers as pointers, for the launchers of _arm_fire.
        self._rest1_ptrs = (*(t.data_ptr() for t in bufs), *self._rest1[len(bufs) :])
        meta = self._meta1
        if meta.get("KV_SAME") and ks != vs:  # V's own strides, then
            meta = {**meta, "KV_SAME": False}
        self._s1 = BoundKernel(
            self._kern1,
            self._grid1,
            meta,
            self._scratch,
            decode_gluon.SCRATCH_PER_PROGRAM,
            shared=self._shared,
        )
        self._fire = None
        if self._slot is not None:
            self._slot.close()  # its graph holds the old arguments
            self._slot = None
        self._q_stride, self._q_shape = q.stride(), q.shape
        self._cache_layout = (k_cache.stride(), v_cache.stride())
        self._known.clear()

    def _sizes(self) -> tuple[int, ...]:
        """The persistent kernel's trailing arguments (its grid does not carry them)."""
        return (self.batch, self.kv_heads) if self.persistent else ()

    def _arm_fire(self) -> None:
        """Make :attr:`_fire` once every kernel of the run is armed (their first launch went
        through Triton, which compiled them): ``fire(stream, q, k, v, k_scale, v_scale)`` with
        the five as pointers, everything else fixed here."""
        s1, s2 = self._s1, self._s2
        if s1 is None or not s1.fast or (s2 is not None and not s2.fast):
            return
        f1 = s1.launcher(self._rest1_ptrs)
        if f1 is None:
            return
        pt, sl = self._pt_ptr, self._sl_ptr
        if s2 is None:

            def fire(stream: int, qp: int, kp: int, vp: int, ksp: int, vsp: int) -> None:
                f1(stream, qp, kp, vp, pt, sl, ksp, vsp)

        else:
            a2 = self._args2
            f2 = s2.launcher(tuple(t.data_ptr() if torch.is_tensor(t) else t for t in a2))
            if f2 is None:
                return

            def fire(stream: int, qp: int, kp: int, vp: int, ksp: int, vsp: int) -> None:
                f1(stream, qp, kp, vp, pt, sl, ksp, vsp)
                f2(stream)

        self._stream = s1.stream_reader()
        self._fire = fire
        self._slot = graph_launch.slot_for(self.graph, fire, self.device)

    @property
    def graph_refused(self) -> str | None:
        """Why runs launch kernels rather than the plan's graph: None while they may take the
        graph (or before the first run armed the plan), else the reason."""
        return graph_launch.refusal(self.graph, self._fire is not None, self._slot)

    def _admit(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Check caches not seen before against the bound layout (rebinding if it differs) and
        remember them; False when one is misaligned (that call takes Triton's own path)."""
        if (k_cache.stride(), v_cache.stride()) != self._cache_layout or (
            k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype
        ):
            self._bind(q, k_cache, v_cache)
        elif tuple(k_cache.shape[1:]) != (self.page_size, self.kv_heads, self.head_dim):
            self._bind(q, k_cache, v_cache)  # raises: same strides, other shape
        if not _aligned(k_cache, v_cache):
            return False
        if len(self._known) > 256:
            self._known.clear()
        for c in (k_cache, v_cache):
            self._known[id(c)] = (weakref.ref(c), c.data_ptr())
        return True

    def _scale(self, which: str, scale) -> torch.Tensor:
        """The ``[Hkv]`` fp32 scale tensor for ``scale`` (None: the plan's), kept for reuse."""
        src = self._ks_src if which == "k" else self._vs_src
        if scale is None:
            if src is _NO_SCALE:
                raise ValueError("fp8 KV needs k_scale and v_scale (per KV head, or one float)")
            return self._ks if which == "k" else self._vs
        t = scale_per_head(scale, self.kv_heads, self.device)
        if which == "k":
            self._ks, self._ks_src, self._ksp = t, scale, t.data_ptr()
        else:
            self._vs, self._vs_src, self._vsp = t, scale, t.data_ptr()
        self._scales_aligned = _aligned(self._ks, self._vs)
        return t

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[B, Hq, D]`` attention output of ``q`` over the caches (the plan's output buffer).

        With ``return_lse``, also the natural-log LSE ``[B, Hq]`` fp32 (the plan's buffer too).
        """
        # Host cost is the point of a plan: a handful of attribute reads per call. q is new at
        # every call (layout and alignment checked each time); a cache tensor is checked once
        # and then known by identity (a cache whose storage is swapped with set_() is not).
        if q.stride() != self._q_stride or q.shape != self._q_shape or q.dtype != self.q_dtype:
            self._bind(q, k_cache, v_cache)
        known = self._known
        kr = known.get(id(k_cache))
        vr = known.get(id(v_cache))
        if kr is None or vr is None or kr[0]() is not k_cache or vr[0]() is not v_cache:
            fast = self._admit(q, k_cache, v_cache)
            kr = known.get(id(k_cache))
            vr = known.get(id(v_cache))
        else:
            fast = True
        if self.is_fp8:
            # None uses the plan's scales (refused in _scale if it has none)
            if k_scale is not self._ks_src and (k_scale is not None or self._ks_src is _NO_SCALE):
                self._scale("k", k_scale)
            if v_scale is not self._vs_src and (v_scale is not None or self._vs_src is _NO_SCALE):
                self._scale("v", v_scale)
            fast = fast and self._scales_aligned
        if not self.batch:
            return (self.out, self.lse) if return_lse else self.out
        qp = q.data_ptr()
        fire = self._fire
        if fire is not None and fast and not qp & 15 and not hooks_installed():
            stream = self._stream()
            key = (qp, kr[1], vr[1], self._ksp, self._vsp)
            slot = self._slot
            if slot is None or not slot.launch(stream, key):
                fire(stream, *key)
        else:
            self._launch_checked(q, k_cache, v_cache, fast and not qp & 15)
        return (self.out, self.lse) if return_lse else self.out

    def _launch_checked(self, q, k_cache, v_cache, aligned: bool) -> None:
        """The launches with tensor arguments: through the bound kernels (which arm on their
        first call; then the pointer launchers are made), or, for a misaligned pointer, through
        Triton's own path, which specialises for it."""
        s1, s2 = self._s1, self._s2
        assert s1 is not None
        args = (q, k_cache, v_cache, self.page_table, self.seq_lens, self._ks, self._vs)
        if aligned:
            s1(*args, *self._rest1)
            if s2 is not None:
                s2(*self._args2)
            if self._fire is None:
                self._arm_fire()
        else:
            s1.jit(*args, *self._rest1)
            if s2 is not None:
                s2(*self._args2)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    total_tokens: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    fused: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per request over its paged KV cache, in one call.

    A :class:`DecodePlan` made for this call and run once: for a step that runs many layers (or
    a CUDA graph), make the plan once and call :meth:`DecodePlan.run` instead. The grid needs the
    longest length (``max_seq_len``, else ``seq_lens.max()``, which synchronises with the GPU)
    and, for unequal requests, ``total_tokens`` (else ``batch * max_seq_len``). ``num_splits``
    overrides the split count; any lengths stay correct, only the balance changes. Returns
    ``[B, Hq, D]`` in q's dtype (``out`` if given), and the natural-log LSE ``[B, Hq]`` fp32 when
    ``return_lse``. ``fused``: one launch or two (see :class:`DecodePlan`).
    """
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError("q must be [B, Hq, D] and the caches [pages, page_size, Hkv, D]")
    if (k_cache.dtype in FP8_DTYPES) != (v_cache.dtype in FP8_DTYPES):
        raise ValueError("K and V caches must both be fp8 or both not")
    if k_cache.dtype in FP8_DTYPES and (k_scale is None or v_scale is None):
        raise ValueError("fp8 KV needs k_scale and v_scale (per KV head, or one float)")
    batch = q.shape[0]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if batch else 1
    plan = DecodePlan(
        page_table,
        seq_lens,
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        max_seq_len=max_seq_len,
        total_tokens=total_tokens if total_tokens is not None else batch * max(1, max_seq_len),
        kv_dtype=k_cache.dtype,
        q_dtype=q.dtype,
        sm_scale=sm_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        num_splits=num_splits,
        config=config,
        out=out,
        fused=fused,
    )
    return plan.run(q, k_cache, v_cache, return_lse=return_lse)
