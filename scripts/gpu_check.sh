#!/usr/bin/env bash
# The one device call: build, GPU tests, compute-sanitizer, benchmark; a short table last.
# Full logs and results go under $OUT (the device tool brings them back).
#
#   bash scripts/gpu_check.sh [all|build|test|knobs|replaced|sanitize|bench|attention|train|ab|ncu]...   (default: all)
#
# all = build test knobs sanitize bench attention, more than one device call holds: give the steps
# over several calls (a call's build takes 135-180 s on the H100; a package prebuilt here with
# scripts/prebuild.sh and carried as .prebuilt saves it, see below). test: the suite in eight
# parallel pytest processes and the tier tests in command buffers beside them, then the long-key
# tests alone (session 29, H100, prebuilt: 349 s); replaced: the tier tests under the knobs that
# bring back the routes that sessions 52-55 replaced (not part of all); knobs: the tier tests
# under other knobs (three jobs at once; since session 42 past one call: KNOB_TESTS splits
# them); logs $OUT/pytest_*.log; bench: the row-length sweep (forward alone, two dtypes and all
# providers, 130 s on the H100; backward and forward+backward together ran past 300 s: give them
# two calls);
# attention: the (B, H, S, S) sweep, ATTN_ARGS passes it options (in full 420 points, about 14
# minutes on the H100, session 29: split it with --dtypes / --modes / --variants).
# ab: quick A/B timing of scripts/profile_cases.py cases under each variant in AB_VARIANTS
# (words of comma-separated VAR=value settings, default
# "JAX_SOFTMAX_STAGED=1 JAX_SOFTMAX_STAGED=0"); abbase: the same cases timed on another build of
# the package, the source tree AB_BASE_SRC (e.g. `git archive BASE | tar -x -C .base`, carried),
# built beside this one (give `build abbase`, in that order) and run as base / this / base / this
# (AB_ROUNDS processes, default 4), one process each; with AB_VAR_SRC, a third tree built the same
# way, the rounds go base / this / var. A base prebuilt off the device and carried as
# .prebuilt_base (`PREBUILD_BUILD_DIR=/tmp/base_build bash scripts/prebuild.sh` in a worktree of
# the base, its .prebuilt copied there) takes the place of AB_BASE_SRC and its build: then
# `abbase` alone, with this tree prebuilt too. ncu: Nsight Compute on NCU_CASES.
# Env: JAX_SOFTMAX_CUDA_ARCHS (default 90a-real: the device is an H100/H200), AB_BASE_SRC, BENCH_ARGS
# (extra arguments for `python -m jax_softmax bench`), NCU_REGEX / NCU_SECTIONS / NCU_METRICS (kernels, ncu sections, extra metrics), TEST_ARGS (extra pytest arguments), TEST_K (a pytest -k expression, e.g. "gpu or flax or example" to skip the CPU copies), TEST_PART (all, suite or knobs: the test step's jobs, see test_part), TEST_MEM_FRACTION (each test process's share of GPU memory), AB_CASES, NCU_CASES, SANITIZE_COLS / RACECHECK_COLS (row lengths of scripts/sanitize_cases.py to run; SANITIZE_ALL_OPS=1 keeps all their calls), *_TIMEOUT (seconds).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/jax_softmax_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
steps=${*:-all}
want() { [[ " $steps " == *" $1 "* || (" $steps " == *" all "* && " build test knobs sanitize bench attention " == *" $1 "*) ]]; }
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"

# abbase: the base tree builds into its own directory while this tree builds (same flags).
BASE_SITE=/tmp/jax_softmax_base_site
base_build=
if want abbase; then
  if [ -d "$REPO/.prebuilt_base/site" ]; then
    BASE_SITE=$REPO/.prebuilt_base/site  # prebuilt off the device and carried: nothing to build
    echo "prebuilt base: $(cat "$REPO/.prebuilt_base/REVISION" 2>/dev/null)"
  else
    (cd "$REPO" && rm -rf "$BASE_SITE" && JAX_SOFTMAX_CUDA=ON JAX_SOFTMAX_CUDA_ARCHS="${JAX_SOFTMAX_CUDA_ARCHS:-90a-real}" \
       CMAKE_BUILD_PARALLEL_LEVEL=8 "$PY" -m pip install --no-build-isolation --no-deps --target "$BASE_SITE" \
       "${AB_BASE_SRC:?abbase needs AB_BASE_SRC or a carried .prebuilt_base}" >"$OUT/build_base.log" 2>&1) &
    base_build=$!
  fi
  # AB_VAR_SRC: a third tree (a variant of this one), built and timed beside the other two.
  VAR_SITE=/tmp/jax_softmax_var_site
  if [ -n "${AB_VAR_SRC:-}" ]; then
    (cd "$REPO" && rm -rf "$VAR_SITE" && JAX_SOFTMAX_CUDA=ON JAX_SOFTMAX_CUDA_ARCHS="${JAX_SOFTMAX_CUDA_ARCHS:-90a-real}" \
       CMAKE_BUILD_PARALLEL_LEVEL=8 "$PY" -m pip install --no-build-isolation --no-deps --target "$VAR_SITE" \
       "$AB_VAR_SRC" >"$OUT/build_var.log" 2>&1) &
    var_build=$!
  fi
fi

