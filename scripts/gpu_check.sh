#!/usr/bin/env bash
# The one device call: build, GPU tests, compute-sanitizer, benchmark; a short table last.
# Full logs and results go under $OUT (the device tool brings them back).
#
#   bash scripts/gpu_check.sh [all|build|test|sanitize|bench|attention|train|flash|ab|abbase|absweep|ncu]...
#
# all = build test sanitize bench attention; a device call's 10 minutes hold only part of that:
# give the steps over several calls, with the package prebuilt off the device
# (scripts/prebuild.sh, carried as .prebuilt: saves the build's 135-180 s).
# test: the suite in parallel pytest processes (TEST_PART=suite), the tier tests again in command
#   buffers and on the register kernels alone (TEST_PART=extra), then the long-key tests alone
#   (about 380 s for the suite on the H200); logs $OUT/pytest_*.log.
# bench: the row-length sweep (BENCH_ARGS passes it options); attention: the (B, H, S, S) sweep
#   (ATTN_ARGS; split it with --dtypes / --modes / --variants); train: the training-step bench
#   (TRAIN_ARGS).
# flash: tests/test_flash.py and the plug-in's flash tests alone, then scripts/flash_timing.py
#   (FLASH_ARGS) against the fused softmax path and cuDNN.
# ab: scripts/profile_cases.py's cases timed under each variant of AB_VARIANTS (words of
#   comma-separated VAR=value settings, default "JAX_SOFTMAX_STAGED=1 JAX_SOFTMAX_STAGED=0").
# abbase: the same cases timed on another build of the package, rounds alternating base / this
#   (AB_ROUNDS processes, default 4): a base prebuilt off the device and carried as .prebuilt_base
#   (`PREBUILD_BUILD_DIR=/tmp/base_build bash scripts/prebuild.sh` in a worktree of the base, its
#   .prebuilt copied there), or the source tree AB_BASE_SRC built here; AB_VAR_SRC adds a third.
# absweep: the benchmark's sweeps on the base build and on this one, compared point by point.
# ncu: Nsight Compute on NCU_CASES.
# Env: JAX_SOFTMAX_CUDA_ARCHS (default 90a-real), TEST_ARGS (extra pytest arguments), TEST_K (a
# pytest -k expression), TEST_MEM_FRACTION (each test process's share of GPU memory), AB_CASES,
# NCU_CASES, NCU_REGEX / NCU_SECTIONS / NCU_METRICS, SANITIZE_COLS / RACECHECK_COLS (row lengths of
# scripts/sanitize_cases.py; SANITIZE_ALL_OPS=1 keeps all their calls), *_TIMEOUT (seconds).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/jax_softmax_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
steps=${*:-all}
want() { [[ " $steps " == *" $1 "* || (" $steps " == *" all "* && " build test sanitize bench attention " == *" $1 "*) ]]; }
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/device.txt"

# abbase: the base tree builds into its own directory while this tree builds (same flags).
BASE_SITE=/tmp/jax_softmax_base_site
base_build=
if want abbase || want absweep; then
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
    # The results' meta names the built revision (this machine's copy of .git may be another's:
    # session 87's reported dd9639f-dirty for a package of f2545a1).
    export JAX_SOFTMAX_GIT_REV=${JAX_SOFTMAX_GIT_REV:-$(cat "$REPO/.prebuilt/REVISION" 2>/dev/null)}
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
# runs them last, alone (tiers_big), as the cap on the others' memory would not hold them.
big="long_keys or limit_in_last_vector"
# A -k expression narrowed by TEST_K.
with_test_k() { if [ -n "${TEST_K:-}" ]; then echo "($TEST_K) and ($1)"; else echo "$1"; fi; }
# TEST_PART: the test step's jobs, all (default), suite (the shards that run every test once and
# the long-key tests) or extra (the tier tests again in command buffers and on the register
# kernels alone).
# The whole step took 573 s on the H200 in session 70, against a call's 600: a part fits a call
# with room, and two calls issued back to back find the machine warm.
case "${TEST_PART:=all}" in
  all | suite | extra) ;;
  *) echo "TEST_PART must be all, suite or extra, not '$TEST_PART'" >&2; exit 2 ;;
esac
test_part() { [ "$TEST_PART" = all ] || [ "$TEST_PART" = "$1" ]; }

