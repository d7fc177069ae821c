#!/usr/bin/env bash
# Extracts Orbax's handler test suites from a git copy of google/orbax.
#
#   tools/fetch_orbax_tests.sh OUTDIR [REV]
#   make test-orbax-peer ORBAX_SRC=OUTDIR
#
# A developer convenience for tools/orbax_peer.py, which never fetches: the
# Orbax tests are not vendored into kd_ckpt.  Writes, under OUTDIR, the two
# suites (with their own helper) and the test helpers that the
# orbax-checkpoint wheel does not ship (_src/testing/multiprocess_test.py and
# its oss/ base), in the repository's layout (OUTDIR/checkpoint/orbax/...),
# plus OUTDIR/ORBAX_REVISION naming the commit.
#
# ORBAX_GIT_DIR: a git directory holding google/orbax (bare or not).  Unset:
#   a blob-less bare clone made once under ~/.cache/kd_ckpt (tools/git_cache.sh).
# REV: the revision to extract (default HEAD).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
out="$1"
rev="${2:-HEAD}"
source "$(dirname "${BASH_SOURCE[0]}")/git_cache.sh"
git_dir="$(git_cache_dir orbax https://github.com/google/orbax "${ORBAX_GIT_DIR:-}")"
if ! git --git-dir="${git_dir}" rev-parse --verify --quiet "${rev}^{commit}" \
    >/dev/null 2>&1; then
  echo "error: no revision '${rev}' in ORBAX_GIT_DIR=${git_dir}" >&2
  echo "hint: git clone --bare --filter=blob:none" \
    "https://github.com/google/orbax ${git_dir}" >&2
  exit 2
fi

pkg=checkpoint/orbax/checkpoint
files=(
  "${pkg}/_src/handlers/standard_checkpoint_handler_test.py"
  "${pkg}/_src/handlers/standard_checkpoint_handler_test_utils.py"
  "${pkg}/_src/handlers/pytree_checkpoint_handler_test.py"
  "${pkg}/_src/testing/multiprocess_test.py"
  "${pkg}/_src/testing/oss/multiprocess_test.py"
)
mkdir -p "${out}"
git --git-dir="${git_dir}" archive --format=tar "${rev}" -- "${files[@]}" \
  | tar -x -C "${out}"
commit="$(git --git-dir="${git_dir}" rev-parse "${rev}^{commit}")"
version="$(git --git-dir="${git_dir}" show "${commit}:${pkg}/version.py" \
  | sed -n "s/^__version__ = '\(.*\)'/\1/p")"
echo "google/orbax ${commit} (version.py ${version})" > "${out}/ORBAX_REVISION"
echo "Extracted ${#files[@]} files of google/orbax ${commit:0:12}" \
  "(version.py ${version}) into ${out}"
echo "Run: make test-orbax-peer ORBAX_SRC=${out}"
