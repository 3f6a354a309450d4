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

# 0: the preferred BLAS (BLIS) is there; 1: another optimized one is; 2: none is
have_blas() {
    "$python" - <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("blas", "models/blas.py")
blas = sys.modules["blas"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(blas)
found = blas.find_optimized()
sys.exit(0 if blas.is_preferred(found) else 1 if found else 2)
PY
}

# BLIS, else OpenBLAS, from the distribution
install_blas() {
    if command -v apt-get >/dev/null; then
        $sudo apt-get update -qq
        $sudo apt-get install -y -qq libblis4-pthread >/dev/null || $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null
    elif command -v dnf >/dev/null; then
        $sudo dnf install -y -q blis-threads || $sudo dnf install -y -q openblas-threads
    elif command -v pacman >/dev/null; then
        $sudo pacman -S --noconfirm --needed blis || $sudo pacman -S --noconfirm --needed openblas
    else
        echo "install.sh: no apt-get, dnf or pacman: install BLIS or OpenBLAS yourself" >&2
        return 1
    fi
}

if [ "$(uname -s)" = Linux ]; then
    status=0; have_blas || status=$?
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if [ "$status" -eq 2 ]; then
        install_blas || echo "install.sh: MLX stays on its slow reference BLAS" >&2
    elif [ "$status" -eq 1 ]; then  # (OpenBLAS works; BLIS decodes faster. Never a password prompt for it.)
        if [ -z "$sudo" ] || sudo -n true 2>/dev/null; then
            [ -z "$sudo" ] || sudo="sudo -n"
            install_blas || true
        else
            echo "install.sh: BLIS decodes faster than the OpenBLAS found here: sudo apt-get install libblis4-pthread" >&2
        fi
    fi
fi
"$python" -m pip install -q -e ".${extras:+[$extras]}"
