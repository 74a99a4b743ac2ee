"""Tuning tables: one frozen dataclass per kernel family, rows keyed by device capability (and shape class where the
best tiling depends on the shape), read only through :func:`lookup`.

Every row was measured on an H200 (sm_90, Triton 3.6; ``bench/NOTES.md``); other capabilities take the
``"default"`` row (the same values) until they are measured. Fields whose A/B has not yet run on a GPU keep their
current default and are listed under "pending GPU A/B" in ``bench/NOTES.md``.

Overrides, applied on top of the row in this order: the environment (``GDN_TUNE``, parsed by :mod:`gdn.config`),
then :func:`override` blocks (innermost last). Unknown fields and values of the wrong type raise ValueError naming
where they came from.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple

from .. import config


@dataclass(frozen=True)
class ChunkForward:
    """Chunked forward (:mod:`gdn.kernels.chunk`): prepare, state pass, merge, output."""
    # prepare kernel (cumsum + K K^T + solve + W/U)
    prepare_BK: int = 64
    prepare_BV: int = 64
    prepare_warps: int = 4
    # pipeline depth of the recompute of W / U from a stored Ainv (the solving launches always run unpipelined)
    prepare_stages: int = 2
    # 128: four programs per SM instead of three (H200: prepare -4 to -9%)
    prepare_maxnreg: int = 128
    # sm_90: the forward's prepare (Ainv, g_cum, r_k; P and qf) as the Gluon kernel of
    # gdn.kernels.chunk.hopper_prepare where it supports the launch (bench/NOTES.md); its register cap with W, or
    # with P where every value head has its own key head, or with the tf32 solve (0: none; 168: 3 CTAs per SM
    # instead of 2, no spills); without P the tf32 solve builds at ~138 and runs uncapped
    prepare_sm90: bool = True
    prepare_sm90_maxnreg: int = 168
    # the fp16 solve's cap with P where value heads share key heads (HV > H): 128, four CTAs per SM (40 B of spills
    # on Triton 3.6), since the overflow redo left the kernel (prepare.redo_overflowed). H100 prepare + redo against
    # the in-kernel redo at 168 (bench/results/prepare_redo_out_ab_h100.json): 1x8192 16/32 88.0 -> 85.1 us,
    # 1x32768 334 -> 313, 4x4096 168 -> 160, 2/8 155 -> 140; at 64/64 (HV = H: k and q read once per value head,
    # a memory-heavy prepare) 689 -> 707, so that one keeps 168 (689 -> 694); H200 1x8192 16/32 77 -> 68 us against
    # 168 (bench/results/prepare_latency_probes_ab_h200.json)
    prepare_sm90_maxnreg_gva: int = 128
    # its cap without P (and without W): 128, four CTAs per SM, 0-40 B of spills; H100 -6 to -9% against 168
    # (bench/results/prepare_nop_cap128_ab_h100.json), H200 -13% (168: 1x32768 16/32 232 -> 202 us; 96: 220, spills
    # and serialized wgmma; bench/results/prepare_latency_probes_ab_h200.json)
    prepare_sm90_maxnreg_nop: int = 128
    # the varlen sm_90 prepare reading its chunk's (bos, eos) from the chunk table (plan.ChunkIndex.chunk_spans) beside
    # its chunk_indices row instead of from cu_seqlens after it: one dependent L2 round trip fewer before its TMA copies
    # are issued (the prepare is latency-bound, ~3-4 CTAs per SM). H200 `gdn profile --forward --varlen`, off / on
    # alternating twice (bench/results/fwd_pending_fields_ab_h200_thirtyfifth.json): forward kernels 4x4096 16/32
    # 275.6 / 278.0 -> 270.2 / 272.2 us (prepare 105.2 / 106.7 -> 103.7 / 104.5), 16x1024 294.0 / 296.8 -> 291.9 /
    # 291.7; single sequences equal (1x8192 242.3 / 243.8 -> 243.3 / 242.0, 1x32768 909.0 / 910.8 -> 909.3 / 909.9)
    prepare_sm90_chunk_spans: bool = True
    # the sm_90 prepare's solve products in fp16 (tf32's 10-bit mantissa, half the operand bytes, row-major right
    # operands) instead of tf32; a chunk whose fp16 products overflow is flagged and redone with the portable tf32
    # solve by a second launch (prepare.redo_overflowed). H100: prepare -4 to -8%
    # (bench/results/prepare_f16_solve_ab_h100.json)
    solve_sm90_f16: bool = True
    # ... that launch's programs: one per redo_block items (one vector load of their 64 row flags each where none
    # is set)
    redo_block: int = 128
    # ... where the flags are in o's rows (state_sm90_row_scalars_in_o): a chunk's in runs far apart in DRAM, so
    # more programs, fewer items each (H200 redo at 16/64 1x8192: 8.0 us at 128 items, 4.7 at 16)
    redo_block_row_scalars: int = 16
    # precision of the 64x64 products of the triangular solve ("auto": tf32 for a half-precision Ainv from half
    # inputs, else tf32x3; or "ieee", "tf32x3", "tf32", "bf16")
    solve_precision: str = "auto"
    # precision of dots whose operands are fp32 (fp32 inputs / fp32 intermediates)
    fp32_dot_precision: str = "tf32x3"
    # sequential state pass: V tile of the state (0 = automatic: 64 for K <= 128, else 32); state_stages: 3 on sm_90
    # (its builds issue chunk c+1's copies after chunk c's last product at 2 stages; 3 give a one-chunk lead: H100, the
    # segmented forward's local pass at 1x65536 2/8 307 -> 255 us, forward 0.797 -> 0.743 ms; the "sm_90" row below)
    state_BV: int = 0
    state_warps: int = 4
    state_stages: int = 2
    state_maxnreg: int = 0
    # sm_90: the sequential state pass as the Gluon kernel of gdn.kernels.chunk.hopper (TMA ring of state_sm90_stages
    # chunks, asynchronous wgmma) where it supports the launch. state_sm90_BV: 0 = the narrowest V tile (32, then 64)
    # whose grid fits one wave of CTAs (one per SM: a chunk step takes 1.1-1.4 us alone on an SM and slows down when
    # SMs are shared; H200); larger grids run the portable pass, which keeps several CTAs per SM busy (the fused
    # state + output kernel below takes them at V tile 64: it replaces two portable kernels). One of its
    # steps costs ~state_sm90_step_cost portable steps (segment planning). bench/results/sm90_state_h200.json;
    # the A/B: the sm90-* entries of bench/sweeps.json (git history)
    state_sm90: bool = True
    state_sm90_BV: int = 0
    state_sm90_stages: int = 2
    state_sm90_step_cost: float = 0.6
    # sm_90: where the Gluon state pass takes the final pass of an ainv-mode forward that needs no h / v_new, compute
    # the output in the same kernel (a second warpgroup; hopper._chunk_fused_sm90_kernel) instead of the output kernel
    state_sm90_fused: bool = True
    # ... with its TMA ring filled by a one-warp load partition (hopper._tma_loader) instead of the chain partition,
    # at V tiles up to this (0: never). H100 A/B (bench/results/fwd_t_loader_ab_h100.json): fused kernel at V tile 32
    # 1x8192 16/32 181-183 -> 171-172 us, 1x32768 691-698 -> 670-678; at V tile 64 (64/64) 1212-1216 -> 1274-1295
    state_sm90_load_warp_bv: int = 32
    # ... also when the caller keeps h / v_new (training with bwd_save_states, return_chunk_states): the chain stores
    # them as the state pass would (h in the tensor-core dtype; an fp32 h keeps the state pass + output kernel)
    state_sm90_fused_states: bool = True
    # ... where even V tile 64 needs more than one wave and the caller keeps no h / v_new: the register-state kernel
    # at V tile 128 (hopper._chunk_fused_t_sm90_kernel: two warpgroups, each 64 rows of S^T in registers, every
    # chained operand a register A operand; state._fused_output_plan)
    state_sm90_fused_t: bool = True
    # ... with Ainv and P written by the prepare into the two halves of o's own rows (head pitch 128; V = 128, o in
    # the tensor-core dtype, an inference call): the kernel has a chunk's tiles in shared memory before it stores the
    # chunk's o over them, so the call's peak holds no Ainv / P beside o (forward.py)
    state_sm90_fused_t_packed: bool = True
    # ... with beta folded into that Ainv by the prepare (Ainv diag(beta), its columns scaled; also by the overflow
    # redo), so that the register-state kernel's chain and the one-CTA segment pass's two chains take no beta factor
    # (r^T = v^T - (k S)^T diag(e^g r_k)): one row scaling of three per chain and chunk. H200 forward, off / on
    # alternating twice (bench/results/fwd_beta_in_ainv_ab_h200.json): 1x32768 16/32 875 / 877 -> 861 / 859 us,
    # 1x65536 2/8 454 / 456 -> 447 / 446; unsegmented rows equal (4x4096 16/32 270 / 269 -> 268 / 269)
    state_sm90_beta_in_ainv: bool = True
    # the V tile 32 / 64 fused kernel forming P itself (state_sm90_p_in_kernel_bv) in an inference call: the per-token
    # fp32 scalars (g_cum, r_k, the fp16 solve's overflow flags) written by the prepare into o's own rows, a copy per
    # V tile (hopper.row_scalar_pack), read by each tile's CTA before it stores those o rows: the call holds o and
    # Ainv alone (H200 1x8192 16/64: -3 MiB, forward kernels 432 -> 426 us; bench/NOTES.md)
    state_sm90_row_scalars_in_o: bool = True
    # ... with P formed in the kernel by a fourth partition (hopper._t_p_steps: Q K^T from the stage's q / k tiles,
    # the scalings as one exponent from gate rows the load warp forms) instead of read from the prepare kernel,
    # which then writes no P (it loads q for r_q alone). H100 forward kernels, off / on alternating twice
    # (bench/results/fwd_t_p_partition_ab_h100.json): 4x4096 16/32 372 / 373 -> 349 / 351 us, 16x1024 397 / 394 ->
    # 368 / 369, 4x4096 16/64 724 / 721 -> 709 / 705. Also as the final pass of segmented plans since the thirtieth
    # session: on the H200 the prepare's P costs more than the P partition's issue slots (forward kernels, read /
    # formed alternating twice: 1x65536 2/8 548 / 546 -> 517 / 519 us, 4/8 549 / 549 -> 527 / 526, 1x32768 4/8
    # 299 / 298 -> 287 / 287, 2/8 299 / 299 -> 284 / 284; bench/results/fwd_merge_plan_h200_thirtieth.json), where
    # the H100 had lost 1.5% at 2/8 (591 / 588 -> 600 / 599, twenty-third session: the final pass issue-bound there)
    state_sm90_t_p_in_kernel: bool = True
    # ... also as the final pass of segmented plans (few heads over long sequences), with segments re-planned so that
    # its grid fits one wave (state._one_wave_len): no h / v_new in memory there either. H100 A/B in
    # bench/NOTES.md (kernel sums 1x8192 4/8 351 -> 206 us, 8/16 396 -> 341, 1x65536 2/8 1255 -> 1191)
    state_sm90_fused_segmented: bool = True
    # ... choosing by a cost model (state._fused_segments) between the plain fused pass over whole sequences (when its
    # grid fits one wave) and the segmented run at V tile 32 or 64 (L chunks per segment, S segments per sequence:
    # L (segment pass step + fused step) + S merge steps, in steps of the plain pass at V tile 32); segmented only
    # below segment_gain x plain. H200 per chunk step (gdn profile): plain fused pass 1.37 us; segment pass 2.05 us
    # alone on an SM, 2.45 at two per SM; fused pass at V tile 64 2.05-2.14; one merge step 3.6 us (12 before the
    # merge tiles below); segment_fixed_cost: the segmented run's two launches more (host time, ~80 us on the H200
    # machines' CPUs) in the same units (bench/NOTES.md, Kept table 2026-11-26). The segment pass's costs since it
    # is the Gluon pass (H100, 2026-11-27: a step 1.46 us alone on an SM, 2.15 at two per SM, against the plain fused
    # pass's 1.30; no plan of the modelled rows changes). Fixed cost 60 -> 20 since host-plan replays launch through
    # Triton 3.6's C launcher (host_plan._FastLaunch: the forward's host time 0.21-0.23 -> 0.17 ms on an H100 host):
    # 1x8192 4/8 segmented, 200 -> 124 us of kernels (bench/results/host_direct_launch_h100.json)
    state_sm90_segment_pass_cost: float = 1.12
    state_sm90_segment_pass_cost2: float = 1.65
    state_sm90_wide_step_cost: float = 1.5
    # ... and the register-state kernel's (V tile 128) as the final pass of one-wave segments (HV x S <= SMs; the
    # ``wide`` candidate of state._fused_segments, where the caller keeps no h / v_new). H100 device time per forward,
    # that plan forced against the model's choice at the time (bench/results/fwd_segments_register_state_h100.json):
    # 1x65536 2/8 667 -> 606 us, 4/8 659 -> 616, 8/16 1277 -> 1189; 1x32768 2/8 350 -> 331, 4/8 351 -> 339, 8/16
    # 642 -> 617; slower at 1x16384 4/8 (192 -> 198), 8/16 (328 -> 333) and 1x8192 4/8 (112 -> 122-126). 2.3-2.5 is
    # the range that picks exactly the faster ones
    state_sm90_t_step_cost: float = 2.5
    # merge: one step 3.6 us (H100) before the tf32 pipelined merge (merge_* below), 1.8 us since (no plan of the
    # modelled rows changes)
    state_sm90_merge_cost: float = 1.4
    state_sm90_segment_fixed_cost: float = 20.0
    # sm_90: the segment pass of segmented runs (local states from zero and the transition matrices, one launch) as
    # the Gluon state pass (hopper._state_steps, INIT 3) at V tile state_sm90_segment_BV, instead of the portable one.
    # H100 forward kernel sums (bench/results/fwd_segment_pass_sm90_ab_h100.json): 1x65536 2/8 712 -> 695 us
    # (segment pass 263 -> 250), 1x32768 4/8 384 -> 371, 1x16384 4/8 214 -> 208; V tile 32 loses (373 us at 2/8)
    state_sm90_segment_pass: bool = True
    state_sm90_segment_BV: int = 64
    # ... and where K = V = 128 in ainv mode, that segment pass as one CTA per (value head, segment) holding the local
    # state and the transition transposed in two warpgroups' registers (hopper_segments; FlashInfer's "MN precompute"
    # layout) instead of (V + K) / state_sm90_segment_BV programs; its chunk step in the cost model's units, one CTA
    # per SM (state._segmented_cost). H200 forward kernel sums (bench/results/fwd_segment_pass_t_ab_h200.json):
    # 1x65536 2/8 530 -> 459 us (segment pass 252 -> 181), 1x8192 4/8 106 -> 99, 8/16 164 -> 142 (now segmented),
    # 1x32768 2/8 289 -> 252, 1x65536 4/8 526 -> 466, 1x16384 4/8 187 -> 151; the cost at 1.3 plans the same, at 2.2
    # leaves 1x8192 8/16 unsegmented (164)
    state_sm90_segment_t: bool = True
    state_sm90_segment_t_cost: float = 1.7
    # ... which makes segments pay for one long sequence over many heads too (16/32 from 1x32768 on), where the
    # planner keeps it whole (plan.choose_segment_len prices the older segment pass): there the register-state
    # candidate is offered (state._fused_segments) and taken below this x the plain pass, whose cost includes the
    # prepare's writing P at V tile 32 (state_sm90_prepare_p_cost per chunk and value head; the register-state pass
    # forms P itself). H200 kernel sums, segments / plain (bench/results/fwd_segment_plan_16_32_h200.json): 1x32768
    # 16/32 881 / 915 us (prepare 202 / 260), 1x65536 1718 / 1795; 1x16384 467 / 470 (a tie); 1x8192 256 / 242.
    # Above 1 because the modelled segmented step (segment_t_cost + t_step_cost = 4.2 plain steps) is ~5% over the
    # H200's (2.67 + 2.38 us per chunk, fitted over L = 8 .. 256, against the plain pass's 1.27: 4.0): 1.01 - 1.05
    # picks exactly the faster of those four; 1.06 - 1.14 also the tie at 1x16384, whose segmented call holds no P
    # and no Ainv buffer (Ainv in o's rows): its peak ~130-160 MB by the 1x32768 / 1x65536 segmented peaks (290 / 554
    # MB) against 263.5 plain and FlashInfer's 258 (not yet in a bench record)
    state_sm90_segment_t_gain: float = 1.06
    state_sm90_prepare_p_cost: float = 0.0028
    # sm_90 inference forward, unsegmented, whose grid fits one wave at V tile 64 but not 32 (33 - 66 sequences x
    # value heads): the register-state kernel (V tile 128, half the CTAs, P formed in it) where value heads per key
    # head >= this (0 = never). H200 kernel sums, V tile 64 / 128 alternating twice
    # (bench/results/fwd_t_gva_one_wave_h200.json): 16/64 1x2048 118 -> 110 us, 1x4096 226 -> 209, 1x8192 434 -> 400,
    # 1x16384 (two pieces) 844 -> 838; 32/64 1x8192 432 -> 421; 64/64 1x32768 1679 -> 1755 (no shared key heads: the
    # prepare's q read for q's row scalings, 396 -> 454), hence the GVA condition. gdn bench's device time at 16/64
    # 1x8192 is a tie (0.4229 -> 0.4216 ms, PDL; 0.4302 -> 0.4246 without), its peak 196 -> 136 MB (no P buffer:
    # FlashInfer's 196; bench/results/fwd_t_gva_bench_ab_h200.json)
    state_sm90_t_gva_min: int = 2
    # sm_90: the fused state + output kernel (V tile 32 / 64) with P and qf formed by its output partition (Q K^T,
    # Q Q^T for r_q, Gamma from g_cum and r_k) instead of read from the prepare kernel, which then reads no q and
    # writes no P: unsegmented plans at V tile >= this
    # (0: never; the register-state kernel at 128: state_sm90_t_p_in_kernel). H100 kernel sums, P read / formed
    # (bench/results/fwd_p_in_kernel_ab_h100.json): 1x32768 64/64 (V tile 64) 1909 -> 1755 us (prepare 691 -> 458,
    # fused 1213 -> 1293); at V tile 32 the output partition's extra products outrun the chain: 1x8192 16/32 252 ->
    # 310, 1x32768 16/32 972 -> 1197; the 2/8 segmented final pass at 64: 665 -> 690
    state_sm90_p_in_kernel_bv: int = 64
    # sm_90 inference forward (no h / v_new kept), unsegmented, not forced, K = 128: the fused kernel at this narrower
    # V tile where its grid still fits one wave (few heads: 16 value heads -> 128 CTAs at 16 columns, 64 at 32), a chunk
    # step ~1.0 us instead of 1.33 at 32 (0 = off). H100 forward kernels, V tile 32 / 16 alternating twice
    # (bench/results/fwd_fused_bv16_ab_h100.json): 1x8192 8/16 212-215 -> 170-174 us, 1x16384 8/16 415-420 -> 328-332,
    # 1x32768 8/16 805-814 -> 640-643; the segmented 4/8 and 2/8 runs beat it (124 vs 135 us, 663-671 vs 992-1002)
    # and keep their plans
    state_sm90_narrow_bv: int = 16
    # an inference forward (no pool, no checkpoints, one sequence or a batch of equal ones) of n >= 2 x
    # piece_token_heads token x value heads runs in min(piece_max, n / piece_token_heads) pieces one after the other
    # (forward._forward_in_pieces): one piece's intermediates (Ainv, P: as many bytes as o) in memory at a time. H100,
    # gdn bench with FlashInfer (bench/NOTES.md): 1x32768 16/32 peak 524 -> 393 MB (FlashInfer 514) for +1.6% time;
    # each piece adds ~25 us of GPU time (kernel ramps) and a launch pair of host time, hence the size floor and the
    # cap; 0 = never. Not where the register-state kernel keeps Ainv in o's rows (no intermediates to halve; H200,
    # pieces / whole: 1x16384 16/64 826 -> 777 us, 267 -> 266 MiB; bench/results/fwd_pieces_ainv_in_o_h200.json);
    # 64/64 1x32768 (V tile 64, Ainv in a buffer) keeps them: 1653 / 1669 us, 648 / 772 MiB
    piece_token_heads: int = 1 << 19
    piece_max: int = 2
    # output kernel; output_heads: value heads per program sharing q, k, q k^T (0 = all HV / H). H200 A/B
    # (gdn profile --forward, 5 target shapes): heads 0 + BV 128 cut the output kernel 22-41% (1x8192 16/32 176 ->
    # 123 us) by reading q / k once per q/k head instead of once per (value head, V tile); output_BV is halved for
    # operands whose [K, BV] h tile would pass 64 KB (fp32 with K = 256)
    output_BK: int = 128
    output_BV: int = 128
    output_warps: int = 4
    output_stages: int = 1
    output_maxnreg: int = 0
    output_heads: int = 0
    # programmatic dependent launch of the sm_90 forward's kernels (prepare, overflow redo, segment pass, merge,
    # fused pass; gdn.kernels.launch.pdl_args): each waits for the one before it as its first statement (its CTAs are
    # launched while that one drains). Lost (bench/NOTES.md): each also letting the next one start right after its
    # wait ("2" in the numbers that follow), for all kernels or for the small redo / merge only. H100
    # device time per forward, off / on / "2" (bench/results/fwd_pdl_ab_h100.json): 1x8192 4/8 120.0 / 111.4 / 114.2
    # us, 8/16 178.0 / 172.5 / 172.9, 16/32 259.1 / 253.7 / 254.7, 4x4096 16/32 375.1 / 369.7 / 369.1, 1x65536 2/8
    # 678 / 665 / 683; on for sm_90 (other GPUs untested: off)
    pdl: bool = False
    # merge kernel of the segmented state pass: one program per (16-column V tile, value head, sequence) steps through
    # the segments; H200, 1x65536 2/8 with 8 segments (gdn profile --forward, GDN_TUNE sweep): BV 64 / BK 64 / 4 warps
    # 96.6 us, BV 32 50.7, BV 16 39.8, BV 32 / BK 128 / 8 warps 36.5, BV 16 / BK 128 / 8 warps 28.7
    # 2026-11-27 (seventeenth session), H100, 8 segments, merge alone: 28.4 us (tf32x3, the state re-read through
    # L2 every step) -> 30.0 (state in registers, next tiles prefetched into registers) -> 16.2 (the same in tf32)
    # -> 14.4 (tf32, loop pipelined 2 deep: the transition lands in shared memory); BV 32 / 64 slower (18 / 24).
    # tf32 for 16-bit inputs: the segmented state's error against float64 is the bf16 path's (2.3e-3 either way);
    # fp32 inputs keep tf32x3 (results/fwd_merge_tf32_h100.json). sm_90 row: 3 stages (two transitions in flight,
    # 216 KB of shared memory; 4 do not fit): H200 merge at 1x65536 2/8 (16 segments) 29.7 / 29.2 -> 24.8 / 24.7 us,
    # 1x8192 4/8 14.6 / 14.6 -> 13.6 / 13.7 (gdn profile --forward, 2 / 3 alternating;
    # bench/results/fwd_merge_plan_h200_thirtieth.json)
    merge_BK: int = 128
    merge_BV: int = 16
    merge_warps: int = 8
    merge_stages: int = 2
    merge_precision: str = "tf32x3"
    merge_precision_16bit: str = "tf32"
    # storage dtype of the per-chunk states h: "input" (bf16 for bf16 inputs) or "fp32"
    h_dtype: str = "input"
    # v_new from Ainv / v / beta ("ainv": no w/u round trip) or from stored w/u ("wu")
    state_mode: str = "ainv"
    # h in the v_new product as two half-precision parts (accuracy; one more tensor-core product per chunk)
    state_split_h: bool = False
    # storage dtype of Ainv ("input" = tensor-core dtype, or "fp32")
    ainv_dtype: str = "input"
    # training: keep the forward's h and v_new for the backward instead of recomputing them there (on sm_90 the fused
    # forward kernel stores them: state_sm90_fused_states). The op's peak is unchanged (the backward allocated both
    # anyway; H200 1x32768 16/32 3218 MB, fla 3862) but they are saved activations from the forward to the backward:
    # +0.8 GB per layer at 1x32768 16/32 (h [NT, HV, K, V] and v_new [B, T, HV, V], bf16); false recomputes them.
    # H200 fwd + bwd 5.73 -> 5.09 ms, 64/64 10.01 -> 9.18 (bench/NOTES.md, Kept table 2026-11-26)
    bwd_save_states: bool = True
    # segmented state pass: 0 = heuristic (gdn.kernels.chunk.plan.choose_segment_len), -1 = never, n > 0 = always
    segment_chunks: int = 0
    # the heuristic's model: resident state-pass CTAs per SM, one merge step in chunk steps, segment only when the
    # modelled cost is below segment_gain x the plain pass; segments are powers of two >= segment_min_len chunks;
    # never for sequences of fewer than segment_min_chunks chunks
    state_ctas_per_sm: int = 2
    segment_merge_cost: float = 0.5
    segment_gain: float = 0.8
    segment_min_chunks: int = 16
    segment_min_len: int = 8
    # testing: fill every buffer the launchers allocate with NaN first (catches unwritten elements)
    debug_poison: bool = False


@dataclass(frozen=True)
class ChunkBackward:
    """Chunked backward (:mod:`gdn.kernels.chunk.backward`)."""
    # reverse state-gradient pass: V tile (0 = min(64, V)), warps, pipeline stages (3 stages pending GPU A/B)
    dh_BV: int = 0
    dh_warps: int = 4
    dh_stages: int = 1
    # V tile of the parallel kernels (dv_local, parts A and B)
    BV: int = 64
    # parts A and B: 4 warps (Triton puts every warp along M for chained dots; 8 would duplicate)
    a_warps: int = 4
    a_stages: int = 2
    b_warps: int = 4
    b_stages: int = 2
    # segmented reverse pass: 0 heuristic, -1 never, n > 0 chunks per segment
    segment_chunks: int = 0
    # tl.dot input precision for fp32 operands, and of the segment merge
    fp32_dot: str = "ieee"
    merge_dot: str = "tf32x3"
    # ... the merge's products for 16-bit inputs, and how deep its loop over segments is pipelined (the next
    # transition and local gradient copied into shared memory while a step computes), as the forward merge's. H100,
    # 1x65536 2/8 fwd + bwd: merge 23.0 -> 14.7 us (bench/results/bwd_merge_tf32_h100.json)
    merge_dot_16bit: str = "tf32"
    merge_stages: int = 2
    # V columns per program of that merge (8 warps, the whole K x K transition per step); 64 before the forward merge's
    # sweep showed narrower tiles with more programs per step faster (bench/NOTES.md, Kept table 2026-11-26)
    merge_BV: int = 16
    # recompute the forward states on a side CUDA stream, concurrently with the reverse pass
    concurrent: bool = True
    # sm_90: the reverse pass as the Gluon kernel of gdn.kernels.chunk.backward.hopper (TMA ring of dh_sm90_stages
    # chunks, asynchronous wgmma) where it supports the launch and its grid fits one wave at V tile 32 or 64; where
    # the heuristic would segment, a cost model (reverse._reverse_segments) picks the plain sm_90 pass or one-wave
    # sm_90 segments, in steps of the plain pass at V tile 32 (H200: a step at V tile 64 1.52 us against 1.43; a merge
    # step ~2.8 us; fixed: three launches more; bench/NOTES.md, "Hopper reverse pass" and Kept table 2026-11-26); the
    # side stream (concurrent) is not used with the plain sm_90 pass
    dh_sm90: bool = True
    dh_sm90_stages: int = 2
    dh_sm90_wide_step_cost: float = 1.06
    dh_sm90_merge_cost: float = 2.0
    dh_sm90_segment_fixed_cost: float = 85.0
    dh_sm90_segment_gain: float = 0.9
    # the unsegmented sm_90 pass computes dv_local itself (no dv_local kernel) where sequences x value heads >= this:
    # it adds ~0.2-0.6 us to each chunk step of the chain and saves a kernel whose time grows with the heads (H100:
    # a gain from 32 (16/32 1x32768 -2%, 64/64 -7%), a loss at 8 and 16; bench/NOTES.md, "Hopper reverse pass")
    dh_sm90_local_min_heads: int = 24
    # the unsegmented sm_90 pass at V tile 128 (two warpgroups, K = 128, dv_local in the pass) where tiles 32 / 64 do
    # not fit one wave, in up to this many waves (0: never). Before: the portable pass + the dv_local kernel. H100,
    # reverse pass us, portable -> V tile 128: 4x4096 16/32 (1 wave) 640 -> 334, 4x4096 16/64 1234 -> 628, 8x2048
    # 644 -> 331, 16x1024 653 -> 338, 32x512 671 -> 350, 64x256 (16 waves) 703 -> 373 (bench/NOTES.md, Kept table)
    dh_sm90_bv128_waves: int = 16
    # ... and there W formed in the pass from Ainv (Ainv diag(beta e^c r_k) k, off the chain) instead of read from the
    # W the backward recomputes in its own kernel first (portable, ~70% of copy bandwidth). H100 fwd + bwd kernel
    # sums 4x4096 16/32 2.32 -> 2.18 ms, 16/64 4.36 -> 4.15, 16x1024 2.32 -> 2.20 (bench/NOTES.md, Kept table)
    dh_sm90_w_from_ainv: bool = True
    # elsewhere the training forward's sm_90 prepare stores W (one more wgmma per chunk and value head, from the Ainv
    # it has just stored) and the backward reads it instead of recomputing it (backward.wants_forward_w)
    w_from_forward: bool = True
    # sm_90: parts A and B of the per-chunk gradients as one Gluon kernel (gdn.kernels.chunk.backward.hopper_parts:
    # every tile of a (chunk, value head) by TMA once, asynchronous wgmma) where it supports the launch
    parts_sm90: bool = True


@dataclass(frozen=True)
class Decode:
    """One-token decode kernel: V tile, warps, pipeline stages of the tile loop, V tiles per program, register cap
    (0 = none), store cache modifier ("" = default)."""
    BV: int
    warps: int
    stages: int
    tiles: int
    maxnreg: int = 0
    store_cache: str = ""


@dataclass(frozen=True)
class Recurrent:
    """Multi-token recurrent kernel: V tile, warps, pipeline stages of the token loop."""
    BV: int
    warps: int
    stages: int


@dataclass(frozen=True)
class DecodeStep:
    """Fused layer decode step (:mod:`gdn.kernels.decode_step`): V tile of the state walk, warps, pipeline stages of
    the tile loop; ``fused`` False runs the layer's step as separate kernels (conv update, decode, gated norm)."""
    BV: int
    warps: int
    stages: int
    fused: bool = True


