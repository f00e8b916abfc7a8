#!/usr/bin/env bash
# Container entrypoint: bring the vLLM tree to the patched state, then start vLLM.
#
#   entrypoint.sh [vllm serve arguments...]
#
# K3PATCH_ON_DRIFT=fail (default): a drifted site (code in no shape k3patch knows) stops the
#   container with k3patch's exit code; =warn logs it and starts vLLM anyway.
# K3PATCH_ARGS: extra arguments for `k3patch apply` (e.g. "--vllm /opt/vllm").
# K3PATCH_BIN: the k3patch command (default: k3patch).
# Exit codes are forwarded: k3patch's when it stops the start, vLLM's once vLLM runs (exec).
set -uo pipefail

on_drift="${K3PATCH_ON_DRIFT:-fail}"
k3patch_bin="${K3PATCH_BIN:-k3patch}"

# shellcheck disable=SC2086  # K3PATCH_ARGS is a list of words on purpose
"$k3patch_bin" apply --quiet ${K3PATCH_ARGS:-}   # one line per patch
rc=$?

case "$rc" in
  0) ;;
  1)
    if [ "$on_drift" = "warn" ]; then
      echo "k3patch: a site drifted; starting vLLM anyway because K3PATCH_ON_DRIFT=warn" >&2
    else
      echo "k3patch: a site drifted; not starting vLLM (set K3PATCH_ON_DRIFT=warn to override)" >&2
      exit "$rc"
    fi
    ;;
  *)
    echo "k3patch: apply failed with exit $rc (2 usage/internal, 3 environment); not starting vLLM" >&2
    exit "$rc"
    ;;
esac

exec vllm serve "$@"
