#!/usr/bin/env bash
# Run jaxprefix on a Cloud TPU VM slice (one host or a pod slice) with gcloud.
#
#   launch/tpu.sh up --project=P --zone=us-east5-b --type=v6e-8 --workdir=gs://B/run1
#   launch/tpu.sh logs ...; launch/tpu.sh watch ...; launch/tpu.sh delete ...
#
# Walk-through: docs/LAUNCH.md. Every flag also reads an environment variable (in brackets);
# a flag wins over the variable. --dry-run prints the gcloud commands and runs none.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/tpu.sh COMMAND [flags] [-- extra jaxprefix.main flags]

commands:
  check    before renting: compile the run for --type on this machine (no TPU needed, minutes)
           and say whether every program fits its HBM; a generation (--type=v6e) finds the
           smallest slice that fits (the compile job: docs/SCALING.md)
  create   create the TPU VM slice (or a queued resource with --queued; wait until ACTIVE)
  setup    copy this checkout (or git clone --repo) to every worker; create a Python 3.11
           virtual environment there (~/jaxprefix-venv, with uv) and pip install -e '.[tpu]'
  run      start `python3 -m jaxprefix.main --config=C --workdir=W` in that environment on all
           workers, detached
  logs     stream worker 0's log
  status   print the slice state (READY, PREEMPTED, ...; queued: ACTIVE, SUSPENDED, ...)
  stop     stop the run on all workers with SIGTERM: it checkpoints and exits; the slice stays
  resume   if the slice was preempted or is gone: delete it, create, setup, run again; if it is
           up but the run died of something a relaunch outlives (a lost host: exit 75, a
           SIGKILL), run again on it; the run resumes from the last checkpoint in --workdir
  watch    resume whenever needed, every --interval seconds, until the run has finished
  up       create + setup + run
  delete   delete the slice (and its queued resource)

flags (environment variable):
  --project=P          GCP project (JAXPREFIX_PROJECT), required
  --zone=Z             zone, e.g. us-east5-b (JAXPREFIX_ZONE), required
  --type=T             accelerator type, e.g. v5litepod-16, v6e-8, v5p-32 (JAXPREFIX_TPU_TYPE;
                       default v6e-8); alias --accelerator-type
  --runtime=R          TPU VM runtime version (JAXPREFIX_RUNTIME; default from the type);
                       alias --runtime-version
  --name=N             slice name (JAXPREFIX_TPU_NAME; default jaxprefix-$USER)
  --spot               spot capacity: cheaper, can be preempted (JAXPREFIX_SPOT=1)
  --queued             request via queued-resources, waits for capacity (JAXPREFIX_QUEUED=1)
  --repo=URL           setup: git clone URL instead of copying this checkout (JAXPREFIX_REPO)
  --ref=REF            setup: branch, tag or commit to check out with --repo (JAXPREFIX_REF)
  --config=C           run: config (JAXPREFIX_CONFIG; default configs/pope.py)
  --workdir=gs://...   run: where checkpoints and metrics go (JAXPREFIX_WORKDIR); must be gs://
                       so that every worker sees it and it survives preemption
  --interval=S         watch: seconds between checks (JAXPREFIX_INTERVAL; default 300)
  --dry-run            print the commands, run nothing
EOF
}

die() { echo "launch/tpu.sh: $*" >&2; exit 2; }

