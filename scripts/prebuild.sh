#!/usr/bin/env bash
# Builds the package here, off the device, for the GPU machine to use without building
# (gpu_check.sh: .prebuilt/site, carried with the device call: `carry: [".prebuilt"]`).
# The device runs Python 3.12 with jax/jaxlib 0.11.2 on an H100 or H200: the extension is built
# against that Python and that jaxlib's FFI headers, for sm_90a only.
#
#   bash scripts/prebuild.sh            # PY312 (default: pyenv's 3.12) and JAXLIB_VERSION (0.11.2)
#   PREBUILD_BUILD_DIR=/tmp/base_build bash scripts/prebuild.sh   # a second tree: an A/B base
#                                        (gpu_check.sh abbase, carried as .prebuilt_base)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY312=${PY312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python 2>/dev/null | tail -1)}
JAXLIB_VERSION=${JAXLIB_VERSION:-0.11.2}
VENV=${PREBUILD_VENV:-/tmp/jax_softmax_prebuild_venv}
[ -x "${PY312:-}" ] || { echo "no Python 3.12 found: set PY312" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" -q install "jax==$JAXLIB_VERSION" "jaxlib==$JAXLIB_VERSION" nanobind scikit-build-core
fi
rm -rf "$REPO/.prebuilt"
# An object whose compile left ninja no header dependencies (seen once: instantiate_bf16.cu.o with
# "#deps 0") is never rebuilt when a header changes, so the package would carry stale kernels:
# such objects are removed and compiled again.
BUILD_DIR=${PREBUILD_BUILD_DIR:-/tmp/jax_softmax_prebuild}
if [ -f "$BUILD_DIR/build.ninja" ] && command -v ninja >/dev/null; then
  (cd "$BUILD_DIR" && ninja -t deps 2>/dev/null | awk '/\.o: #deps 0,/ {sub(/:$/, "", $1); print $1}' |
     while read -r obj; do echo "no recorded dependencies, rebuilding: $obj"; rm -f "$obj"; done)
fi
mkdir -p "$REPO/.prebuilt"
t0=$(date +%s)
(cd "$REPO" && JAX_SOFTMAX_CUDA=ON JAX_SOFTMAX_CUDA_ARCHS="${JAX_SOFTMAX_CUDA_ARCHS:-90a-real}" \
   CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$VENV/bin/python" -m pip install --no-build-isolation --no-deps -v \
   --target "$REPO/.prebuilt/site" -C build-dir="$BUILD_DIR" \
   -C cmake.define.JAX_SOFTMAX_PTXAS_VERBOSE=ON . >"$REPO/.prebuilt/build.log" 2>&1) \
  || { tail -30 "$REPO/.prebuilt/build.log"; echo "PREBUILD FAILED" >&2; exit 1; }
rev=$(git -C "$REPO" rev-parse --short HEAD)
[ -z "$(git -C "$REPO" status --porcelain --untracked-files=no -- ffi CMakeLists.txt pyproject.toml jax_softmax)" ] || rev="$rev-dirty"
echo "$rev" >"$REPO/.prebuilt/REVISION"
echo "prebuilt $rev in $(( $(date +%s) - t0 )) s: $(du -sh "$REPO/.prebuilt/site" | cut -f1)"
# ptxas' resource report (only where this build compiled CUDA code; an unchanged tree links only).
if grep -q "bytes spill stores" "$REPO/.prebuilt/build.log"; then
  echo "ptxas reports with spills: $(grep -E "bytes spill stores" "$REPO/.prebuilt/build.log" | grep -vc " 0 bytes spill stores")"
fi
