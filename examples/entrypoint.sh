#!/usr/bin/env bash
# Container entrypoint: bring the vLLM tree to the patched state, then start vLLM.
#
#   entrypoint.sh [vllm serve arguments...]
#
# Environment:
#   K3PATCH_ON_DRIFT=fail (default): a patch whose site drifted (code in no shape k3patch knows)
#     stops the container. =warn starts vLLM anyway, with every other fix applied, and logs one
#     line per patch that is missing.
#   K3PATCH_ARGS: extra arguments for `k3patch apply` (e.g. "--vllm /opt/venv/lib/python3.12/
#     site-packages --lock-timeout 300"). --vllm, --only and --skip also select what the digest
#     line covers. --check, --help and -h (apply writes nothing) are refused: exit 2.
#   K3PATCH_BIN: the k3patch command (default: k3patch). VLLM_BIN: the vllm command (default: vllm).
#
# Log lines (stdout): k3patch's version and path, one line per patch from `k3patch apply
# --quiet`, the digest (equal on two nodes <=> same tree state), the vllm command it execs.
# Warnings and errors go to stderr.
#
# Exit codes:
#   0-255 once vLLM runs: vLLM's own (the script execs it).
#   1     a patch drifted and K3PATCH_ON_DRIFT=fail: vLLM was not started.
#   2     k3patch usage or internal error (bad K3PATCH_ARGS, not a vLLM tree, a k3patch bug), or
#         K3PATCH_ON_DRIFT is neither fail nor warn.
#   3     environment: no vLLM found, tree not writable, disk full, lock timeout.
#   127   k3patch or vllm is not installed (not on PATH): nothing was changed or started.
set -uo pipefail

on_drift="${K3PATCH_ON_DRIFT:-fail}"
k3patch_bin="${K3PATCH_BIN:-k3patch}"
vllm_bin="${VLLM_BIN:-vllm}"

say() { echo "k3patch: $*"; }
warn() { echo "k3patch: $*" >&2; }

case "$on_drift" in
  fail | warn) ;;
  *)
    warn "error: K3PATCH_ON_DRIFT=$on_drift; use fail or warn"
    exit 2
    ;;
esac

if ! k3patch_path=$(command -v "$k3patch_bin"); then
  warn "error: '$k3patch_bin' is not on PATH: k3patch is not installed in this image (see the" \
    "docs/operators.md, 'Getting k3patch into an image'); not starting vLLM"
  exit 127
fi
if ! vllm_path=$(command -v "$vllm_bin"); then
  warn "error: '$vllm_bin' is not on PATH: no vLLM to start (set VLLM_BIN, or check the image's" \
    "venv is on PATH); nothing was patched"
  exit 127
fi

# shellcheck disable=SC2206  # K3PATCH_ARGS is a list of words on purpose
apply_args=(${K3PATCH_ARGS:-})
# The options of apply that also select the tree and patches for `status --digest`.
status_args=()
for ((i = 0; i < ${#apply_args[@]}; i++)); do
  case "${apply_args[i]}" in
    --vllm | --only | --skip)
      status_args+=("${apply_args[i]}" "${apply_args[i + 1]:-}")
      i=$((i + 1))
      ;;
    --vllm=* | --only=* | --skip=*) status_args+=("${apply_args[i]}") ;;
    --check | --help | -h)
      # apply would write nothing and exit 0 (help) or 1 (pending, read here as drift).
      warn "error: K3PATCH_ARGS has ${apply_args[i]}: the entrypoint applies before it starts" \
        "vLLM; for a dry run use \`k3patch apply --check\` or \`k3patch status\`"
      exit 2
      ;;
  esac
done

say "$("$k3patch_bin" --version 2>&1 | head -n 1) ($k3patch_path)"

out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$k3patch_bin" apply --quiet "${apply_args[@]}" | tee "$out" # one line per patch
rc=${PIPESTATUS[0]}

# The patches vLLM would run without: drifted ones (refused), and pending ones when
# --all-or-nothing refused the whole run.
missing=$(sed -n -E 's/^k3patch: ([A-Za-z0-9_.-]+): (drifted|pending).*/\1 \2/p' "$out")

case "$rc" in
  0) ;;
  1)
    if [ "$on_drift" != "warn" ]; then
      warn "a site drifted; not starting vLLM (set K3PATCH_ON_DRIFT=warn to start it without" \
        "the drifted fix)"
      exit 1
    fi
    while read -r patch verdict; do
      [ -n "$patch" ] || continue
      warn "warning: $patch is $verdict: vLLM starts WITHOUT this fix (K3PATCH_ON_DRIFT=warn)"
    done <<<"$missing"
    warn "starting vLLM anyway because K3PATCH_ON_DRIFT=warn; every other fix is applied"
    ;;
  2)
    warn "apply failed with exit 2 (usage or internal error, see above); not starting vLLM"
    exit 2
    ;;
  3)
    warn "apply failed with exit 3 (environment: no vLLM found, tree not writable, disk full," \
      "lock timeout; see above); not starting vLLM"
    exit 3
    ;;
  *)
    warn "apply failed with exit $rc; not starting vLLM"
    exit "$rc"
    ;;
esac

digest=$("$k3patch_bin" status --digest "${status_args[@]}" 2>/dev/null | head -n 1)
say "digest ${digest:-unknown} (compare it across nodes: equal <=> same tree state)"
say "exec $vllm_path serve $*"
rm -f "$out"
exec "$vllm_path" serve "$@"
