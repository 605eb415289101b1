# Sourced by the H200 session scripts: work folder, this tree on PYTHONPATH, carried wheels, a time budget.
#   W (work folder, default /root/w), OUT (what comes back, default out), BUDGET (seconds, default
#   $DEFAULT_BUDGET or 540). Defines left (seconds left of BUDGET) and part NAME (a progress line).
W=${W:-/root/w}; OUT=${OUT:-out}; mkdir -p "$W" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels missing on the machine (liger-kernel)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
T0=$SECONDS
left() { echo $(( ${BUDGET:-${DEFAULT_BUDGET:-540}} - (SECONDS - T0) )); }
part() { echo "=== $1 ($(( SECONDS - T0 )) s so far, $(left) s left)"; }
