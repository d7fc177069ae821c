#!/usr/bin/env bash
# Extracts Kauldron's checkpointer test suite from a git copy of
# google-research/kauldron, at the tag of the installed kauldron.
#
#   tools/fetch_kauldron_tests.sh OUTDIR [REV]
#   make test-kauldron-peer KAULDRON_SRC=OUTDIR
#
# Nothing is vendored into kd_ckpt.  KAULDRON_GIT_DIR: a git directory
# holding google-research/kauldron (default: $KD_MIRROR/google-research+kauldron/repo
# with KD_MIRROR defaulting to /work/.mirror).  To make one:
#   git clone --bare --filter=blob:none https://github.com/google-research/kauldron DIR
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
git_dir="${KAULDRON_GIT_DIR:-${KD_MIRROR:-/work/.mirror}/google-research+kauldron/repo}"
if ! git --git-dir="${git_dir}" rev-parse --verify --quiet "${rev}^{commit}" >/dev/null 2>&1; then
  echo "error: no revision '${rev}' in KAULDRON_GIT_DIR=${git_dir}" >&2
  exit 2
fi
f=kauldron/checkpoints/checkpointer_test.py
mkdir -p "${out}/$(dirname "${f}")"
git --git-dir="${git_dir}" show "${rev}:${f}" > "${out}/${f}"
git --git-dir="${git_dir}" rev-parse "${rev}^{commit}" > "${out}/KAULDRON_REVISION"
echo "${out}/${f} at ${rev} ($(cat "${out}/KAULDRON_REVISION"))"
