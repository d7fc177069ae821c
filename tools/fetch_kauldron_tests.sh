#!/usr/bin/env bash
# Extracts Kauldron's checkpointer test suite from a git copy of
# google-research/kauldron, at the tag of the installed kauldron.
#
#   tools/fetch_kauldron_tests.sh OUTDIR [REV]
#   make test-kauldron-peer KAULDRON_SRC=OUTDIR
#
# Nothing is vendored into kd_ckpt.  KAULDRON_GIT_DIR: a git directory
# holding google-research/kauldron.  Unset: a blob-less bare clone made once
# under ~/.cache/kd_ckpt (tools/git_cache.sh).
# REV: default v<installed kauldron version>.
set -euo pipefail
if [[ $# -lt 1 || $# -gt 2 ]]; then
  sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
out="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${here}/.venv/bin/python"
rev="${2:-v$("${py}" -c 'import importlib.metadata as m; print(m.version("kauldron"))')}"
source "$(dirname "${BASH_SOURCE[0]}")/git_cache.sh"
git_dir="$(git_cache_dir kauldron https://github.com/google-research/kauldron "${KAULDRON_GIT_DIR:-}")"
if ! git --git-dir="${git_dir}" rev-parse --verify --quiet "${rev}^{commit}" >/dev/null 2>&1; then
  echo "error: no revision '${rev}' in KAULDRON_GIT_DIR=${git_dir}" >&2
  exit 2
fi
f=kauldron/checkpoints/checkpointer_test.py
mkdir -p "${out}/$(dirname "${f}")"
git --git-dir="${git_dir}" show "${rev}:${f}" > "${out}/${f}"
git --git-dir="${git_dir}" rev-parse "${rev}^{commit}" > "${out}/KAULDRON_REVISION"
echo "${out}/${f} at ${rev} ($(cat "${out}/KAULDRON_REVISION"))"
