#!/usr/bin/env bash
# One run on a machine with a real NVIDIA GPU (see tests/device/README.md), from the repository root:
#   OUT=DIR bash tests/device/card_check.sh
# 1. captures the card's nvidia-smi outputs in the layout of shared/captures (idle, then under a torch load),
# 2. runs the gpu_health module on both backends (NVML, nvidia-smi) in each state and compares the two,
# 3. runs the simulator's fidelity test against those captures.
# Every step is bounded (and the whole run by CARD_DEADLINE_S); summary.json is written whatever fails.
# Writes only files directly under OUT: summary.json, health.json, fidelity.txt, captures.tar.gz, card_check.log.
set -u
export LC_ALL=C LANG=C # how our modules run nvidia-smi
REPO=$(pwd)
OUT=${OUT:?set OUT to the folder for the results}
WORK=${CARD_WORK:-/tmp/card_check}
DEADLINE=$((SECONDS + ${CARD_DEADLINE_S:-230}))
WHEELS=$REPO/.device/wheels         # carried: pip download output for cp38..cp313 (README.md)
SHARED=$REPO/.device/shared-captures # carried: a copy of shared/captures, which the fidelity test also needs
HERE=$REPO/tests/device
LOG=$OUT/card_check.log
STEPS=$WORK/steps.tsv
CAP=$WORK/captures
rm -rf "$WORK" && mkdir -p "$WORK/coll/ansible_collections/remote_gpu" "$CAP" "$OUT" || exit 1
: >"$LOG" && : >"$STEPS"
# The repository imports as ansible_collections.remote_gpu.trainer, as the tests see it.
ln -s "$REPO" "$WORK/coll/ansible_collections/remote_gpu/trainer"
export PYTHONPATH=$WORK/coll

step() { # step NAME LIMIT CMD...: run CMD bounded by LIMIT s and the deadline; stdout to $STEP_TO or the log
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS)) start=$SECONDS rc=125
  shift 2
  ((left < limit)) && limit=$left
  if ((limit > 0)); then
    printf '\n=== %s (at most %ss): %s\n' "$name" "$limit" "$*" >>"$LOG"
    timeout -k 5 "$limit" "$@" >>"${STEP_TO:-$LOG}" 2>>"$LOG"
    rc=$?
  else
    printf '\n=== %s: skipped, past the deadline\n' "$name" >>"$LOG"
  fi
  printf '%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - start)) >>"$STEPS"
  return "$rc"
}

cap() { # cap KIND STEM ARGS...: one capture of `nvidia-smi ARGS`, its exact command beside it in STEM.cmd
  local file=$CAP/$1/$2
  shift 2
  mkdir -p "${file%/*}" && printf 'nvidia-smi %s\n' "$*" >"$file.cmd" && : >"$file.txt"
  STEP_TO=$file.txt step "${file#"$CAP"/}.txt" 60 nvidia-smi "$@"
}

# --- Python: a venv with the carried wheels; else pip --target; else the wheels unpacked; else python3 as it is.
PY=$(command -v python3 || true)
VPY=$PY
if [ -n "$PY" ]; then
  export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS=$WHEELS PIP_DISABLE_PIP_VERSION_CHECK=1
  unset PIP_CONSTRAINT
  PKGS=(nvidia-ml-py psutil pytest PyYAML)
  # ansible-core only for AnsibleModule (module_utils/basic.py runs on 3.8+): no deps, any Python.
  CORE=(--no-deps --ignore-requires-python ansible-core)
  if step venv 60 "$PY" -m venv "$WORK/venv" && step pip-venv 90 "$WORK/venv/bin/python" -m pip install -q "${PKGS[@]}" &&
    step pip-core 60 "$WORK/venv/bin/python" -m pip install -q "${CORE[@]}"; then
    VPY=$WORK/venv/bin/python INSTALL=venv
  elif step pip-target 90 "$PY" -m pip install -q --target "$WORK/site" "${PKGS[@]}" &&
    step pip-target-core 60 "$PY" -m pip install -q --target "$WORK/site" "${CORE[@]}"; then
    INSTALL=target
  elif step unzip-wheels 60 "$PY" "$HERE/card_health.py" unpack "$WHEELS" "$WORK/site"; then
    INSTALL=unzipped
  else
    INSTALL=none
  fi
  [ "$INSTALL" = venv ] || PYTHONPATH=$WORK/site:$PYTHONPATH
  echo "python: $PY -> $VPY (install: $INSTALL)" >>"$LOG"
fi
export INSTALL VPY

