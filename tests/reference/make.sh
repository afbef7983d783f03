#!/usr/bin/env bash
# tests/reference/make.sh: regenerates the reference data the tests read
# (tests/reference/data/) from PyPI's PyTorch and friends, at the versions pinned in
# requirements.txt, in a scratch virtual environment.  Not part of the test command: the
# data is committed, and the tests only read it.
#
#   bash tests/reference/make.sh            every reference
#   bash tests/reference/make.sh adamw      only tests/reference/adamw.py (several may be named)
#   bash tests/reference/make.sh model_params   transformers' parameters for the model builders
#
# MOONSHARD_REF_VENV names the virtual environment (default ~/.cache/moonshard-reference-venv);
# it is made, and the pinned packages installed, when missing.  Scripts that run moonshard
# itself (to compare its plans) use build/moonshard: build first (README).  deepseek_v4_units.py
# and pp_schedules.py run NeMo Automodel's own code (DeepSeek-V4's, the pipeline split): its
# source tree on AUTOMODEL_SRC (default
# /tmp/automodel_src; `git -C <Automodel clone> archive HEAD nemo_automodel | tar -x -C ...`).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${MOONSHARD_REF_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/moonshard-reference-venv}"

if [ ! -x "$venv/bin/python" ]; then
    echo "make.sh: creating the virtual environment $venv" >&2
    python3 -m venv "$venv"
fi
# the pinned lines that `pip freeze` does not show yet
missing="$(comm -13 <("$venv/bin/python" -m pip freeze 2>/dev/null | sort) \
                    <(grep -v '^#' "$here/requirements.txt" | grep . | sort))"
if [ -n "$missing" ]; then
    echo "make.sh: installing $here/requirements.txt from PyPI (missing: $(echo $missing))" >&2
    "$venv/bin/python" -m pip install -q -r "$here/requirements.txt"
fi

scripts=("$@")
if [ ${#scripts[@]} -eq 0 ]; then
    for f in "$here"/*.py; do
        b="$(basename "$f" .py)"
        [ "$b" = refdata ] || scripts+=("$b")
    done
fi
mkdir -p "$here/data"
cd "$root"
for s in "${scripts[@]}"; do
    [ -f "$here/$s.py" ] || { echo "make.sh: no script $here/$s.py" >&2; exit 2; }
    echo "make.sh: $s.py" >&2
    start=$SECONDS
    PYTHONPATH="$here" "$venv/bin/python" "$here/$s.py"
    echo "make.sh: $s.py done in $((SECONDS - start)) s" >&2
done