# ----------------------------------------------------------------------------------------------------------------------
# the tables: {capability: row} or {(capability, shape class): row}
# ----------------------------------------------------------------------------------------------------------------------
TABLES: Dict[str, dict] = {
    "chunk_fwd": {"default": ChunkForward(), "sm_90": ChunkForward(state_stages=3, pdl=True, merge_stages=3)},
    "chunk_bwd": {"default": ChunkBackward()},
    # H200 sweeps at K = V = 128 (bench/NOTES.md, decode): shape classes by N * HV and state bytes
    "decode": {
        ("default", "few_heads"): Decode(8, 1, 1, 1),          # N * HV < 2048: many one-warp programs
        ("default", "fp32_state"): Decode(8, 2, 1, 1),         # fp32 state: 8 columns, straight-line
        ("default", "half_state"): Decode(32, 2, 3, 4),        # 16-bit state, N * HV < 8192: tiles 3-deep pipelined
        ("default", "half_state_many"): Decode(16, 2, 4, 4),   # 16-bit state, more heads: two programs per head
        # v_last ([K, V] rows: a BV-column tile reads K row pieces of BV elements, so narrow tiles read short pieces;
        # H200 sweep of BV x warps x stages x tiles, bench/results/decode_tiles_vlast_h200.json): fp32 N=256 422 ->
        # 271 us (60.6 -> 94.2% of copy), N=2048 3382 -> 2131 (96.0%); bf16 N=128 102 -> 89.5 us (71.8%), N=512 438 ->
        # 333 (77.2%). A candidate row is timed with GDN_TUNE=decode.BV=..,decode.warps=.. gdn profile --layer-decode
        ("default", "few_heads_vlast"): Decode(8, 1, 1, 1),    # not swept
        ("default", "fp32_state_vlast"): Decode(64, 4, 1, 1),
        ("default", "half_state_vlast"): Decode(64, 2, 3, 4),
        ("default", "half_state_many_vlast"): Decode(64, 2, 3, 4),
    },
    # one program per (sequence, value head), its state walked in BV-column tiles; shape class by the state's bytes
    # per element and layout. H200 sweeps of BV x warps x stages, layer step at N = 256 (CUDA graph, bench/NOTES.md):
    # fp32 v_last 338 -> 328 us, k_last 336 -> 336; 16-bit states with one warp per program and a deeper tile
    # pipeline (2026-11-26 sweep, results/layer_decode_tiles_h200.json): k_last 197.3 -> 193.0 us, v_last fused
    # 226-228 us against 236.7 for the separate kernels
    "decode_step": {
        ("default", "fp32_vlast"): DecodeStep(64, 4, 1),
        ("default", "fp32_klast"): DecodeStep(32, 4, 1),
        ("default", "half_vlast"): DecodeStep(32, 1, 3),
        ("default", "half_klast"): DecodeStep(16, 1, 4),
    },
    "recurrent": {
        ("default", "few_heads"): Recurrent(8, 1, 1),          # N * HV < 2048: one-warp 8-column programs
        ("default", "many_heads"): Recurrent(16, 2, 2),        # 16-column tiles, token loop pipelined 2 deep
    },
}
_ROW_TYPES = {"chunk_fwd": ChunkForward, "chunk_bwd": ChunkBackward, "decode": Decode, "recurrent": Recurrent,
              "decode_step": DecodeStep}

