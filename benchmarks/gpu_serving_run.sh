#!/usr/bin/env bash
# Device call(s) for the serving issue. Usage on the device machine (carry: carry_sched, from `bash benchmarks/carry.sh
# pack`):
#     bash benchmarks/gpu_serving_run.sh [benchmarks/serving.py arguments]
# One model's policies can be split over several calls; results accumulate in benchmarks/results/serving_h200.json,
# so copy $OUT's files into benchmarks/results/ between calls (the next call carries them in the working tree).
# The 2026-11-30 code50m run (230-300 s; now serving_equal_lengths_h200.json): --model code50m --max-new-tokens 64 --repeats 1 --requests-per-slot 2
#     --breakdown-at --no-paged (records the acceptance trace; equal request lengths, before --length-spread existed).
# The 2026-12-01 runs (about 160 s each; the drafter decompressed from carry_sched/code50m-dspark first): the same
#     with the default --length-spread 0.5 and --out benchmarks/results/serving_length_spread_h200.json.
# The current serving_h200.json (2026-12-01, two calls, python run directly with --out under $OUT, 449 s and 442 s):
#     --model code50m --max-new-tokens 64 --repeats 3 --requests-per-slot 2 --breakdown-at 1 256 --no-paged
#     --model qwen3-4b-shape --max-new-tokens 32 --repeats 1 --requests-per-slot 2 --breakdown-at --no-paged
#     (the 4B shape needs no carry: random init, acceptance replayed from the committed trace; timing only)
#     code50m was run interleaved (the default since then, 342 s); the 4B shape sequentially (before that existed).
# Next: the 4B shape interleaved with --repeats 2, split over two calls by --concurrency (1 2 4 8 16 32 | 64 128 256;
#     cells merge by concurrency when the first call's JSON is carried back in as --out). Six 4B engines at c = 256
#     hold about 85 GB of KV cache at once.
# The static engine (DSparkEngine(static=True)), first run 2026-12-02 (serving_static_h200.json; 530 s, c = 256 not
#     reached: compilation took most of the call; SERVING_TIMEOUT keeps what finished):
#     SERVING_TIMEOUT=530 ... --model code50m --static --max-new-tokens 64 --repeats 2 --requests-per-slot 2 --no-paged
#     --concurrency 1 16 256 --out $OUT/serving_static_h200.json
# 2026-12-02 (tenth session): --dynamic-batch compiled slower on the GPU (26-39 s a graph); the split-KV attention
#     bug that cost the static engine its drafts at c = 1 is fixed; c = 1 and 2 re-run (serving_static_custom_op_*.log).
# 2026-12-02 (eleventh session): the whole sweep with eager admission, in two calls of about 500 s (one size of graphs
#     per concurrency; now serving_static_eager_admission_h200.json and _code50m_h200.log):
#     SERVING_TIMEOUT=560 ... --model code50m --static --graph-sizes-per-cell 1 --max-new-tokens 64 --repeats 3
#     --requests-per-slot 4 --no-paged --concurrency 1 2 4 8 16 --out $OUT/static_sweep.json, then --repeats 2
#     --requests-per-slot 2 --concurrency 32 64 128 256 with static_sweep.json carried back in as --out (a name
#     other than serving_static_h200.json, which is copied below); then c = 16 alone with chunked admission
#     (serving_static_chunked_admission_h200.json, 162 s).
# 2026-12-02 (twelfth session): the same sweep with chunked admission (library cb02937), now
#     serving_static_sequential_h200.json and serving_static_sequential_code50m_h200.log, in three calls: c = 1-8 (565 s: the 560 s limit cut c = 16), c =
#     32-256 (478 s), c = 16 alone (121 s). The static cells then still ran one after another, the hardware-aware
#     one always last; since then one engine per policy, stepped in turn (--sequential: one after another).
# 2026-12-02 (twelfth session): policies stepped in turn, library dcead12 (serving_static_interleaved_h200.json, 275 s):
#     SERVING_TIMEOUT=480 ... --model code50m --static --graph-sizes-per-cell 1 --max-new-tokens 64 --repeats 3
#     --requests-per-slot 2 --no-paged --concurrency 16 128 --out $OUT/static_interleaved.json
# 2026-12-02 (thirteenth session): the whole sweep stepped in turn with --admission-rows 4, library 36f6ee0
#     (serving_static_h200.json; three calls: c = 4 8 16, 314 s; 128 32 64 256, 389 s; 1 2, 192 s):
#     SERVING_TIMEOUT=560 ... --model code50m --static --graph-sizes-per-cell 1 --max-new-tokens 64 --repeats 3
#     --requests-per-slot 4 --no-paged --admission-rows 4 --concurrency 4 8 16 --out $OUT/static_sweep.json
# 2026-12-03 (fourteenth session): library df8605b, admission groups of 16 with no eager prefill, 64 requests per cell
#     (serving_static_admission_rows16_h200.json, serving_static_admission_rows4_h200.json and
#     serving_static_admission_code50m_h200.log; four calls: c = 256 in groups of 4 (cut) and of 16, c = 1 2 (cut);
#     c = 1 2 and c = 256 in groups of 4 with the eager prefill from 8; c = 256 128; c = 16 64 4 (8 and 32 cut):
#     SERVING_TIMEOUT=440 ... --model code50m --static --graph-sizes-per-cell 1 --max-new-tokens 64 --repeats 3
#     --no-paged --policies no_spec fixed_3 fixed_7 hardware_aware --requests-per-slot 4 --min-requests 64
#     --admission-rows 16 --eager-admission-from 100000 --concurrency 16 64 4 32 8 --out $OUT/mid_rows16.json
# 2026-12-03 (fifteenth session): the same settings with --round-logs $OUT/round_logs.json.gz at c = 64 16 (library
#     21679d1, 249 s) and, with the drift-aware chooser's intermediate variant, c = 64 16 256 (425 s; 256 cut):
#     serving_static_round_logs_h200.* and serving_static_round_logs_chooser_h200.* (replay them with
#     benchmarks/chooser_replay.py).
#     Then the final chooser (library 35acc27) at c = 256 32 8 (412 s) and c = 4 (c = 1 cut at 215 s):
#     serving_static_final_chooser_h200.* (cells and round logs of both calls merged).
# 2026-12-04 (sixteenth session): the final chooser at c = 128 64 16 (364 s) and 2 1 (361 s), library 33f25aa, the same
#     arguments; merged into serving_static_final_chooser_h200.*. (Also --model qwen3-4b-shape --static --min-requests
#     16 --concurrency 1 32: no cell in 545 s; the four engines' compilation at c = 1 alone took 114, 163, 89, 148 s.)
# Seventeenth session: benchmarks/round_width_overhead.py (run directly after `bash benchmarks/gpu_serving_run.sh
#     --help`, which only sets up the carry) and, with the chooser recording each round during the next (library
#     4341e83), the same arguments at c = 16 2 128 (347 s) and 1 64 (283 s): serving_static_deferred_record_h200.*
#     (both calls merged).
# Eighteenth session: the same arguments at c = 256 32 8 (368 s) and, with fixed_1 in --policies, 4 32 1 (361 s),
#     library d52a697, merged into serving_static_deferred_record_h200.*; then, with the next round's width chosen
#     during the current one (library 42634cb), c = 1 2 32 4 (565 s; 4 cut), 4 (87 s) and 8 (143 s):
#     serving_static_overlapped_choice_h200.* (the three calls merged).
# Nineteenth session: the same arguments at c = 16 64 128 (353 s) and 256 (library 9642fa7 = 42634cb's engine), merged
#     into serving_static_overlapped_choice_h200.*; in the c = 256 call a second run with --warm-up-tokens 64 at c = 32
#     64 (log only: run with OUT=$OUT/a and $OUT/b, the two left more files under $OUT than a call returns; delete the
#     serving_*h200.* copies below from $OUT when a call runs the script twice). Then, with warm_up() freezing the
#     collector (library e32937f), c = 256 128 32 (372 s) and 64 16 4 (363 s): serving_static_gc_freeze_h200.*.
# Twentieth session: the Qwen3-4B shape with the drafting policies on one engine (library: the --shared-graphs commit):
#     SERVING_TIMEOUT=578 ... --model qwen3-4b-shape --static --shared-graphs --graph-sizes-per-cell 1
#     --max-new-tokens 64 --repeats 2 --no-paged --policies no_spec fixed_1 fixed_3 fixed_7 hardware_aware
#     --requests-per-slot 2 --min-requests 16 --admission-rows 16 --eager-admission-from 100000 --concurrency 64
#     (345 s), then --requests-per-slot 1 --concurrency 256 (322 s): serving_static_4b_shared_h200.* (both merged; a
#     first call with --repeats 3 --requests-per-slot 4 --concurrency 64 256 was cut at 565 s with no cell). Then
#     `python benchmarks/plain_round_tax.py --model qwen3-4b-shape --concurrency 256 --new-tokens 96
#     --profile-rounds 24` (293 s): plain_round_tax_h200.json (no carry needed for this model).
# Twenty-first session: plain_round_tax.py again (library 8eea18e: still copying on torch 2.11; now
#     plain_round_tax_transposed_view_h200.json), then, with the cache indexed in place and the attention skipping
#     hidden tiles (library f9a1923), the twentieth session's 4B arguments at c = 256 (354 s) and, with
#     --requests-per-slot 2 and SERVING_TIMEOUT=470, c = 64 (302 s): serving_static_4b_inplace_h200.* (merged).
# Twenty-second session: plain_round_tax.py (library c37e3dc, run directly; plain_round_tax_inplace_h200.json, 331 s),
#     then, with warm_up() capturing every graph (library 0b0769a), the twenty-first session's 4B command at
#     --requests-per-slot 1 --concurrency 256 (396 s), --requests-per-slot 2 --concurrency 16 (362 s) and
#     --requests-per-slot 4 --concurrency 4 (427 s), merged into serving_static_4b_warm_capture_h200.*.
# Twenty-third session (library 98b6537 with compile_layers_once): plain_round_tax.py with its timeline (288 s;
#     plain_round_tax_timeline_h200.json), then the twenty-second session's 4B command with --compile-layers-once
#     --requests-per-slot 2 at --concurrency 16 1 8 (576 s; c = 1 cut), 1 (224 s) and 8 (251 s), merged into
#     serving_static_4b_regions_h200.* (the trace replayer restarted each run); then benchmarks/compile_breakdown.py
#     with and without --compile-layers-once (its docstring's command; the run without was cut at 130 s).
# Twenty-fourth session (library 9ef1074, the chooser with drawn acceptance): the twenty-third session's 4B command
#     with --repeats 6 --requests-per-slot 8 --concurrency 2 (359 s), --repeats 4 --requests-per-slot 4 --concurrency
#     32 (369 s) and --repeats 3 --requests-per-slot 2 --concurrency 128 (390 s), merged into
#     serving_static_4b_longer_runs_h200.*; then the c = 128 call with --admission-batch 16 (288 s):
#     serving_static_4b_admission_batch16_h200.*.
# Twenty-fifth session (library dd848e6): the twenty-fourth session's 4B command with --admission-batch auto at
#     --repeats 3 --requests-per-slot 2 --concurrency 128 (284 s), --repeats 4 --requests-per-slot 4 --concurrency 32
#     (257 s) and --repeats 3 --requests-per-slot 4 --concurrency 8 (443 s), merged into
#     serving_static_4b_admission_auto_h200.*; the code50m arguments of the nineteenth session with --admission-batch
#     auto --concurrency 256 64 16 (299 s): serving_static_code50m_admission_auto_h200.*. "auto" is now serving.py's
#     (and the static engine's) default.
# Twenty-sixth session (library c01b6a2, key_bounds merged): `python benchmarks/attention_hidden_tiles.py` (hidden
#     tiles 0.00 us with the bounds); the twenty-fifth session's 4B command at c = 128 (356 s, fresh machine):
#     serving_static_4b_key_bounds_h200.*, and at c = 32 (365 s): serving_static_4b_key_bounds_c32_h200.*; the
#     code50m command at c = 256 64 16 (320 s):
#     serving_static_code50m_key_bounds_h200.*. Before them, main + both branches with --policies no_spec
#     hardware_aware, SERVING_TIMEOUT=210 each, without and with --overlap (OUT=$OUT/read, OUT=$OUT/overlap; only
#     c = 256 finished): serving_static_code50m_overlap_trial_*.
# Twenty-seventh session (main 0022b8c): `python benchmarks/cuda_graph_replay.py --model code50m qwen3-4b-shape` in
#     its first form (cuda_graph_replay_h200.json: reduce-overhead's trees cost the host 0.2-1.3 ms per round call,
#     a direct capture 9-36 us). The session's GPU time ran out (a device call was lost) before the direct graphs
#     (cuda_graphs.py, merged opt-in: DSPARK_CUDA_GRAPHS=direct) could be tested or timed.
# Twenty-eighth session: no GPU was lent. The engine's requests and round log stopped growing the garbage
#     collector's work per round (library ec6b8ff; development CPU: engine_host_cpu.py --gc, pauses 746 -> 124 ms in
#     a four-engine 256-row replay), the static batch's sampled DSpark rounds replay direct graphs too (opt-in), and
#     benchmarks/carry.sh packs the carry (run `bash benchmarks/carry.sh pack` first: a new checkout has no carry_sched).
# Twenty-ninth session (library 6e7a4cd, then 1a8feed): `bash benchmarks/gpu_round_run.sh tests`, then `code50m` and
#     `qwen3-4b-shape`, `trees` and `direct`, with `--methods plain_static_compiled dspark_static_compiled` (one call,
#     401 s; the 4B trees files were beyond the eight a call returns): round_speed_graphs_*_h200.json,
#     cuda_graphs_tests_h200.log. Then the code50m command at c = 256 64 with DSPARK_CUDA_GRAPHS=direct and =trees,
#     SERVING_TIMEOUT=228 each, OUT=$OUT/direct and $OUT/trees (one call, 572 s; only c = 256 finished in each):
#     serving_static_code50m_graphs_{direct,trees}_h200.*; the two engine CUDA tests (285 s; the sampled one cut):
#     cuda_graphs_engine_tests_h200.log. Direct graphs are the default since then (DSPARK_CUDA_GRAPHS=trees opts out).
# Thirtieth session (library 7e1ba59, then 893ef2d): the sampled engine CUDA test (246 s, passed:
#     cuda_graphs_sampled_engine_test_h200.log) and `python benchmarks/plain_round_tax.py --model code50m --concurrency
#     256 --new-tokens 96 --profile-rounds 32` (plain_round_tax_code50m_before_h200.json); after the replays stopped
#     entering the kernels' context, the same profile (..._after_h200.json) and this script's code50m command at
#     c = 256 64 with SERVING_TIMEOUT=370 OUT=$OUT/s (one call, 320 s): serving_static_code50m_host_context_h200.*.
# Thirty-fourth session (library 840af9f, one H100): the delivery-timed chooser at c = 64 16 (302 s), 256 128 (243 s),
#     4 1 (282 s) with the code50m command below, then the 4B command at c = 32 alone (508 s; 447 s of warm-up):
#     serving_static_code50m_delivery_timed_h100_*.{json,png,log}, serving_static_4b_delivery_timed_h100_c32.*.
# Thirty-fifth session (library ea09e18, one H100: a round verifying v < 7 drafts drafts only those v slots):
#     round_widths.py --device cuda --dtype bfloat16 --compile --rows 16 64 256 with the library before and after
#     (one call, 307 s: round_widths_h100.json), then the code50m command below with fixed_1 among the policies at
#     c = 64 16 and 32 8 2 (--requests-per-slot 16), 256 128 (8) and 4 1 (64), four calls of 183-291 s:
#     serving_static_code50m_narrow_rounds_h100.{json,png,json.gz,log}.
# Thirty-sixth session (library 21ea0d0, one H100: the chooser compares posterior means over about the last thousand
#     rounds and switches at 90 % confidence): the code50m command below at c = 16 64 (--requests-per-slot 16, 253 s
#     on a fresh machine), 32 8 2 (16, 334 s), 256 128 (8, 208 s), 4 1 (64, 263 s), merged into
#     serving_static_code50m_confident_chooser_h100.{json,png,json.gz}; then tests/test_cuda_graphs.py for 230 s
#     (14 passed, unfinished; run it with PYTHONPATH=src).
# Thirty-seventh session (library 5d0f9ea, one H100 after seventeen refused calls; RoundWidthChooser.refine: rounds
#     of at most 2 rows take their width from the rows' acceptance states): the code50m command below at c = 4 1
#     (--requests-per-slot 64, 290 s, fresh machine) and 2 (16, 153 s), merged into
#     serving_static_code50m_refine_h100.{json,png,json.gz,log}; the CPU twin's runs: chooser_on_text_c*_states_cpu.json.
# Thirty-eighth session (one H100): the same command at c = 4 1 2 with library 646f835 (per-state counts folded every
#     32 rounds; 566 s, c = 2 unfinished: serving_static_code50m_fold_h100.*), then at c = 1 2 with 2eb104b (refine
#     never runs a plain round; 374 s on a fresh machine: serving_static_code50m_drafting_refine_h100.*), then at
#     c = 4 8 with 047114b (the stationary correction, reverted after; 444 s: serving_static_code50m_stationary_h100.*).
# Thirty-ninth session (library 3732903, one H100: the chooser takes the switch cost, measured on the chosen width's
#     rounds right after another width's, off the other widths' times): the code50m command below at c = 4 1
#     (--requests-per-slot 64, 315 s on a fresh machine): serving_static_code50m_switch_cost_h100.{json,png,json.gz,log};
#     then with 875b29c (refine's answers kept, reverted after) at c = 1 2 (64, 271 s, fresh), 256 128 (8, 354 s),
#     16 64 (16, 277 s), merged into serving_static_code50m_refine_memo_h100.{json,png,json.gz,log}; then the
#     engine's sampled CUDA-graph test first among five of tests/test_cuda_graphs.py (270 s: it passed, the second was
#     cut): cuda_graphs_sampled_narrow_rounds_h100.log.
# Fortieth session (one H100 a call; the code50m command below, --requests-per-slot 8 at c = 128 64, 32 at c = 4 1):
#     library 053f703 (widths timed in turn) at c = 64 128 (272 s, fresh): serving_static_code50m_in_turn_h100.*;
#     9cb870e (round times per rows and requests; the whole step timed) at 64 128 (313 s, fresh):
#     serving_static_code50m_request_groups_h100.*; 02ec21f (the same, outside_ms logged) at 128 64 (218 s, fresh):
#     serving_static_code50m_outside_logged_h100.*; 020d75a with hardware_aware_round_timed among the policies at
#     128 64 (258 s, fresh): serving_static_code50m_round_timed_variant_h100_c128_64.*; 020d75a at 4 1 (252 s, warm):
#     serving_static_code50m_step_timed_h100_c4_1.*.
# Forty-first session (one H100 a call, fresh): library ce392be (the told overhead; the row upkeep cut) with
#     hardware_aware_round_timed among the policies, at c = 128 64 (8 requests a slot; 335 s) and, with
#     row_freeing.py before it, 4 1 (32; 347 s): serving_static_code50m_told_overhead_h100_{c128_64,c4_1}.*, and
#     `python benchmarks/row_freeing.py --trials 100 --out ...` with src and with e8d93c3's src (carried as
#     carry_sched/old_src/src on PYTHONPATH): row_freeing_{ce392be,e8d93c3,primitives}_h100.json.
# Forty-second session (one H100 a call, fresh): library 951ae32 (the strides, and prepare's crash fixed) with
#     --policies no_spec fixed_3 fixed_7 hardware_aware hardware_aware_hazards_only --requests-per-slot 32 at c = 4 1
#     (257 s) and at c = 4 (147 s): serving_static_code50m_strides_h100_{c4_1,c4_second}.* (the first try, on 89658ff,
#     crashed in prepare). Since then (11499d9) the hazards alone are the default and hardware_aware_strides the variant.
# Forty-third session (one H100 a call, fresh): library 6267ea7 (refined rounds apart) with --policies no_spec fixed_3
#     fixed_7 hardware_aware hardware_aware_strides --requests-per-slot 32 at c = 4 1 (247 s), then no_spec fixed_3
#     fixed_7 hardware_aware --requests-per-slot 8 at c = 128 64 (218 s): serving_static_code50m_refined_h100_*;
#     then library 33e9468 (admissions counted) at c = 128 64 (319 s): serving_static_code50m_admissions_h100_c128_64.*.
# Forty-fourth session (one H100, fresh, then warm): library 773ae75 (admission_saving; probing rounds keep a plain
#     run) with --policies no_spec fixed_3 fixed_7 hardware_aware at c = 128 64 (--requests-per-slot 8, 232 s) and c = 4
#     1 (32, 237 s): serving_static_code50m_probes_h100_*. At c = 64 the engine ran plain rounds in 99 % of two runs and
#     served 0.964 x no speculation: a drafting engine's plain rounds cost 2.7 % more, its admissions 5 % more.
# Forty-fifth session (one H100, fresh): library 6a930e4 (bare plain rounds in a long plain run, admissions without
#     features, StaticBatchRounds.catch_up) with --policies no_spec fixed_3 fixed_7 hardware_aware --requests-per-slot 8
#     at c = 64 128 (371 s): serving_static_code50m_bare_h100_c64_128.*. At c = 64 plain rounds and admissions cost what
#     no speculation's do; 1.0007 x no speculation. c = 4 alone on the same warm machine was cut at 206 s (compiling).
# Forty-sixth session (2026-12-07): no device machine could be started (all 14 calls refused, 1 520 s of device time
#     spent on refusals). The chooser now gets a round that caught up first without the catch-up's time (library
#     aff8e13 on): item 1 below measures it; the CPU twin (chooser_catch_up_twin_cpu.json) expects 0.99 x the best
#     fixed width at c = 64 and 128 either way round (before: 0.964-0.967 where gamma = 3 led).
# Forty-seventh session (2026-12-07, one H100, fresh, granted at once): item 1 of the list before, library 202701a,
#     c = 64 128 (258 s) then c = 4 1 (266 s) on the warm machine: serving_static_code50m_catch_up_untimed_h100_*.
#     Hardware-aware / best: 0.990 (c = 1), 0.986 (4), 0.980 (64), 0.988 (128). Then the two test files under a
#     420 s limit were cut before pytest's summary (no failure printed).
# Forty-eighth session (2026-12-07, one H100, five fresh machines, 1 648 s of device time): round_width_overhead.py
#     --width 3 --concurrency 1 then --width 0 --concurrency 128 (479 s; round_width_overhead_w{3,0}_*_h100.json);
#     library 950fab7 (a state's prior from its own slot before) at c = 1 2 with --requests-per-slot 32 (316 s):
#     serving_static_code50m_state_prior_h100_c1_2.*, hardware-aware / best 0.997 (c = 1), 0.992 (2);
#     round_width_overhead.py --width 3 --concurrency 1 --round-parts twice (154 s, 206 s;
#     round_width_overhead_parts_w3_c1*_h100.json); c = 4 with hardware_aware_state_rows_4 beside the four policies
#     (166 s): serving_static_code50m_state_rows4_h100_c4.*, 0.983 (state_rows 4: 0.968).
# Next (one call each, carry_sched; move demo_models/, drafters/ and benchmarks/results/ aside first; a device call
#     returns at most eight files, so write fewer or split):
#     1. `PYTHONPATH=src python -m pytest -q -p no:hypothesispytest -n 0 tests/test_cuda_graphs.py` and, in a second
#        call, tests/test_tensor_ops.py (together they took more than 420 s on a fresh machine); since 2026-12-07
#        their oracle drafters (rank 48) run the fused greedy Markov loop (generation/fused_markov.py), which no GPU
#        call has yet run inside the static engine. 2026-12-07 (51st session, H100): `-k "static_generate_on_cuda or
#        sampling_on_cuda"` passed with the chunked prefill (cuda_graphs_chunked_prefill_tests_h100.log), but
#        `-k test_static_engine_on_cuda_serves_exactly` was cut twice by its own timeout (150 s, 220 s, after about
#        300 s of other work on a fresh machine): give it a call of its own;
#     0. the few-rows GEMM (generation/skinny_linear.py, opt-in; 2026-12-07, 52nd session: written, but none of 23
#        device calls got a machine, so never run on a GPU; the 53rd session's 22 calls got none either, nor the
#        54th's 9, after which new loans were paused; the 55th was lent none):
#        `pytest tests/test_cuda_graphs.py -k few_rows`, then `DSPARK_SKINNY_LINEAR=0`, `=fused` (q/k/v and gate/up
#        only) and `=1` around `round_speed.py --model code50m --methods plain_static_compiled
#        dspark_static_compiled` (and the same for qwen3-4b-shape), and `decode_gemm_micro.py code50m` / `4b` for the
#        projections alone (the library's tiles beside the sweep); make it the default only where it pays;
#     1c. `round_speed.py --model qwen3-4b-shape --methods plain_static_compiled dspark_static_compiled`, once as is
#        and once with --eager-prefill (the 4B shape's eager prefill has not been timed with the chunks), and the
#        fixture's three-run series on an H200;
#     1a. the fused Markov loop in the engine: c = 1 2 4 with the four policies, once as is and once with
#        DSPARK_FUSED_MARKOV=0 (the speculative engines' rounds should shorten by about what round_speed.py showed at
#        batch 1, 0.05 ms a round on an H100);
#     1b. why the hardware-aware engine's rounds cost 8-19 us more than the fixed engines' of the same width: the
#        49th session (round_width_overhead_*_h100.json of 2026-12-07) found the kernels the same (at c = 128, plain:
#        --profile-rounds), `choose`'s host work free and longer caches free; the difference is in the device time
#        outside the kernels, and it varied between calls. Next: round_width_overhead.py --width 3 --concurrency 1
#        --round-parts --queue-cycles 200000 --engines fixed_3 hardware_aware_pinned_3_choosing hardware_aware_untimed
#        (the device's time without the launch's; the pinned engine with `choose` called, so that `refine` runs and
#        may give 7 where its rows' states ask for it),
#        then the same with --profile-rounds 40 and without --queue-cycles;
#     2. c = 64 128 and c = 4 1 again only after a change that touches them (the 48th session's change acts on rounds
#        of at most 2 rows); the command:
#        SERVING_TIMEOUT=420 OUT=$OUT bash benchmarks/gpu_serving_run.sh --model code50m --static
#        --graph-sizes-per-cell 1 --max-new-tokens 64 --repeats 3 --no-paged --policies no_spec fixed_3
#        fixed_7 hardware_aware --requests-per-slot 8 --min-requests 64 --admission-rows 16
#        --eager-admission-from 100000 --concurrency 64 128 --round-logs $OUT/round_logs.json.gz --out $OUT/cells.json
#        (then rm -f $OUT/serving_static_h200.* $OUT/serving_h200.* $OUT/serving_trace_code50m.json: eight files),
#        and with --requests-per-slot 32 --concurrency 4 1 on the same warm machine;
#     3. the 4B command at c = 32 and 128 with the narrow rounds;
#        `round_speed.py --model qwen3-8b-shape --methods plain_static_compiled dspark_static_compiled`.
#     A fresh machine compiles slowly: give a call of one concurrency at least 200 s. Device starts were refused
#     often on 12-06 and 12-07 (each refusal costs 15-180 s of the session's device time).
set -uo pipefail
# SERVING_TIMEOUT=S stops the benchmark after S seconds (results are saved after every concurrency); 0: no limit.
export PYTHONPATH=${DSPARK_SRC:-src}
[ -d carry_sched ] && bash benchmarks/carry.sh unpack  # (code50m only; carry_sched from `carry.sh pack`)
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout "${SERVING_TIMEOUT:-0}" python benchmarks/serving.py "$@" 2>&1 | grep -v Warning | tee "$OUT"/serving.log  # kept as benchmarks/results/serving_<model>_h200.log
cp benchmarks/results/serving_h200.json benchmarks/results/serving_h200.png "$OUT"/ 2>/dev/null || true
cp benchmarks/results/serving_static_h200.json benchmarks/results/serving_static_h200.png "$OUT"/ 2>/dev/null || true
cp benchmarks/results/serving_trace_code50m.json "$OUT"/ 2>/dev/null || true