# A package built off the device (scripts/prebuild.sh: Python 3.12, jaxlib's FFI headers of the
# device's version, sm_90a) and carried in .prebuilt/site saves the call's build (135-180 s on the
# H100). Used where this call does not build; if it does not load its CUDA kernels here, the call
# builds after all.
if ! want build && [ -d "$REPO/.prebuilt/site" ]; then
  export PYTHONPATH="$REPO/.prebuilt/site${PYTHONPATH:+:$PYTHONPATH}"
  if (cd /tmp && "$PY" -c "import jax_softmax, sys; sys.exit('cuda' not in jax_softmax.available_platforms())"); then
    echo "prebuilt package: $(cat "$REPO/.prebuilt/REVISION" 2>/dev/null)"
  else
    echo "prebuilt package does not load its CUDA kernels here: building"
    unset PYTHONPATH
    steps="build $steps"
  fi
fi

if want build; then
  t0=$(date +%s)
  # -v keeps ptxas' resource report in the log when JAX_SOFTMAX_PTXAS_VERBOSE is set.
  if ! (cd "$REPO" && JAX_SOFTMAX_CUDA=ON JAX_SOFTMAX_CUDA_ARCHS="${JAX_SOFTMAX_CUDA_ARCHS:-90a-real}" \
        CMAKE_BUILD_PARALLEL_LEVEL=16 "$PY" -m pip install --no-build-isolation --no-deps -v \
        -C cmake.define.JAX_SOFTMAX_PTXAS_VERBOSE=ON . >"$OUT/build.log" 2>&1); then
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
  echo "build: $(( $(date +%s) - t0 )) s"
  # Are the hot loops' accesses 16 bytes wide? (LDG.E.128 / STG.E.128 in the SASS)
  so=$("$PY" -c "import jax_softmax, glob, os; print(glob.glob(os.path.join(os.path.dirname(jax_softmax.__file__), '_jax_softmax_cuda*.so'))[0])" 2>/dev/null)
  if [ -n "$so" ] && command -v cuobjdump >/dev/null; then
    echo "SASS global accesses in $(basename "$so"):"
    cuobjdump -sass "$so" | grep -oE "(LDG|STG)\.E[A-Z0-9._]*" | sort | uniq -c | sort -rn | head -8
  fi
fi

# Run from outside the checkout so Python imports the installed package, not the source tree.
cd /tmp
# One pytest process in the background: test_job NAME [VAR=value]... -- PYTEST_ARGS...
# Its log is $OUT/pytest_NAME.log, its JUnit XML $OUT/pytest_NAME.xml. No preallocation, and each
# process's allocator capped at TEST_MEM_FRACTION of the GPU (default 0.075; a job's own
# XLA_PYTHON_CLIENT_MEM_FRACTION overrides it): several processes share the GPU, and eleven uncapped
# ran the H200 out of memory (session 17: launches, module loads and 24 KiB allocations failed with
# CUDA_ERROR_OUT_OF_MEMORY in every shard).
test_pids=()
test_names=()
test_job() {
  local name=$1 envs=()
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  env XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION="${TEST_MEM_FRACTION:-0.075}" \
    ${envs[@]+"${envs[@]}"} timeout "${TEST_TIMEOUT:-1800}" \
    "$PY" -m pytest "$REPO/tests" -q -p no:cacheprovider -rf --maxfail=25 \
    --junitxml="$OUT/pytest_$name.xml" "$@" >"$OUT/pytest_$name.log" 2>&1 &
  test_pids+=($!)
  test_names+=("$name")
}
# Waits for the jobs started so far; prints each one's last line and failures.
wait_tests() {
  for i in "${!test_pids[@]}"; do
    name=${test_names[$i]}
    wait "${test_pids[$i]}"
    rc=$?
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1  # 5: TEST_K left the shard no tests
    echo "tests $name: $(tail -1 "$OUT/pytest_$name.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_$name.log" | head -10
  done
  test_pids=()
  test_names=()
}
# The tests of keys up to 2^19 long (arrays of several GiB: one allocated 14 GiB): the test step
# runs them last, alone (tiers_big), as the cap on the others' memory would not hold them; the
# knobs step leaves them out.
big="long_keys or limit_in_last_vector"
# A -k expression narrowed by TEST_K.
with_test_k() { if [ -n "${TEST_K:-}" ]; then echo "($TEST_K) and ($1)"; else echo "$1"; fi; }
# TEST_PART: the test step's jobs, all (default), suite (the shards that run every test once and
# the long-key tests) or knobs (the jobs that run tests again under knobs or in command buffers).
# The whole step took 573 s on the H200 in session 70, against a call's 600: a part fits a call
# with room, and two calls issued back to back find the machine warm.
case "${TEST_PART:=all}" in
  all | suite | knobs) ;;
  *) echo "TEST_PART must be all, suite or knobs, not '$TEST_PART'" >&2; exit 2 ;;
esac
test_part() { [ "$TEST_PART" = all ] || [ "$TEST_PART" = "$1" ]; }