_OVERRIDES: List[Tuple[str, dict]] = []
_GENERATION = [0]   # bumped whenever the override stack changes (cache key)
_CACHE: dict = {}
_FAST: dict = {}   # (family, device, shape_class) -> (GDN_TUNE string, generation, row)
_CAPS: dict = {}


def capability(device) -> str:
    """"sm_XY" of a CUDA device, "cpu" otherwise."""
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return "cpu"
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPS:
        major, minor = torch.cuda.get_device_capability(idx)
        _CAPS[idx] = f"sm_{major}{minor}"
    return _CAPS[idx]


def _convert(family: str, key: str, value, default, source: str):
    where = f"{source}: {family}.{key}={value!r}"
    if isinstance(value, str) and not isinstance(default, str):
        v = value.strip().lower()
        try:
            if isinstance(default, bool):
                if v not in ("1", "0", "true", "false"):
                    raise ValueError
                return v in ("1", "true")
            if isinstance(default, int):
                return int(v)
            if isinstance(default, float):
                return float(v)
        except ValueError:
            raise ValueError(f"{where}: expected {type(default).__name__}") from None
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ValueError(f"{where}: expected bool")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (isinstance(default, int) and not float(value).is_integer()):
            raise ValueError(f"{where}: expected {type(default).__name__}")
        return type(default)(value)
    if isinstance(default, str) and not isinstance(value, str):
        raise ValueError(f"{where}: expected str")
    return value


