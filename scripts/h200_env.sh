# Sourced by the H200 session scripts: work folder, this tree on PYTHONPATH, carried wheels, a time budget.
#   W (work folder, default /root/w), OUT (what comes back, default out), BUDGET (seconds, default
#   $DEFAULT_BUDGET or 540). Defines left (seconds left of BUDGET), part NAME (a progress line), limit
#   RESERVE, record_machine and require_part.
W=${W:-/root/w}; OUT=${OUT:-out}; mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels missing on the machine (liger-kernel)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
T0=$SECONDS
left() { echo $(( ${BUDGET:-${DEFAULT_BUDGET:-540}} - (SECONDS - T0) )); }
part() { echo "=== $1 ($(( SECONDS - T0 )) s so far, $(left) s left)"; }
# limit RESERVE: seconds for the next step, keeping RESERVE for what follows; 0 if under 30 s would remain.
limit() { local t=$(( $(left) - $1 )); if [ "$t" -lt 30 ]; then echo 0; else echo "$t"; fi; }
# record_machine: the GPU, host memory, library versions and the tree's commit, under $W.
record_machine() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$W/gpu.txt"
  free -b > "$W/free.txt"; head -2 "$W/free.txt"
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee "$W/versions.txt"
  git rev-parse HEAD > "$W/git.txt" 2>/dev/null; git status --porcelain >> "$W/git.txt" 2>/dev/null
}
# require_part A B ...: $PART must be one of them (the session scripts run one part per device call).
require_part() {
  local p
  for p in "$@"; do if [ "${PART:-}" = "$p" ]; then return; fi; done
  echo "usage: PART=$(IFS='|'; echo "$*") bash $0" >&2; exit 2
}