if want test; then
  # The suite in parallel processes (a GPU test spends most of its time in XLA's compiler, on the
  # CPU; one process ran past a device call's 10 minutes). -k selects by test and module name;
  # the shards cover every test once: the kernel-tier module in thirteen (the staged-ring,
  # dependent-call and causal-size tests were one shard until session 28, which ran past 320 s
  # beside the others; the odd-row tests one with the rest until session 38, past 470 s on the
  # H100; the past-top rows of session 41 their own, tiers_odd already taking 437 s there, with
  # the wide-block rows since session 42; the odd-row tiers apart from the rings and gaps since
  # session 46, when the three together ran past 470 s on the H100 with 5 of 6 done; the long
  # staged rows of session 52 beside the causal sizes, whose shard took 27 s then; the block rows
  # since session 54, when the module's other tests, one shard, ran past 495 s on the H200 with
  # 46 of 54 done, and alone took 381 s, 155 of them in these four tests; session 55's thin
  # reread rows apart, tiers_odd having taken 437 s on the H100; the staged-ring rows in a shard
  # per dtype since session 56, when as one they took 480 s of the 495 allowed on the H200; the
  # broadcast-operand and padding-mask tests apart since session 69, when the module's other tests,
  # one shard, ran past 520 s on the H200 with 24 of 51 done, with the large causal sizes since
  # session 70, when the module's other tests ran past 540 s with 22 of 23 done: the last,
  # causal_attention_large at 4097 float64, unfinished; alone the eight took 65 s), the rest in
  # two.
  # The kernel-tier module's own shards (name:selection); tiers_rest takes the module's other
  # tests, so the selections are written once here and joined for it.
  tier_shards=(
    "tiers_boundaries:tier_boundaries"
    "tiers_long:two_pass or many_long_rows"
    "tiers_ring_f32:staged_ring and f32"
    "tiers_ring_bf16:staged_ring and bf16"
    "tiers_dependent:dependent_calls or mid_backward_rows"
    "tiers_causal:causal_attention_sizes or long_staged_rows"
    "tiers_odd:odd_row_tiers"
    "tiers_thin:thin_reread_rows"
    "tiers_gaps:odd_row_rings or plain_row_gaps"
    "tiers_past:past_top_rows or wide_block_rows"
    "tiers_blocks:plain_block_rows or reread_block_rows or block_warps or windowed_row_neighbours"
    "tiers_operands:broadcast_operand_order or padding_mask_skips_masked_vectors or causal_attention_large or attention_beyond_clusters"
  )
  tiers_split=
  shards=()
  for shard in "${tier_shards[@]}"; do
    tiers_split+="${tiers_split:+ or }(${shard#*:})"
    shards+=("${shard%%:*}:test_kernel_tiers and (${shard#*:})")
  done
  shards+=(
    "tiers_rest:test_kernel_tiers and not ($tiers_split) and not ($big)"
    "softmax:not test_kernel_tiers and (test_softmax or test_transforms or test_errors)"
    "rest:not (test_kernel_tiers or test_softmax or test_transforms or test_errors)"
  )
  if test_part suite; then
    for shard in "${shards[@]}"; do
      test_job "${shard%%:*}" -- -k "$(with_test_k "${shard#*:}")" ${TEST_ARGS:-}
    done
  fi
  if test_part knobs; then
    # A selection of the kernel-tier tests under knobs: tiers_job SELECTION NAME [VAR=value]...
    tiers_job() {
      local selection=$1
      shift
      test_job "$@" -- -k "$(with_test_k "gpu and test_kernel_tiers and ($selection)")"
    }
    # Chained calls (each kernel launched with programmatic dependent launch) inside CUDA graphs:
    # XLA records every fusion and custom call of these programs into command buffers.
    tiers_job dependent_calls command_buffers \
      "XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    # Every cluster tier at the size its rows need (by default only where that fits more clusters
    # on the GPU: FitCluster), and the 16-bit backward rows of 16385-131072 columns on the
    # tiers of 16 values that those of 32 replaced (JAX_SOFTMAX_RAW_WIDE=0; the plain ones of up to
    # 24576 too, which since session 45 take blocks of 40 and 48 values: JAX_SOFTMAX_BWD_BLOCKS=0),
    # and the float32 backward rows read twice with both y and dy kept in shared memory
    # (JAX_SOFTMAX_REREAD_SMEM=2).
    tiers_job "cluster_ctas or many_long_rows" cluster_fit_all JAX_SOFTMAX_CLUSTER_FIT=2 \
      JAX_SOFTMAX_RAW_WIDE=0 JAX_SOFTMAX_BWD_BLOCKS=0 JAX_SOFTMAX_REREAD_SMEM=2
    # The 16-bit backward rows of 16385-32768 on two CTAs of the 4 x 512 x 32 clusters on every GPU,
    # full rows too (JAX_SOFTMAX_RAW_WIDE=2): by default the H200 keeps those of up to 20480 on
    # 8 x 256 x 16 (session 45), so that only the H100 ran the two CTAs there.
    tiers_job mid_backward_rows mid_bwd_two_ctas JAX_SOFTMAX_RAW_WIDE=2
    # The broadcast operands' rows taken copy by copy (RowOrder) in every tier: by default only
    # where the bytes between copies exceed a quarter of L2 (OperandReuseOrder), which the tests'
    # shapes do not reach (session 31, H100: 16 passed, 25 s).
    tiers_job broadcast_operand_order reuse_order JAX_SOFTMAX_REUSE_ORDER=2
    # The 16-bit rows with a mask, bias or causal limit of 65-128 columns on the staged 8 lanes of
    # two rows, which 4 lanes of one row replaced in session 75 (JAX_SOFTMAX_GENERAL_FOUR_LANES=0).
    tiers_job "causal_attention_sizes or broadcast_operand_order" general_eight_lanes \
      JAX_SOFTMAX_GENERAL_FOUR_LANES=0
    # Forward rows with a bias or causal limit but no mask, selected per position in every vector
    # of the staged kernels, as before session 76 (JAX_SOFTMAX_UNMASKED_ROWS=0).
    tiers_job "causal_attention_sizes or broadcast_operand_order" unmasked_rows_off \
      JAX_SOFTMAX_UNMASKED_ROWS=0
    # The 16-bit odd rows of 16385-32768 on the staged clusters that one CTA of up to 1024 threads
    # replaced (to 24576 in session 33, beyond in 44; since session 49 the reread blocks take them,
    # JAX_SOFTMAX_REREAD_BLOCKS=2 keeps them off those), and the float32 rows of 16385-32768 on the
    # clusters that such a CTA replaced in session 42 (JAX_SOFTMAX_WIDE_BLOCKS=0, and
    # JAX_SOFTMAX_REREAD_FLOAT=0 past the reread blocks of session 50; test_wide_block_rows, every
    # dtype).
    tiers_job "wide_block_rows or cluster_ctas" wide_blocks_off JAX_SOFTMAX_WIDE_BLOCKS=0 \
      JAX_SOFTMAX_REREAD_BLOCKS=2 JAX_SOFTMAX_REREAD_FLOAT=0
    # The 16-bit odd rows of 16385-32768 on the wide blocks that the reread blocks replaced in
    # session 49: two CTAs per SM to W = 24576, beyond the H100's one CTA with a ring and the H200's
    # staged clusters (JAX_SOFTMAX_REREAD_BLOCKS=2); and the float32 rows of 16385-28636 on the
    # wide blocks of two tiles that the reread blocks replaced in session 50
    # (JAX_SOFTMAX_REREAD_FLOAT=0).
    tiers_job wide_block_rows odd_wide_blocks JAX_SOFTMAX_REREAD_BLOCKS=2 \
      JAX_SOFTMAX_REREAD_FLOAT=0
    # The reread blocks' odd rows (and float32 plain ones) copied from their own 16-byte window
    # start, as before session 50 (JAX_SOFTMAX_COPY_ALIGN=16; default: from 128-byte boundaries),
    # and the plain 16-bit rows of cols % 16 == 8 on the plain reread kernel, as before session 51
    # (default: the windowed one).
    tiers_job "wide_block_rows or windowed_row_neighbours or reread_block_rows" copy_align_16 \
      JAX_SOFTMAX_COPY_ALIGN=16
    # Plain 16-bit rows of 8193-16383 on the register tier's 512 x 32 block, which the staged one
    # replaced in session 51 (JAX_SOFTMAX_PLAIN16_STAGED_BLOCKS=0).
    tiers_job plain_block_rows plain16_register_blocks JAX_SOFTMAX_PLAIN16_STAGED_BLOCKS=0
    # The 16-bit odd rows whose staged tiers take OddRowTilesPerCta tiles per CTA (two on the H200,
    # and on the H100 up to 3072 columns; since session 54 on the H200 also the thinly filled rows
    # of the 256- and 512-thread blocks) at one tile per CTA, the H100's default beyond, the
    # wide blocks among them (JAX_SOFTMAX_REREAD_BLOCKS=2), and the float32 wide blocks (two by
    # default; JAX_SOFTMAX_REREAD_FLOAT=0 for all their rows).
    tiers_job "odd_row_rings or wide_block_rows" odd_rows_one_tile JAX_SOFTMAX_TILES_PER_CTA=1 \
      JAX_SOFTMAX_REREAD_BLOCKS=2 JAX_SOFTMAX_REREAD_FLOAT=0
    # The 16-bit odd rows that the tiers of 5/4 E, 3/2 E and 3/4 E values per thread (sessions
    # 38-39) and the staged 5-warp block took over, the plain rows in the same gaps (session 40),
    # and the rows past the tiers' tops on 7/4 E and 64 threads of 5/4 E (session 41), on session
    # 37's tiers (JAX_SOFTMAX_ODD_TIERS=0). Two jobs: as one it ran past 500 s beside the others
    # (H200, session 42; 445 s in session 41).
    tiers_job "odd_row_tiers or odd_row_rings" odd_tiers_off JAX_SOFTMAX_ODD_TIERS=0
    tiers_job "plain_row_gaps or past_top_rows" plain_gaps_off JAX_SOFTMAX_ODD_TIERS=0
    # The same rows on the H200's ranges of those tiers (JAX_SOFTMAX_ODD_TIERS=2), which an H100
    # takes only under that knob. Two jobs: as one it took 454-459 s beside the others (H200,
    # session 42; H100, session 43), against a limit of 500-520.
    tiers_job odd_row_tiers odd_tiers_h200 JAX_SOFTMAX_ODD_TIERS=2
    tiers_job "plain_row_gaps or past_top_rows" plain_gaps_h200 JAX_SOFTMAX_ODD_TIERS=2
    # The 16-bit plain rows of 16385-32768 on the register tiers that the reread blocks replaced by
    # default (JAX_SOFTMAX_REREAD_BLOCKS=0).
    tiers_job reread_block_rows reread_blocks_off JAX_SOFTMAX_REREAD_BLOCKS=0
    # The float32 odd rows' half-warp rows (the H200's rule for W = 257-452) on all of W = 257-512
    # and on every GPU (JAX_SOFTMAX_FLOAT_HALF_WARPS=2).
    # With them the float32 odd rows of W = 129-256 on 16 lanes (the H200's rule: W = 229-256) and of
    # W = 2049-3072 on three warps (the H200's rule: W = 2049-2560), every GPU
    # (JAX_SOFTMAX_FLOAT_SHORT_WARPS=1, JAX_SOFTMAX_FLOAT_THREE_WARPS=2), and those of W = 129-256
    # on 8 lanes of 8 vectors (the H200's rule: W = 161-228; JAX_SOFTMAX_FLOAT_SHORT_WARPS=2). The
    # first job lets a warp's threads take the two load and store paths apart, as before session 61
    # (JAX_SOFTMAX_WARP_UNIFORM_ENDS=0). Since session 72 the short-row kernel takes the float32
    # odd rows of 129-608 columns on sm_90+, so these jobs, and float_register_lanes (the H200's
    # rules of FloatShortRowShape and FloatHalfWarpRows), leave them to the register tiers
    # (JAX_SOFTMAX_SHORT_WIDE_FWD=1).
    tiers_job "float_half_warp_rows or float_short_row_lanes or float_three_warp_rows" \
      float_half_warps JAX_SOFTMAX_FLOAT_HALF_WARPS=2 JAX_SOFTMAX_FLOAT_SHORT_WARPS=1 \
      JAX_SOFTMAX_FLOAT_THREE_WARPS=2 JAX_SOFTMAX_WARP_UNIFORM_ENDS=0 JAX_SOFTMAX_SHORT_WIDE_FWD=1
    tiers_job float_short_row_lanes float_quarter_warps JAX_SOFTMAX_FLOAT_SHORT_WARPS=2 \
      JAX_SOFTMAX_SHORT_WIDE_FWD=1
    tiers_job "float_half_warp_rows or float_short_row_lanes" float_register_lanes \
      JAX_SOFTMAX_SHORT_WIDE_FWD=1
    # The short-row kernels' tests: short_job / wide_job / both_job NAME [VAR=value]...
    short_job() { tiers_job short_windowed_rows "$@"; }
    # Windowed forward rows of up to 32 vectors under session 63's rule (16-bit rows of 129-255 on
    # the staged tiers; by default the short-row kernel on 8 lanes since session 64) and on the
    # tiers they took before session 63 (JAX_SOFTMAX_SHORT_ODD_ROWS=2 and =0).
    short_job short_odd_rows_staged16 JAX_SOFTMAX_SHORT_ODD_ROWS=2
    short_job short_odd_rows_off JAX_SOFTMAX_SHORT_ODD_ROWS=0
    # The short-row kernels' other tables (session 64): the backward for every row it holds
    # (float32 to 127 columns, 16-bit to 255, on 8 lanes past 128 since session 66), with one pass
    # of rows per CTA and batched copies, then with the largest tiles and plain copies (the threads'
    # copies, not the default bulk copies of session 68).
    short_job short_rows_one_pass_batched JAX_SOFTMAX_SHORT_ODD_BWD=2 JAX_SOFTMAX_SHORT_COPY_BULK=0 \
      JAX_SOFTMAX_SHORT_TILE_KIB=0 JAX_SOFTMAX_SHORT_COPY_BATCH=1
    short_job short_rows_big_tiles_plain JAX_SOFTMAX_SHORT_ODD_BWD=2 JAX_SOFTMAX_SHORT_COPY_BULK=0 \
      JAX_SOFTMAX_SHORT_TILE_KIB=46 JAX_SOFTMAX_SHORT_COPY_BATCH=0
    # Session 65's kernel rows: every lane with all 32 values and a warp's rows consecutive (the
    # kernels before it), and each fixed row spacing (ShortRowsSpacing picks by row length), the
    # backward kernel for every row it holds.
    short_job short_rows_all_values JAX_SOFTMAX_SHORT_VALUE_CHUNKS=0 JAX_SOFTMAX_SHORT_ROW_SPACING=1
    short_job short_rows_spacing2 JAX_SOFTMAX_SHORT_ROW_SPACING=2 JAX_SOFTMAX_SHORT_ODD_BWD=2
    short_job short_rows_spacing4 JAX_SOFTMAX_SHORT_ROW_SPACING=4 JAX_SOFTMAX_SHORT_ODD_BWD=2
    # The short rows of both tests (short_windowed_rows, and short_wide_rows past 32 vectors).
    both_job() { tiers_job "short_windowed_rows or short_wide_rows" "$@"; }
    # Spacings past the block's 4 warps (session 73; for_short_tile_rows's windows of 2 and 4
    # passes, tiles of whole windows, or spacing 4 where none fits), the wide rows' 16 lanes too,
    # then the backward kernel on spacings 1-4 only (by default 8 or 16 for 16-bit 129 and
    # float32's odd 129-147 since session 74: PassWindowSpacing).
    both_job short_rows_spacing8 JAX_SOFTMAX_SHORT_ROW_SPACING=8 JAX_SOFTMAX_SHORT_ODD_BWD=2
    both_job short_rows_spacing16 JAX_SOFTMAX_SHORT_ROW_SPACING=16 JAX_SOFTMAX_SHORT_ODD_BWD=2
    both_job short_rows_no_pass_windows JAX_SOFTMAX_SHORT_PASS_WINDOWS=0
    # Backward rows on the fewest lanes that hold them, as before session 68, on at most twice as
    # many, and wherever the bank count gives any fewer conflicts (ShortRowsBwdGroup; by default up
    # to 32 where it halves).
    short_job short_rows_fewest_lanes JAX_SOFTMAX_SHORT_WIDER_LANES=0 JAX_SOFTMAX_SHORT_ODD_BWD=2
    short_job short_rows_twice_lanes JAX_SOFTMAX_SHORT_WIDER_LANES=1 JAX_SOFTMAX_SHORT_ODD_BWD=2
    short_job short_rows_any_wider_lanes JAX_SOFTMAX_SHORT_WIDER_LANES=3 JAX_SOFTMAX_SHORT_ODD_BWD=2
    # The short-row tiles copied by the threads (the table's plain or batched copies, as before
    # session 68) and copied in only by cp.async.bulk (the default: in and out), the backward
    # kernel for every row it holds; the default with one pass of rows per CTA too.
    short_job short_rows_thread_copies JAX_SOFTMAX_SHORT_COPY_BULK=0 JAX_SOFTMAX_SHORT_ODD_BWD=2
    short_job short_rows_bulk_in JAX_SOFTMAX_SHORT_COPY_BULK=1 JAX_SOFTMAX_SHORT_ODD_BWD=2
    short_job short_rows_bulk_one_pass JAX_SOFTMAX_SHORT_ODD_BWD=2 JAX_SOFTMAX_SHORT_TILE_KIB=0
    # Rows past 32 vectors of up to 1023 columns on the short-row kernels of 8-32 lanes (session 69:
    # the forward's 16-bit rows and float32 rows to 608 columns by default, the backward's where it
    # won): the kernels for every such row (the forward's float32 rows to 1023 too), then neither
    # (the staged, warp and block tiers, as before session 69). The knobs touch no row of up to 32
    # vectors, so short_windowed_rows stays out of these jobs.
    wide_job() { tiers_job short_wide_rows "$@"; }
    wide_job short_wide_rows_all JAX_SOFTMAX_SHORT_WIDE_FWD=3 JAX_SOFTMAX_SHORT_WIDE_BWD=2
    # The backward's rows on the fewest lanes that hold them (as in session 69), not on 32 where
    # the bank count halves (16-bit 257-512 within 3 of a multiple of 64, session 70).
    wide_job short_wide_rows_lanes JAX_SOFTMAX_SHORT_WIDE_BWD=2 JAX_SOFTMAX_SHORT_WIDER_LANES=0
    wide_job short_wide_rows_off JAX_SOFTMAX_SHORT_WIDE_FWD=0 JAX_SOFTMAX_SHORT_WIDE_BWD=0
    # Tiles left at the passes their size gives (JAX_SOFTMAX_SHORT_ALIGNED_TILES=0, as before it):
    # 32-lane backward rows of odd length then start half their tiles mid-vector (bfloat16 193).
    short_job short_rows_unaligned_tiles JAX_SOFTMAX_SHORT_ALIGNED_TILES=0
    # The other tile rules in both directions (by default the forward's tiles are whole 32-byte
    # sectors rounded down, session 71, the backward's whole vectors rounded up): vector tiles
    # (the forward's before session 71) and sector tiles rounded up, the wide rows too, which
    # these rules change most (16-bit forward rows of 16 and 32 lanes).
    both_job short_rows_vector_tiles JAX_SOFTMAX_SHORT_ALIGNED_TILES=1
    both_job short_rows_sector_tiles_up JAX_SOFTMAX_SHORT_ALIGNED_TILES=2
    # The forward's 16-bit tiles of 24 KiB rounded down to whole sectors (session 71; by default
    # the whole-sector pass count nearest 12 KiB, at least 9: JAX_SOFTMAX_SHORT_TILE_NEAREST).
    both_job short_rows_tiles_24k JAX_SOFTMAX_SHORT_TILE_NEAREST=0
  fi
  wait_tests
  if test_part suite; then
    test_job tiers_big XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 -- -k "$(with_test_k "test_kernel_tiers and ($big)")"
    wait_tests
  fi
fi

if want knobs; then
  # The kernel-tier tests again under non-default knobs, a step of their own (beside the suite,
  # session 17, the three processes had run 42-44 of their 68 tests each when a 370 s limit
  # stopped them; alone, 390-400 s, with the build 500 s): the
  # register tiers for plain rows, which sm_90 replaces by the staged ones (older GPUs run them);
  # staged row tiers with a ring (3 tiles per CTA; by default each CTA reduces one tile) and
  # persistent register row grids (by default one CTA per batch); every masked, biased or causal
  # row staged (by default only short ones and some rows whose only operand is a mask:
  # StageGeneralRows), whose one-row tiles copy only up to the causal limit. Not the long-key
  # tests ($big), too large for three at once.
  # Session 42 (H200): the whole selection no longer fits one device call (each job had run the
  # odd-row tests and half of many_long_rows, 24 of 96, at 520 s): KNOB_TESTS narrows it, e.g.
  # "odd_row_rings or odd_row_tiers or plain_row_gaps or past_top_rows" in one call and
  # "many_long_rows or staged_ring or causal" in another.
  knob_tests=${KNOB_TESTS:-many_long_rows or staged_ring or odd_row_rings or odd_row_tiers or plain_row_gaps or past_top_rows or causal}
  for knobs in JAX_SOFTMAX_STAGED=0 JAX_SOFTMAX_TILES_PER_CTA=3,JAX_SOFTMAX_WAVES=1 JAX_SOFTMAX_STAGED_GENERAL=2; do
    test_job "${knobs//[=,]/_}" ${knobs//,/ } XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 -- \
      -k "$(with_test_k "gpu and test_kernel_tiers and ($knob_tests) and not ($big)")"
  done
  wait_tests
  # The plain short forward rows (up to 32 vectors) on the staged tiers, which the register lane
  # groups of two rows replaced on sm_90+ in session 43 (JAX_SOFTMAX_SHORT_ROWS=0). KNOB_TESTS
  # set to something else leaves it out.
  if [ -z "${KNOB_TESTS:-}" ] || [[ "${KNOB_TESTS}" == *tier_boundaries* ]]; then
    test_job short_rows_staged JAX_SOFTMAX_SHORT_ROWS=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 -- \
      -k "$(with_test_k "test_kernel_tiers and tier_boundaries")"
    wait_tests
  fi
fi

if want replaced; then
  # The tier tests under the knobs that bring back what sessions 52-55 replaced by default, and
  # the one route left off: a step of its own, not part of `all` (beside the test step's jobs,
  # whose longest took 448 of its 482 s on the H200 in session 51, more jobs would run it past a
  # call's limit).
  # The thinly filled 16-bit odd rows that the reread blocks took from the staged row tiers on
  # the H200 in sessions 55-57 (ThinRereadElems), on those tiers again (JAX_SOFTMAX_REREAD_THIN=0:
  # the H100's default; session 54's two tiles per CTA for the blocks' thin rows). (Not
  # odd_row_rings: its widths that the knob moves, 2049, 4097, 5121, 8193 and 12289, are
  # thin_reread_rows' too, with the same rows.)
  test_job thin_reread_off JAX_SOFTMAX_REREAD_THIN=0 \
    -- -k "$(with_test_k "gpu and test_kernel_tiers and (thin_reread_rows or block_warps)")"
  # The staged blocks' windowed one-row tiles (16-bit odd rows of 2049-16384, float32 odd rows on
  # the wide blocks) copied from their own 16-byte window start (JAX_SOFTMAX_BLOCK_COPY_ALIGN=0;
  # default: from 128-byte boundaries) ...
  test_job block_copy_16 JAX_SOFTMAX_BLOCK_COPY_ALIGN=0 \
    -- -k "$(with_test_k "gpu and test_kernel_tiers and (odd_row_rings or odd_row_tiers or windowed_row_neighbours or block_warps or wide_block_rows)")"
  # ... and the plain 16-bit rows of cols % 16 == 8 on those tiers through their windowed kernel
  # (JAX_SOFTMAX_BLOCK_COPY_ALIGN=2, off by default: plain_block_rows 8184, 8200, 12296, 16376;
  # past_top_rows 2056, 2312, 2568).
  test_job block_copy_plain JAX_SOFTMAX_BLOCK_COPY_ALIGN=2 \
    -- -k "$(with_test_k "gpu and test_kernel_tiers and (plain_row_gaps or plain_block_rows or past_top_rows)")"
  # The 16-bit backward rows of 16385-32768 on the 512 x 5/2 E and 3 E blocks and the
  # 8 x 256 x E clusters, which the staged backward block replaced (JAX_SOFTMAX_BWD_STAGED=0), and
  # those of 32769-57856 on the 4 x 512 x 2E clusters, which its 1024-thread form replaced
  # (JAX_SOFTMAX_BWD_STAGED_LONG=0) ...
  test_job bwd_register_rows JAX_SOFTMAX_BWD_STAGED=0 JAX_SOFTMAX_BWD_STAGED_LONG=0 \
    -- -k "$(with_test_k "gpu and test_kernel_tiers and (mid_backward_rows or windowed_row_neighbours or reread_block_rows or wide_block_rows or long_staged_rows)")"
  # ... and the 16-bit forward rows of 32769-57272 on the clusters, which the 1024-thread reread
  # block replaced (JAX_SOFTMAX_REREAD_LONG=0).
  test_job reread_long_off JAX_SOFTMAX_REREAD_LONG=0 \
    -- -k "$(with_test_k "gpu and test_kernel_tiers and (long_staged_rows or windowed_row_neighbours or seven_chunk_rows)")"
  wait_tests
fi

if want sanitize; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    cols=${SANITIZE_COLS:-}
    [ "$tool" = racecheck ] && cols=${RACECHECK_COLS:-$cols}
    # The platform allocator gives every buffer its own cudaMalloc, so that memcheck sees a read
    # past the end of one (XLA's default pool hides it: the bytes after a buffer are the pool's).
    XLA_PYTHON_CLIENT_ALLOCATOR=platform SANITIZE_COLS=$cols timeout "${SANITIZE_TIMEOUT:-300}" \
      compute-sanitizer --tool $tool --error-exitcode 9 \
      "$PY" "$REPO/scripts/sanitize_cases.py" \
      >"$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
  done
fi

# One process of scripts/profile_cases.py's timing: profile_round LOG LABEL [VAR=value ...].
profile_round() {
  local log=$1 label=$2
  shift 2
  (if [ $# -gt 0 ]; then export "$@"; fi; echo "$label"
   timeout "${AB_TIMEOUT:-150}" "$PY" "$REPO/scripts/profile_cases.py" time ${AB_CASES:-}) \
    >"$log" 2>&1 || status=1
}
# Each case's us per call (x over XLA) in every round's log, one column per log.
profile_summary() {
  "$PY" - "$@" <<'PYEOF'
import re, sys
runs = [dict(re.findall(r"^(\S+)\s+ours.*?(x\s*[\d.]+\s+\(\d+ us\))", open(f).read(), re.M)) for f in sys.argv[1:]]
for name in runs[0]:
    print(f"{name:22s}", "   ".join(r.get(name, "-").replace("x", "").replace(" us", "") for r in runs))
PYEOF
}

if want bench; then
  "$PY" -m jax_softmax bench --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -70
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want attention; then
  "$PY" -m jax_softmax bench attention --out "$OUT/bench" ${ATTN_ARGS:-} 2>&1 | tee "$OUT/bench_attention.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# train: one training step of examples/train_lm.py with and without the plug-in
# (benchmarks/bench_train_step.py; TRAIN_ARGS passes it options, e.g. "--seq-lens 512 1024
# --profile" for each step's GPU timeline; three runs of each variant: 218 s for the four default
# lengths with --profile on the H200, session 48).
if want train; then
  "$PY" "$REPO/benchmarks/bench_train_step.py" --out "$OUT/train" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_step.log" | tail -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want ab; then
  i=0
  for variant in ${AB_VARIANTS:-JAX_SOFTMAX_STAGED=1 JAX_SOFTMAX_STAGED=0}; do
    i=$((i + 1))
    profile_round "$OUT/ab_$i.log" "variant $variant" ${variant//,/ }
  done
fi

if want abbase; then
  if [ -n "$base_build" ]; then
    wait "$base_build" || { tail -20 "$OUT/build_base.log"; echo "BASE BUILD FAILED"; exit 1; }
  fi
  builds=(base this)
  if [ -n "${AB_VAR_SRC:-}" ]; then
    wait "$var_build" || { tail -20 "$OUT/build_var.log"; echo "VARIANT BUILD FAILED"; exit 1; }
    builds+=(var)
  fi
  logs=()
  for i in $(seq 1 "${AB_ROUNDS:-4}"); do
    logs+=("$OUT/abbase_$i.log")
    case ${builds[$(( (i - 1) % ${#builds[@]} ))]} in
      base) profile_round "$OUT/abbase_$i.log" "build base" PYTHONPATH="$BASE_SITE" ;;
      var) profile_round "$OUT/abbase_$i.log" "build var" PYTHONPATH="$VAR_SITE" ;;
      *) profile_round "$OUT/abbase_$i.log" "build this" ;;
    esac
  done
  echo "== A/B against the base build: us per call (x over XLA), rounds in turn: ${builds[*]} =="
  profile_summary "${logs[@]}"
fi

if want ncu; then
  # No preallocation and 128 MiB tensors: ncu saves and restores device memory on every replay.
  # Our kernels (every __global__ of ffi/softmax_kernels.cuh: the short-row and staged backward
  # ones were missing until session 71, whose first profile caught nothing) and the benchmark's
  # Triton ones (fwd_tile, bwd_tile, ...).
  ncu_kernels=${NCU_REGEX:-softmax_rows|softmax_short_rows|softmax_bwd_staged|fwd_tile|fwd_loop|bwd_tile|bwd_loop}
  XLA_PYTHON_CLIENT_PREALLOCATE=false PROFILE_MIB=128 timeout "${NCU_TIMEOUT:-300}" \
    ncu --clock-control none -k "regex:$ncu_kernels" \
    $(for s in ${NCU_SECTIONS:-SpeedOfLight Occupancy LaunchStats WarpStateStats}; do echo --section $s; done) \
    ${NCU_METRICS:+--metrics "$NCU_METRICS"} \
    "$PY" "$REPO/scripts/profile_cases.py" ncu ${NCU_CASES:-} >"$OUT/ncu.log" 2>&1 || status=1
  grep -E "profiled|$ncu_kernels|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Block Limit Registers|No Eligible|Issued Warp Per|L2 Hit Rate  |Mem Busy|Max Bandwidth|Eligible Warps|Active Warps Per|Waves Per SM|Grid Size|Block Size|Dynamic Shared|Stall|stalled|Memory Throughput" \
    "$OUT/ncu.log" | sed -E 's/\(jax_softmax::RowParams\)//; s/jax_softmax:://g' >"$OUT/ncu_summary.log"
fi

if want ab; then
  echo "== A/B: us per call (x over XLA), one column per variant of AB_VARIANTS =="
  profile_summary $(ls "$OUT"/ab_*.log | sort -V)
fi

# The device tool returns at most 8 files: bundle the logs (and device.txt), keep results
# (JSON/CSV/PNG) as they are. Appends, so that several invocations in one device call share one
# archive. Where more than 8 files would still be left (two benches write 6, and anything the
# device command writes into $OUT after this script counts too: session 46 lost a sweep's JSON and
# PNG that way), the CSVs join the archive as well (each JSON holds the same records).
(cd "$OUT" && for f in *.log *.xml *.txt; do [ -e "$f" ] && tar rf logs.tar "$f" && rm -f "$f"; done
 if [ "$(find . -type f | wc -l)" -gt 8 ]; then
   find . -type f -name '*.csv' | while read -r f; do tar rf logs.tar "$f" && rm -f "$f"; done
 fi
 left=$(find . -type f | wc -l)
 [ "$left" -le 8 ] || echo "WARNING: $left files under \$OUT; the device tool returns 8 of them")
exit $status