def _apply(family: str, row, items: dict, source: str):
    fields = {f.name for f in dataclasses.fields(row)}
    changes = {}
    for key, value in items.items():
        if key not in fields:
            raise ValueError(f"{source}: unknown key {family}.{key}; known: {', '.join(sorted(fields))}")
        changes[key] = _convert(family, key, value, getattr(row, key), source)
    row = dataclasses.replace(row, **changes) if changes else row
    _check(family, row, source)
    return row


def _check(family: str, row, source: str):
    if family in ("decode", "recurrent", "decode_step"):
        bv, warps, stages = row.BV, row.warps, row.stages
        tiles = getattr(row, "tiles", 1)
        if bv < 1 or bv & (bv - 1) or warps < 1 or warps & (warps - 1) or stages < 1 or tiles < 1:
            raise ValueError(f"{source}: {family}: BV and warps must be powers of two, stages and tiles at least 1 "
                             f"(got BV={bv}, warps={warps}, stages={stages}, tiles={tiles})")
    elif family == "chunk_fwd" and row.output_heads < 0:
        raise ValueError(f"{source}: chunk_fwd.output_heads must be >= 0 (0 = all), got {row.output_heads}")


def lookup(family: str, device=None, shape_class: str = ""):
    """The effective row of ``family`` for ``device`` (and ``shape_class``): the table's row for the device's
    capability (else its "default" row), then GDN_TUNE, then the active :func:`override` blocks. Host cost ~1 us
    when nothing changed since the last lookup of the same arguments (one read of GDN_TUNE)."""
    env = config.tune_raw()
    fast = (family, device, shape_class)
    hit = _FAST.get(fast)
    if hit is not None and hit[0] == env and hit[1] == _GENERATION[0]:
        return hit[2]
    row = _lookup(family, device, shape_class)
    if len(_FAST) > 256:
        _FAST.clear()
    _FAST[fast] = (env, _GENERATION[0], row)
    return row


