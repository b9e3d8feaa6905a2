#!/usr/bin/env bash
# Install bcg-serve for development into ./.venv (created if absent).
#
# torch is installed first and pinned: `pip install torch==2.13.0` takes the CPU wheel that lies on this
# machine's disk, whereas an unpinned torch (as pyproject.toml states it, so that GPU hosts can bring
# their own CUDA build) would pull a multi-GB CUDA build. Then the project itself, editable, with its
# test extras. Safe to run again: each step is skipped when already done.
#
# Environment: PYTHON (interpreter that creates the venv, default python3, needs >= 3.10),
#              BCG_FORCE_INSTALL=1 to reinstall the project even when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3}
VENV=.venv
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    echo "install: creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

installed_torch=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
if [ "${installed_torch%%+*}" = "$TORCH_VERSION" ]; then
    echo "install: torch $installed_torch already installed"
else
    echo "install: installing torch==$TORCH_VERSION"
    "$PY" -m pip install "torch==$TORCH_VERSION"
fi

# The project: skipped when pyproject.toml is unchanged since the last install from this checkout and
# every package with an __init__.py imports from here as a regular package (an editable install made
# before a package had its __init__.py maps it as a namespace package, which breaks its data files).
stamp="$VENV/.bcg-serve-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $PWD"
packages_ok() {
    local pkg
    for pkg in bcg_core deployments router; do
        [ -f "$pkg/__init__.py" ] || continue
        (cd / && "$OLDPWD/$PY" -c 'import importlib.util as u, sys
s = u.find_spec(sys.argv[1])
sys.exit(0 if s is not None and s.origin == sys.argv[2] else 1)' "$pkg" "$OLDPWD/$pkg/__init__.py") || return 1
    done
}
if [ "${BCG_FORCE_INSTALL:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && [ -x "$VENV/bin/bcg" ] && packages_ok; then
    echo "install: bcg-serve already installed (pyproject.toml unchanged); BCG_FORCE_INSTALL=1 reinstalls"
else
    echo "install: installing bcg-serve (editable) with test extras"
    "$PY" -m pip install -e '.[test]'
    echo "$want" > "$stamp"
fi
echo "install: done; try: $VENV/bin/bcg demo"