# ---- parameters: flags override environment ------------------------------------------------
command="${1:-}"
[[ -z "$command" || "$command" == -h || "$command" == --help ]] && { usage; exit 0; }
shift
project="${JAXPREFIX_PROJECT:-}"
zone="${JAXPREFIX_ZONE:-}"
tpu_type="${JAXPREFIX_TPU_TYPE:-v6e-8}"
runtime="${JAXPREFIX_RUNTIME:-}"
name="${JAXPREFIX_TPU_NAME:-jaxprefix-${USER:-user}}"
spot="${JAXPREFIX_SPOT:-0}"
queued="${JAXPREFIX_QUEUED:-0}"
repo="${JAXPREFIX_REPO:-}"
ref="${JAXPREFIX_REF:-}"
config="${JAXPREFIX_CONFIG:-configs/pope.py}"
workdir="${JAXPREFIX_WORKDIR:-}"
interval="${JAXPREFIX_INTERVAL:-300}"
dry_run=0
extra=()
while (($#)); do
  case "$1" in
    --project=*) project="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --type=*|--accelerator-type=*) tpu_type="${1#*=}" ;;
    --runtime=*|--runtime-version=*) runtime="${1#*=}" ;;
    --name=*) name="${1#*=}" ;;
    --spot) spot=1 ;;
    --queued) queued=1 ;;
    --repo=*) repo="${1#*=}" ;;
    --ref=*) ref="${1#*=}" ;;
    --config=*) config="${1#*=}" ;;
    --workdir=*) workdir="${1#*=}" ;;
    --interval=*) interval="${1#*=}" ;;
    --dry-run) dry_run=1 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown flag '$1' (flags take the form --name=value; see launch/tpu.sh --help)" ;;
  esac
  shift
done

case "$command" in
  check|create|setup|run|logs|status|stop|resume|watch|up|delete) ;;
  *) die "unknown command '$command'; expected one of check create setup run logs status stop resume watch up delete" ;;
esac
if [[ "$command" == check ]]; then  # runs here, with no cloud project: the TPU compiler only
  main=(python3 -m jaxprefix.main "--config=$config" --config.job=compile
        "--config.compile.topology=$tpu_type" "--workdir=${TMPDIR:-/tmp}/jaxprefix-compile-$tpu_type")
  printf '+'; for arg in "${main[@]}" "${extra[@]}"; do printf ' %q' "$arg"; done; printf '\n'
  ((dry_run)) || exec "${main[@]}" "${extra[@]}"
  exit 0
fi
[[ -n "$project" ]] || die "missing GCP project: pass --project=P or set JAXPREFIX_PROJECT"
[[ -n "$zone" ]] || die "missing zone: pass --zone=Z (e.g. us-east5-b) or set JAXPREFIX_ZONE"
if [[ -z "$runtime" ]]; then
  case "$tpu_type" in  # the runtime images Google documents for each generation
    v5litepod-*|v5e-*) runtime=v2-alpha-tpuv5-lite ;;
    v6e-*) runtime=v2-alpha-tpuv6e ;;
    v5p-*) runtime=v2-alpha-tpuv5 ;;
    v4-*) runtime=tpu-ubuntu2204-base ;;
    *) die "no default runtime for accelerator type '$tpu_type'; pass --runtime=R" ;;
  esac