def _lookup(family: str, device, shape_class: str):
    cap = capability(device)
    raw, env_items = config.tune_overrides(family)
    key = (family, cap, shape_class, raw, _GENERATION[0])
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    table = TABLES[family]
    if shape_class:
        row = table.get((cap, shape_class)) or table[("default", shape_class)]
    else:
        row = table.get(cap) or table["default"]
    row = _apply(family, row, env_items, config.ENV)
    for fam, items in _OVERRIDES:
        if fam == family:
            row = _apply(family, row, items, "override")
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[key] = row
    return row


@contextlib.contextmanager
def override(family: str, **fields):
    """``with override("chunk_fwd", state_BV=32): ...`` runs with changed fields of one family (checked against the
    table first: an unknown field raises ValueError)."""
    if family not in _ROW_TYPES:
        raise ValueError(f"override: unknown family {family!r}; known: {', '.join(_ROW_TYPES)}")
    probe = next(iter(TABLES[family].values()))
    _apply(family, probe, fields, "override")
    entry = (family, dict(fields))
    _OVERRIDES.append(entry)
    _GENERATION[0] += 1
    try:
        yield
    finally:
        _OVERRIDES.remove(entry)
        _GENERATION[0] += 1


def chunk_fwd(device=None) -> ChunkForward:
    return lookup("chunk_fwd", device)


def chunk_bwd(device=None) -> ChunkBackward:
    return lookup("chunk_bwd", device)


__all__ = ["ChunkForward", "ChunkBackward", "Decode", "Recurrent", "DecodeStep", "TABLES", "lookup", "override",
           "capability", "chunk_fwd", "chunk_bwd"]
