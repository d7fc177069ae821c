# Sourced by tools/fetch_*_tests.sh: a bare git copy of a public repository.
#
#   git_dir="$(git_cache_dir NAME URL "${OVERRIDE_DIR:-}")"
#
# OVERRIDE_DIR, when set, is used as it is (a local clone or mirror).  Otherwise
# a blob-less bare clone of URL is made once under
# ${XDG_CACHE_HOME:-~/.cache}/kd_ckpt/NAME.git and fetched again later.
git_cache_dir() {
  local name="$1" url="$2" override="${3:-}"
  if [[ -n "${override}" ]]; then
    echo "${override}"
    return
  fi
  local dir="${XDG_CACHE_HOME:-${HOME}/.cache}/kd_ckpt/${name}.git"
  if [[ -d "${dir}" ]]; then
    git --git-dir="${dir}" fetch --quiet --tags origin >&2 || \
      echo "warning: could not update ${dir} from ${url}; using it as it is" >&2
  else
    mkdir -p "$(dirname "${dir}")"
    if ! git clone --quiet --bare --filter=blob:none "${url}" "${dir}" >&2; then
      echo "error: could not clone ${url} into ${dir}; point the script at a" \
        "local copy instead (see its header)" >&2
      return 2
    fi
  fi
  echo "${dir}"
}
