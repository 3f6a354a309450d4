#!/usr/bin/env bash
# Install mtpipe from this checkout. On Linux, first an optimized BLAS from the distribution (MLX's
# CPU wheel otherwise runs every matmul on the reference BLAS it bundles; see models/blas.py).
# Usage: ./install.sh [EXTRAS], e.g. ./install.sh test,train  (PYTHON=python3.12 ./install.sh: another Python)
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-}"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "install.sh: mtpipe needs Python 3.11 or newer; $python is $("$python" --version 2>/dev/null || echo "not there")." >&2
    echo "  Use a newer one, e.g. in a virtualenv: python3.12 -m venv .venv && . .venv/bin/activate && ./install.sh" >&2
    echo "  (or PYTHON=python3.12 ./install.sh)" >&2
    exit 1
fi

have_blas() {
    "$python" - <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("blas", "models/blas.py")
blas = sys.modules["blas"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas)
sys.exit(0 if blas.find_optimized() else 1)
PY
}

if [ "$(uname -s)" = Linux ] && ! have_blas; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if command -v apt-get >/dev/null; then
        $sudo apt-get update -qq && $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null
    elif command -v dnf >/dev/null; then
        $sudo dnf install -y -q openblas-threads
    elif command -v pacman >/dev/null; then
        $sudo pacman -S --noconfirm --needed openblas
    else
        echo "install.sh: no apt-get, dnf or pacman: install OpenBLAS yourself; MLX stays on its slow reference BLAS" >&2
    fi
fi
"$python" -m pip install -q -e ".${extras:+[$extras]}"
