#!/usr/bin/env bash
# The README's test command on the other CPython versions the package supports (requires-python >= 3.10), each in
# a virtual environment of its own (.venv-3.X): the client installs into engines' and trainers' environments,
# whatever their Python, and the server runs wherever its operator puts it.
#
#   bash scripts/test_other_pythons.sh            # every version pyproject.toml's classifiers name, but python3's
#   CODA_TEST_PYTHONS="3.13" bash scripts/test_other_pythons.sh
#
# python3's own version is left out (the README's test command ran on it). An interpreter is found as python3.X on
# PATH, or among pyenv's installed versions. A version this machine does not have is named and skipped; a suite
# that fails fails the script (after the other versions have run).
set -uo pipefail
cd "$(dirname "$0")/.."

find_python() {
    local version=$1 candidate
    if candidate=$(command -v "python$version") && "$candidate" -c "" 2>/dev/null; then
        echo "$candidate"  # (a pyenv shim for a version not selected is on PATH but does not run)
        return 0
    fi
    local root=${PYENV_ROOT:-$HOME/.pyenv}
    for candidate in $(ls -d "$root"/versions/"$version".*/bin/python 2>/dev/null | sort -V -r); do
        if "$candidate" -c "" 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

supported=$(grep -o 'Programming Language :: Python :: 3\.[0-9]*' pyproject.toml | sed 's/.*:: //')
tested_already=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
failed=()
for version in ${CODA_TEST_PYTHONS:-$supported}; do
    if [[ -z ${CODA_TEST_PYTHONS:-} && $version == "$tested_already" ]]; then
        continue
    fi
    if ! python=$(find_python "$version"); then
        echo "Python $version: not on this machine (python$version, pyenv); skipped"
        continue
    fi
    echo "Python $version: $python"
    venv=".venv-$version"
    if "$python" -m venv "$venv" && "$venv/bin/pip" install -q -e '.[test]' && "$venv/bin/python" -m pytest; then
        echo "Python $version: passed"
    else
        echo "Python $version: FAILED"
        failed+=("$version")
    fi
done
if ((${#failed[@]})); then
    echo "the suite failed on Python ${failed[*]}"
    exit 1
fi
