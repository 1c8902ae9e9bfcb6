#!/usr/bin/env bash
# Runs the Triton kernels' tests under the Triton of the GPU image (3.6.0, ../shared/ENVIRONMENT.md), in Triton's
# CPU interpreter, as .ci/run does: .venv has a newer Triton, and a kernel that uses what 3.6 lacks would fail only
# on the GPU machine, whose time is short. The interpreter checks each kernel's language and arithmetic, not its
# compiled code.
#
# Triton 3.6 and numpy 2.2 go into a folder put first on PYTHONPATH (pip --target, no dependencies: torch and the
# rest are .venv's), outside the checkout and reused while it holds those versions (~190 MB once, ~10 s). numpy 2.2,
# because 3.6's interpreter turns one-element arrays into ints, which numpy 2.3 and later refuse.
#
# A failed install fails this script. Outside CI, an offline machine (pip cannot reach its package index) gets a
# warning that these tests did NOT run and exit 0; under CI=true that is a failure, as in scripts/vllm_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_SPEC="triton==3.6.0"
NUMPY_SPEC="numpy==2.2.6"
PYTHON="${MAIN_VENV:-.venv}/bin/python"
SITE="${ALIGNFLOW_TRITON_COMPAT_SITE:-${XDG_CACHE_HOME:-$HOME/.cache}/alignflow/${TRITON_SPEC/==/-}-${NUMPY_SPEC/==/-}}"
# The tests whose kernels are Triton's (kernels/_triton_*.py); the C++ and torch kernels' tests (skinny linear,
# RMSNorm, RoPE, SwiGLU, decode attention, the extension's build) do not depend on Triton: `make test` runs them.
TESTS=(tests/kernels/test_decode_step.py tests/kernels/test_logprobs.py tests/kernels/test_sampling.py
       tests/stages/common/generation/test_engine_fused_decode.py tests/stages/common/generation/test_graphed_loop.py)

versions() {
  PYTHONPATH="$SITE" "$PYTHON" -c 'import numpy, triton; print(triton.__version__, numpy.__version__)' 2>/dev/null
}

if [ "$(versions)" != "${TRITON_SPEC#*==} ${NUMPY_SPEC#*==}" ]; then
  echo "triton compat tests: installing $TRITON_SPEC and $NUMPY_SPEC into $SITE" >&2
  rm -rf "$SITE"
  mkdir -p "$(dirname "$SITE")"
  if ! "$PYTHON" -m pip install -q --no-deps --target "$SITE" "$TRITON_SPEC" "$NUMPY_SPEC"; then
    if "$PYTHON" -m pip index versions triton >/dev/null 2>&1; then
      echo "error: installing $TRITON_SPEC into $SITE failed although the package index is reachable" >&2
      exit 1
    fi
    rm -rf "$SITE"
    if [ "${CI:-}" = "true" ]; then
      echo "error: the package index is unreachable; the Triton $TRITON_SPEC tests cannot run (CI=true)" >&2
      exit 1
    fi
    echo "WARNING: the package index is unreachable; the Triton $TRITON_SPEC tests DID NOT RUN" >&2
    exit 0
  fi
  [ "$(versions)" = "${TRITON_SPEC#*==} ${NUMPY_SPEC#*==}" ] \
    || { echo "error: $SITE does not import $TRITON_SPEC and $NUMPY_SPEC after the install" >&2; exit 1; }
fi
echo "triton compat tests: $(versions | sed 's/ / with numpy /') from $SITE" >&2
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