fi
if [[ "$command" =~ ^(run|resume|watch|up)$ ]]; then
  [[ "$workdir" == gs://* ]] || die "--workdir must be a gs:// path (got '${workdir}'): every worker writes there and it must outlive a preempted slice (set JAXPREFIX_WORKDIR)"
fi
[[ "$interval" =~ ^[0-9]+$ ]] || die "--interval must be whole seconds (got '$interval')"

where=(--zone="$zone" --project="$project")
log_file='~/jaxprefix.log'
status_file='~/jaxprefix.status'  # the run's exit status on each worker, once it has ended
venv='~/jaxprefix-venv'

# ---- gcloud, printed and (unless --dry-run) run --------------------------------------------
quote() {  # a shell word a user can paste: bare when plain, else in single quotes
  if [[ -n "$1" && "$1" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then printf ' %s' "$1"
  else printf " '%s'" "${1//\'/\'\\\'\'}"; fi
}
g() {
  printf '+ gcloud'; for arg in "$@"; do quote "$arg"; done; printf '\n'
  ((dry_run)) || gcloud "$@"
}
ssh_all() { g compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=all --command="$1"; }

slice_state() {  # prints READY / PREEMPTED / ... (queued: ACTIVE / SUSPENDED / ...), MISSING if none
  local state
  if ((queued)); then
    state=$(gcloud compute tpus queued-resources describe "$name" "${where[@]}" \
      --format='value(state.state)' 2>/dev/null) || state=MISSING
  else
    state=$(gcloud compute tpus tpu-vm describe "$name" "${where[@]}" \
      --format='value(state)' 2>/dev/null) || state=MISSING
  fi
  echo "${state:-MISSING}"
}

create() {
  local capacity=()
  ((spot)) && capacity=(--spot)
  if ((queued)); then
    g compute tpus queued-resources create "$name" --node-id="$name" "${where[@]}" \
      --accelerator-type="$tpu_type" --runtime-version="$runtime" "${capacity[@]}"
    ((dry_run)) && return
    local state
    while state=$(slice_state) && [[ "$state" != ACTIVE ]]; do  # queued capacity can take hours
      [[ "$state" =~ ^(FAILED|SUSPENDED|MISSING)$ ]] && die "queued resource $name is $state"
      echo "queued resource $name: $state; checking again in 60 s"
      sleep 60
    done
  else
    g compute tpus tpu-vm create "$name" "${where[@]}" \
      --accelerator-type="$tpu_type" --version="$runtime" "${capacity[@]}"
  fi
}

setup() {
  # jax 0.10.2, flax and orbax need Python >= 3.11, and the TPU VM images this script picks
  # (Ubuntu 22.04: tpu-ubuntu2204-base, v2-alpha-tpuv5-lite, v2-alpha-tpuv6e, v2-alpha-tpuv5)
  # ship python3 3.10. So every worker gets its own environment: uv (from PyPI, into the user's
  # site; --break-system-packages only where an image marks its python3 externally managed)
  # creates it with a CPython 3.11 that uv downloads when the image has none, and installs
  # jaxprefix[tpu] (jax[tpu] with libtpu, gcsfs for gs://) into it. Any image with python3,
  # pip and internet access works the same way.
  local uv='~/.local/bin/uv'
  local install="cd ~/jaxprefix && { python3 -m pip install -q --user uv || python3 -m pip install -q --user --break-system-packages uv; } && rm -rf ${venv} && ${uv} venv -q --python 3.11 ${venv} && ${uv} pip install -q --python ${venv}/bin/python -e \".[tpu]\""
  if [[ -n "$repo" ]]; then
    local checkout=""
    [[ -n "$ref" ]] && checkout=" && git -C ~/jaxprefix checkout -q $(printf %q "$ref")"
    ssh_all "rm -rf ~/jaxprefix && git clone -q $(printf %q "$repo") ~/jaxprefix${checkout} && ${install}"
  else
    # Tracked and untracked-but-not-ignored files: what `git status` calls the working tree.
    local root tarball
    root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel 2>/dev/null) \
      || die "setup copies the git checkout this script is in, and found none; pass --repo=URL"
    tarball="${TMPDIR:-/tmp}/jaxprefix-$$.tar.gz"
    echo "+ (cd $root && git ls-files -co --exclude-standard | tar czf $tarball -T -)"
    ((dry_run)) || (cd "$root" && git ls-files -co --exclude-standard -z | tar czf "$tarball" --null -T -)
    g compute tpus tpu-vm scp "$tarball" "$name:~/jaxprefix.tar.gz" "${where[@]}" --worker=all
    ((dry_run)) || rm -f "$tarball"
    ssh_all "rm -rf ~/jaxprefix && mkdir ~/jaxprefix && tar xzf ~/jaxprefix.tar.gz -C ~/jaxprefix && ${install}"
  fi
}

run() {
  # The same command on every worker: jax.distributed finds the slice from the TPU metadata.
  # Detached (setsid nohup), so a dropped ssh session does not kill the run; `logs` follows it.
  # Its exit status lands in ${status_file}: `resume` and `watch` read it to tell a finished
  # run from one to relaunch.
  local main="${venv}/bin/python3 -m jaxprefix.main --config=$(printf %q "$config") --workdir=$(printf %q "$workdir")"
  ((${#extra[@]})) && main+=$(printf ' %q' "${extra[@]}")
  ssh_all "cd ~/jaxprefix && rm -f ${status_file} && setsid nohup bash -c '${main}; echo \$? > ${status_file}' > ${log_file} 2>&1 < /dev/null &"
}

logs() { g compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=0 --command="tail -n 200 -F ${log_file}"; }

# '[p]ython3' matches the run but not the remote shell whose command line holds the pattern.
# SIGTERM: the run saves a checkpoint and exits, as on preemption.
stop() { ssh_all "pkill -TERM -f '[p]ython3 -m jaxprefix.main' || true"; }

delete() {
  if ((queued)); then
    g compute tpus queued-resources delete "$name" "${where[@]}" --force --quiet
  else
    g compute tpus tpu-vm delete "$name" "${where[@]}" --quiet
  fi
}

run_alive() {  # is the run still going on worker 0?
  gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=0 \
    --command="pgrep -f '[p]ython3 -m jaxprefix.main' > /dev/null" > /dev/null 2>&1
}

run_status() {  # worker 0's run exit status, or 'none' (never ended: killed with its VM)
  gcloud compute tpus tpu-vm ssh "$name" "${where[@]}" --worker=0 \
    --command="cat ${status_file} 2> /dev/null || echo none" 2> /dev/null || echo none
}

# Relaunch on the slice as it is: leftovers of the run killed first, on every worker.
rerun() {
  ssh_all "pkill -KILL -f '[p]ython3 -m jaxprefix.main' || true"
  run
}

# What resume should do, on stdout: alive | ended | rerun | wait | create | recreate (reason on
# stderr). A run that ended with status 0 (finished), 1 or 2 (an error a person must fix) or
# 143 (stopped by SIGTERM: launch/tpu.sh stop) stays ended; any other status (75: a lost host
# or GCS down past its deadline; 137: killed) is relaunched, and resumes.
resume_action() {
  local state status
  if ((dry_run)); then
    echo "+ (dry run: the slice state is not looked up; showing the recovery from preemption)" >&2
    echo recreate; return
  fi
  state=$(slice_state)
  case "$state" in
    READY|ACTIVE)
      if run_alive; then echo "$name is $state and the run is alive" >&2; echo alive; return; fi
      status=$(run_status)
      case "$status" in
        0) echo "$name is $state and the run has finished" >&2; echo ended ;;
        1|2) echo "$name is $state and the run stopped on an error (launch/tpu.sh logs)" >&2
          echo ended ;;
        143) echo "$name is $state and the run was stopped (launch/tpu.sh run resumes it)" >&2
          echo ended ;;
        *) echo "$name is $state and the run died (status $status): relaunching" >&2
          echo rerun ;;
      esac ;;
    MISSING) echo "$name does not exist" >&2; echo create ;;
    CREATING|PROVISIONING|WAITING_FOR_RESOURCES|ACCEPTED|STARTING|RESTARTING)
      echo "$name is $state; wait" >&2; echo wait ;;
    *) echo "$name is $state" >&2; echo recreate ;;
  esac
}

# The run itself resumes from the last checkpoint in --workdir: only the slice is rebuilt.
recover() {
  [[ "$1" == recreate ]] && delete
  create
  setup
  run
}

resume() {
  local action
  action=$(resume_action)
  [[ "$action" =~ ^(create|recreate)$ ]] && recover "$action"
  [[ "$action" == rerun ]] && rerun
  return 0
}

watch() {
  local action
  while :; do
    action=$(resume_action)
    [[ "$action" == ended ]] && break
    [[ "$action" =~ ^(create|recreate)$ ]] && recover "$action"
    [[ "$action" == rerun ]] && rerun
    ((dry_run)) && return
    sleep "$interval"
  done
  echo "the run has ended; delete the slice with: launch/tpu.sh delete"
}

case "$command" in
  up) create; setup; run ;;
  status) if ((dry_run)); then echo "+ (dry run: state not looked up)"; else slice_state; fi ;;
  *) "$command" ;;
esac
