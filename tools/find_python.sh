#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 interpreter, for `make` to build .venv.
#
# kauldron >= 1.4.3 and gemma 4 need Python >= 3.12; on 3.11 pip silently
# resolves to kauldron 1.4.2 + gemma 3.x, which do not work together.
# Looks, in order, at: $KD_PYTHON (if set, it must be >= 3.12), python3.12 (the tested
# version) and python3.13 on PATH,
# $(pyenv root)/versions/3.1[2-9]*/bin/python3, then python3.  Each candidate
# is run (pyenv shims exist even for versions that are not installed).
set -uo pipefail

MIN_MAJOR=3
MIN_MINOR=12
looked=()

ok() {
  # ok PYTHON: true if PYTHON runs and is >= 3.12.
  "$1" -c "import sys; sys.exit(0 if sys.version_info >= (${MIN_MAJOR}, ${MIN_MINOR}) else 1)" \
    >/dev/null 2>&1
}

try() {
  local candidate="$1" label="$2"
  looked+=("${label}")
  if [[ -n "${candidate}" ]] && ok "${candidate}"; then
    # Resolve to the real interpreter (not a pyenv shim) for the venv.
    "${candidate}" -c 'import sys; print(sys.executable)'
    exit 0
  fi
}

if [[ -n "${KD_PYTHON:-}" ]]; then
  # An explicit choice is never silently replaced by another interpreter.
  try "${KD_PYTHON}" "\$KD_PYTHON=${KD_PYTHON}"
  echo "error: KD_PYTHON=${KD_PYTHON} is not a runnable Python >= ${MIN_MAJOR}.${MIN_MINOR}" \
    "($("${KD_PYTHON}" --version 2>&1 || true)). Unset it to search PATH and pyenv." >&2
  exit 1
fi
for name in python3.12 python3.13; do
  try "$(command -v "${name}" 2>/dev/null)" "${name} on PATH"
done
pyenv_root=""
if command -v pyenv >/dev/null 2>&1; then
  pyenv_root="$(pyenv root 2>/dev/null)"
elif [[ -d "${PYENV_ROOT:-${HOME}/.pyenv}/versions" ]]; then
  pyenv_root="${PYENV_ROOT:-${HOME}/.pyenv}"  # installed, not on PATH
fi
if [[ -n "${pyenv_root}" ]]; then
  # 3.12 first (constraints.txt was resolved and tested on it), then newer.
  for py in $( { ls -d "${pyenv_root}"/versions/3.12*/bin/python3 2>/dev/null | sort -rV;
                 ls -d "${pyenv_root}"/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -V; } ); do
    try "${py}" "${py}"
  done
  looked+=("${pyenv_root}/versions/3.1[2-9]*/bin/python3")
else
  looked+=("\$(pyenv root)/versions/3.1[2-9]*/bin/python3 (pyenv not found)")
fi
try "$(command -v python3 2>/dev/null)" "python3 on PATH ($(python3 --version 2>&1 || echo 'not found'))"

{
  echo "error: no Python >= ${MIN_MAJOR}.${MIN_MINOR} found (kauldron >= 1.4.3 and gemma 4 need it)."
  echo "Looked at:"
  for l in "${looked[@]}"; do echo "  - ${l}"; done
  echo "Install Python 3.12+ (e.g. 'pyenv install 3.12') or set KD_PYTHON=/path/to/python3.12."
} >&2
exit 1