# --- Captures, named like shared/captures: <source>__<os>-<arch>__<model slug>__<driver>__<state>.txt
DRIVER=$(timeout 30 nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>>"$LOG" | head -n 1)
MODEL=$(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>>"$LOG" | head -n 1)
SLUG=$(printf '%s' "${MODEL:-unknown-gpu}" | tr '[:upper:]' '[:lower:]' | sed -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//')
KEY=rgtdev__linux-$(uname -m)__${SLUG}__${DRIVER:-unknown}
export KEY
# The fields our nvidia-smi backend asks for, from the code itself.
OUR_FIELDS=$("$VPY" -c 'from ansible_collections.remote_gpu.trainer.plugins.module_utils.gpu import _smi_parse as p
print(",".join(p.SAMPLE_FIELDS), ",".join(p.APPS_FIELDS))' 2>>"$LOG")
read -r SAMPLE APPS <<<"$OUR_FIELDS"
NGE_APPS=timestamp,gpu_name,gpu_bus_id,gpu_serial,gpu_uuid,pid,process_name,used_gpu_memory
cap help "$KEY" --help-query-gpu
cap help "$KEY"__compute-apps --help-query-compute-apps
# Every field this driver offers (a quoted name opening a paragraph of --help-query-gpu), as the shared captures did.
ALL_FIELDS=$(awk 'prev == "" && /^"/ { split($0, part, "\""); print part[2] } { prev = $0 }' "$CAP/help/$KEY.txt" |
  paste -sd, -)
cap list_L "$KEY" -L
mkdir -p "$CAP/kmsg" && STEP_TO=$CAP/kmsg/$KEY.log step kmsg/"$KEY".log 30 dmesg --time-format=iso

capture_state() { # capture_state STATE: the outputs that change with load
  local stem=${KEY}__$1
  cap smi_table "$stem"
  cap q_full "$stem" -q
  cap query_csv "$stem" --query-gpu="${ALL_FIELDS:-driver_version,$SAMPLE}" --format=csv
  cap query_csv "$stem"__ours --query-gpu="$SAMPLE" --format=csv
  cap query_csv "$stem"__ours-noheader-nounits --query-gpu="$SAMPLE" --format=csv,noheader,nounits
  cap compute_apps "$stem" --query-compute-apps="$NGE_APPS" --format=csv
  cap compute_apps "$stem"__ours-noheader-nounits --query-compute-apps="$APPS" --format=csv,noheader,nounits
  cap nvlink "$stem" nvlink -s
  cap dmon "$stem" dmon -c 5
  step health-"$1" 90 "$VPY" "$HERE/card_health.py" health "$1" "$WORK/health-$1.json"
}

capture_state idle
# Load: torch keeps the GPU busy (matrix products on a few GiB) so processes, clocks and power show.
rm -f "$WORK/load.ready"
timeout -k 5 150 "${PY:-python3}" "$HERE/gpu_load.py" "$WORK/load.ready" >>"$LOG" 2>&1 &
LOAD_PID=$!
# shellcheck disable=SC2016 # $1 and $2 belong to the inner shell
step load-ready 60 sh -c 'while [ ! -e "$1" ] && kill -0 "$2"; do sleep 1; done; [ -e "$1" ]' - "$WORK/load.ready" "$LOAD_PID" &&
  capture_state load
kill "$LOAD_PID" 2>/dev/null
wait "$LOAD_PID" 2>/dev/null
echo "load exit: $?" >>"$LOG"
LOAD_NOTE="tests/device/gpu_load.py: bf16 8192x8192 matrix products with 4 GiB held (torch)"
[ -e "$WORK/load.ready" ] || LOAD_NOTE="not captured: the load did not start (card_check.log)"
cat >"$CAP/README.md" <<EOF
# nvidia-smi outputs of one real card, captured by tests/device/card_check.sh (nothing masked or edited)
collected_at: $(date -u +%Y-%m-%dT%H:%M:%SZ); model: ${MODEL:-?}; driver: ${DRIVER:-?}; kernel: $(uname -r)
$(grep -m 1 '^PRETTY_NAME=' /etc/os-release 2>/dev/null)
States: idle (nothing running on the GPU); load: $LOAD_NOTE.
Layout as in shared/captures: KIND/${KEY}[__STATE].txt, each command in the .cmd file beside it.
Names with __ours* hold the queries our nvidia-smi backend runs; help/ and nvlink/ are kinds shared/captures lacks.
EOF
tar -czf "$OUT/captures.tar.gz" -C "$WORK" captures 2>>"$LOG"

# --- Fidelity test against the real captures, beside the shared ones it also needs (see card_health.py alias).
step merge-captures 30 "$VPY" "$HERE/card_health.py" alias "$CAP" "$SHARED" "$WORK/merged" "$STEPS"
STEP_TO=$OUT/fidelity.txt RGT_CAPTURES=$WORK/merged step fidelity 120 "$VPY" -m pytest -p no:cacheprovider -q -rA \
  tests/fakegpu/tests/test_fakegpu_fidelity.py

# --- Summary, always: without Python, a minimal one.
"$VPY" "$HERE/card_health.py" summary "$WORK" "$OUT" >>"$LOG" 2>&1 ||
  "${PY:-false}" "$HERE/card_health.py" summary "$WORK" "$OUT" >>"$LOG" 2>&1 ||
  printf '{"error": "no python could write the summary", "steps_tsv": "%s"}\n' "$(tr '\t\n' ' ;' <"$STEPS")" \
    >"$OUT/summary.json"
echo "done in ${SECONDS}s" >>"$LOG"
