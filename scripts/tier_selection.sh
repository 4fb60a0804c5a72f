#!/usr/bin/env bash
# The CUDA launcher's kernel choices for a sweep of calls, without a GPU (scripts/tier_selection.cu
# says how), for one source tree, or two trees compared:
#
#   bash scripts/tier_selection.sh TREE [OUT.txt]          # TREE: a checkout (its ffi/ is used)
#   bash scripts/tier_selection.sh --compare BASE_TREE TREE # prints the calls whose choice moved
#
# Env: TIER_SELECTION_FLAGS (extra nvcc flags: -DTIER_SELECTION_ALL_DTYPES adds float16 and
# float64 to float32 and bfloat16; -DTIER_SELECTION_SHORT_COPY_ARG for trees before the short-row
# kernels lost their copy-mode argument, debb461 and older), JAXLIB_INCLUDE (the XLA FFI headers;
# default: the installed jaxlib's); JAX_SOFTMAX_STAGED=0 in the environment gives that setting's
# choices. Compiles PTX only (no ptxas): a few minutes.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
JAXLIB_INCLUDE=${JAXLIB_INCLUDE:-$("$PY" -c "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))")}
build_and_run() {  # TREE OUT [extra flags]
  local tree=$1 out=$2 bin
  shift 2
  bin=$(mktemp -d)/tier_selection
  nvcc -std=c++17 -O1 --expt-relaxed-constexpr -gencode arch=compute_90a,code=compute_90a -cudart none \
    -I "$tree/ffi" -isystem "$JAXLIB_INCLUDE" ${TIER_SELECTION_FLAGS:-} "$@" \
    "$HERE/tier_selection.cu" -o "$bin" -Xcompiler -fno-pie -Xlinker -no-pie
  "$bin" >"$out"
  echo "$(wc -l <"$out") calls -> $out"
}
if [ "${1:-}" = --compare ]; then
  base=$2 tree=$3 dir=$(mktemp -d)
  build_and_run "$base" "$dir/base.txt" ${BASE_FLAGS:-} &
  build_and_run "$tree" "$dir/this.txt"
  wait
  if diff "$dir/base.txt" "$dir/this.txt" >"$dir/diff.txt"; then
    echo "no call changed its kernel, launch shape or flags"
  else
    echo "$(grep -c '^<' "$dir/diff.txt") calls differ (base <, this >): $dir/diff.txt"
    head -40 "$dir/diff.txt"
    exit 1
  fi
else
  build_and_run "$1" "${2:-/dev/stdout}"
fi