if want test; then
  # The suite in parallel processes (a GPU test spends most of its time in XLA's compiler, on the
  # CPU; one process ran past a device call's 10 minutes). -k selects by test and module name (a
  # substring: test_kernel_tiers matches test_kernel_tiers.py and test_kernel_tiers_attention.py);
  # the shards cover every test once. The kernel-tier modules' shards were split off one at a
  # time, each where a shard ran past a call's limit beside the others (the timings that decided
  # each split are in git's log of this file); tiers_rest takes the modules' other tests, so the
  # selections (name:selection) are written once here and joined for it.
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
    "softmax:not (test_kernel_tiers or test_dropout) and (test_softmax or test_transforms or test_errors)"
    "dropout:test_dropout"
    "rest:not (test_kernel_tiers or test_softmax or test_transforms or test_errors or test_dropout)"
  )
  if test_part suite; then
    for shard in "${shards[@]}"; do
      test_job "${shard%%:*}" -- -k "$(with_test_k "${shard#*:}")" ${TEST_ARGS:-}
    done
  fi
  if test_part extra; then
    # The kernel-tier tests again in two other settings beside the suite:
    # Chained calls (each kernel launched with programmatic dependent launch) inside CUDA graphs:
    # XLA records every fusion and custom call of these programs into command buffers.
    test_job command_buffers \
      "XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
      -- -k "$(with_test_k "gpu and test_kernel_tiers and dependent_calls")"
    # The register kernels alone, as GPUs before sm_90 run them (JAX_SOFTMAX_STAGED=0: no staged,
    # short-row or staged backward kernels): every tier's boundaries and the odd, gap and long rows.
    test_job register_tiers JAX_SOFTMAX_STAGED=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 -- \
      -k "$(with_test_k "gpu and test_kernel_tiers and (tier_boundaries or many_long_rows or odd_row_tiers or plain_row_gaps or past_top_rows or causal_attention_sizes or short_windowed_rows or short_wide_rows or float_half_warp_rows or float_short_row_lanes or mid_backward_rows or wide_block_rows) and not ($big)")"
  fi
  wait_tests
  if test_part suite; then
    test_job tiers_big XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 -- -k "$(with_test_k "test_kernel_tiers and ($big)")"
    wait_tests
  fi
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
# train: the training step of the example LM and of a Linen decoder stack, attention dropout 0.1
# and 0, Flax's default against the plug-in, jax_softmax's kernels and cuDNN
# (benchmarks/bench_train_step.py; TRAIN_ARGS passes it options, e.g. "--models lm --seq-lens 512
# 1024 --profile" for each step's GPU timeline). Both models at S = 512, 2048, 4096 with
# --steps 20 --repeats 2 took 297 s on the H200 (session 84): narrow the default to fit a call.
if want train; then
  "$PY" "$REPO/benchmarks/bench_train_step.py" --out "$OUT/train" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_step.log" | tail -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want flash; then
  test_job flash XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 -- -k "$(with_test_k "test_flash or flash_route")"
  wait_tests
  "$PY" "$REPO/scripts/flash_timing.py" ${FLASH_ARGS:-} 2>&1 | tee "$OUT/flash_timing.log" | tail -30
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

# absweep: the benchmark's sweeps (the default row lengths, and attention at S = 128 ... 4096) on
# the base build (as abbase: .prebuilt_base or AB_BASE_SRC) and on this one, base then this for
# each bench and dtype, so that the two sides of a point run minutes apart; then
# scripts/compare_builds.py compares every point's % of the copy, each measured against its own
# run's copy (AB_SWEEP: the benches, default "softmax attention"; AB_DTYPES; AB_REPS / AB_PIPELINE:
# the bench's --reps / --pipeline, default 5 / 10). The results travel as absweep.tar.
if want absweep; then
  if [ -n "$base_build" ]; then
    wait "$base_build" || { tail -20 "$OUT/build_base.log"; echo "BASE BUILD FAILED"; exit 1; }
    base_build=
  fi
  for bench in ${AB_SWEEP:-softmax attention}; do
    extra=
    [ "$bench" = attention ] && extra="--seqs 128 256 512 1024 2048 4096"
    for dt in ${AB_DTYPES:-float32 bfloat16 float16}; do
      for build in base this; do
        # Both builds timed by this tree's harness (benchmarks/jax_softmax_bench first on the
        # path): a base from before issue 87 carries its own, older one in its package.
        (if [ $build = base ]; then export PYTHONPATH="$BASE_SITE"; fi
         export PYTHONPATH="$REPO/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
         timeout "${AB_TIMEOUT:-400}" "$PY" -c "import sys; from jax_softmax_bench import cli; sys.exit(cli.main(sys.argv[1:]))" \
           "$bench" --dtypes "$dt" \
           --providers jax_softmax copy_jax --no-check --no-plot --reps "${AB_REPS:-5}" \
           --pipeline "${AB_PIPELINE:-10}" --out "$OUT/absweep" --tag "${bench}_${build}_${dt}" $extra) \
          >"$OUT/absweep_${bench}_${build}_${dt}.log" 2>&1 || { status=1; tail -5 "$OUT/absweep_${bench}_${build}_${dt}.log"; }
      done
    done
  done
  "$PY" "$REPO/scripts/compare_builds.py" --base "$OUT"/absweep/*_base_*.json \
    --this "$OUT"/absweep/*_this_*.json --out "$OUT/absweep/compare" >"$OUT/absweep_compare.log" 2>&1
  grep -E "slower|points:" "$OUT/absweep_compare.log" | tail -40
  (cd "$OUT" && tar cf absweep.tar absweep && rm -rf absweep)
fi

if want ncu; then
  # No preallocation and 128 MiB tensors: ncu saves and restores device memory on every replay.
  # Our kernels (every __global__ of the kernel files that ffi/softmax_kernels.cuh includes: the short-row and staged backward
  # ones were missing until session 71, whose first profile caught nothing) and the benchmark's
  # Triton ones (fwd_tile, bwd_tile, ...).
  ncu_kernels=${NCU_REGEX:-softmax_rows|softmax_short_rows|softmax_bwd_staged|dropout_rows|dropout_pairs|dropout_stream|fwd_tile|fwd_loop|bwd_tile|bwd_loop}
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
