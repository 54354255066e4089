#!/usr/bin/env bash
# A Ray head on this machine, bound to 127.0.0.1 with token auth, for `ray job submit`.
#
#   infra/ray/local-cluster.sh start [--temp-dir DIR] [--num-cpus N] [--num-gpus N]
#                                    [--port 6379] [--dashboard-port 8265] [--agent-port PORT]
#   infra/ray/local-cluster.sh stop  [--temp-dir DIR]
#   infra/ray/local-cluster.sh token
#
# start prints the exact `ray job submit` line for this cluster. stop ends only the processes
# this script started (their process group, recorded in DIR), never other Ray instances the
# way `ray stop` would. token makes sure the auth token exists (~/.ray/auth_token, or
# RAY_AUTH_TOKEN_PATH) readable by its owner only, and prints its path; start does the same. DIR defaults to /tmp/ray-vitscale-$USER; keep it short, Ray's socket
# paths under it must fit in 107 characters.
set -euo pipefail

die() { echo "local-cluster.sh: $*" >&2; exit 2; }
usage() { sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

action="${1:-}"
[[ "$action" == start || "$action" == stop || "$action" == token ]] || { [[ "$action" == -h || "$action" == --help ]] && usage 0; usage 2; }
shift

temp_dir="/tmp/ray-vitscale-${USER:-$(id -un)}"
num_cpus="$(getconf _NPROCESSORS_ONLN)"
num_gpus=0
port=6379
dash_port=8265
agent_port=""
while (($#)); do
  [[ $# -ge 2 ]] || die "$1 needs a value"
  case "$1" in
    --temp-dir) temp_dir="$2" ;;
    --num-cpus) num_cpus="$2" ;;
    --num-gpus) num_gpus="$2" ;;
    --port) port="$2" ;;
    --dashboard-port) dash_port="$2" ;;
    --agent-port) agent_port="$2" ;;
    *) die "unknown option '$1'; see infra/ray/local-cluster.sh --help" ;;
  esac
  shift 2
done
# Ray's job agent listens on 52365 unless told otherwise: a second head on the machine (another
# user's, or a test's) then has no agent, and every submission to it fails. Default to a free port.
[[ -n "$agent_port" ]] || agent_port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
for v in num_cpus num_gpus port dash_port agent_port; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "--${v//_/-} must be a whole number, got '${!v}'"
done
temp_dir="$(python3 -c 'import os, sys; print(os.path.abspath(sys.argv[1]))' "$temp_dir")"
pid_file="$temp_dir/local-cluster.pid"
log_file="$temp_dir/local-cluster.log"

if [[ "$action" == stop ]]; then
  [[ -f "$pid_file" ]] || die "no cluster started from $temp_dir ($pid_file missing); pass the --temp-dir used with start"
  pgid="$(cat "$pid_file")"
  if kill -0 -- "-$pgid" 2>/dev/null; then
    # GCS, raylet and dashboard shut down on TERM; the `ray start --block` leader itself can
    # linger after they are gone, so it gets KILL once nothing else in the session is alive.
    kill -TERM -- "-$pgid"
    for _ in $(seq 15); do
      live="$(ps -s "$pgid" -o pid=,stat= | awk -v leader="$pgid" '$1 != leader && $2 !~ /^Z/' | wc -l)"
      ((live == 0)) && break
      sleep 1
    done
    kill -KILL -- "-$pgid" 2>/dev/null || true
  fi
  rm -f "$pid_file"
  echo "stopped the Ray head started from $temp_dir"
  exit 0
fi

# A submitted job runs `python ...` from the PATH the head was started with, so the head must
# start with the project's environment first on PATH: the active venv, else the repo's .venv.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -n "${VIRTUAL_ENV:-}" ]]; then
  env_bin="$VIRTUAL_ENV/bin"
elif [[ -x "$repo/.venv/bin/python" ]]; then
  env_bin="$repo/.venv/bin"
else
  die "no project environment: activate the venv (source .venv/bin/activate, created by 'make test') and run again"
fi
export PATH="$env_bin:$PATH"
if [[ "$action" != token ]]; then
  "$env_bin/python" -c 'import pyarrow, torch, ray.train, ray.dashboard' 2>/dev/null \
    || die "$env_bin/python lacks the project's dependencies (pyarrow, torch, ray[default]); activate the project's venv ('make test' creates .venv) and run again"
fi
ray_bin="${RAY_BIN:-$env_bin/ray}"
[[ -x "$ray_bin" ]] || die "no ray CLI at $ray_bin; install ray[default] into $env_bin/.. or activate the project's venv"

# Ray writes the token with the process umask (0644 by default): anyone on the machine who can
# read it can submit jobs, i.e. run code as this user. Create it under umask 077 and tighten
# a token (and its folder) that an earlier run left readable.
ensure_token() {
  local token="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
  if [[ ! -e "$token" ]]; then
    (umask 077; [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]] || mkdir -p "$HOME/.ray"
     RAY_AUTH_MODE=token "$ray_bin" get-auth-token --generate >/dev/null 2>&1) \
      || die "could not create $token with '$ray_bin get-auth-token --generate'"
  fi
  [[ -f "$token" ]] || die "$token is missing or not a file; remove it and run again to generate a token"
  chmod 600 "$token" || die "could not make $token readable by its owner only (chmod 600 $token)"
  [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]] || chmod go-rwx "$HOME/.ray" 2>/dev/null || true
  echo "$token"
}
if [[ "$action" == token ]]; then
  ensure_token
  exit 0
fi

if [[ -f "$pid_file" ]] && kill -0 -- "-$(cat "$pid_file")" 2>/dev/null; then
  die "a head started from $temp_dir is already running; run: $0 stop --temp-dir $temp_dir"
fi
mkdir -p "$temp_dir"

# `ray start` turns token auth on only when asked or when a token exists; ask, and make sure
# the token exists so the head and every client share it.
export RAY_AUTH_MODE=token
ensure_token >/dev/null

# --block keeps ray start in the foreground of its own session, so the whole cluster is one
# process group that stop can end without touching other Ray instances. Ray 2.60 swaps
# --node-ip-address=127.0.0.1 for the external address unless multi-node support is off
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); with it off, GCS, raylet and agents stay on loopback.
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 setsid "$ray_bin" start --head --block \
  --node-ip-address=127.0.0.1 --port="$port" \
  --dashboard-host=127.0.0.1 --dashboard-port="$dash_port" --include-dashboard=true \
  --dashboard-agent-listen-port="$agent_port" \
  --num-cpus="$num_cpus" --num-gpus="$num_gpus" \
  --temp-dir="$temp_dir" --disable-usage-stats >"$log_file" 2>&1 &
echo $! >"$pid_file"

address="http://127.0.0.1:$dash_port"
# Any HTTP answer means the dashboard is up: without the token it answers 401.
dashboard_up() {
  python3 - "$address" 2>/dev/null <<'PY'
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/api/version", timeout=2)
except urllib.error.HTTPError:
    pass
PY
}
up=0
for _ in $(seq 120); do
  if dashboard_up; then up=1; break; fi
  kill -0 "$(cat "$pid_file")" 2>/dev/null || { tail -n 30 "$log_file" >&2; rm -f "$pid_file"; die "ray start exited; log: $log_file"; }
  sleep 1
done
((up)) || die "the dashboard did not answer on $address within 120 s; log: $log_file (stop with: $0 stop --temp-dir $temp_dir)"

# The dashboard answers before the head's job agent has registered, and a submission then fails
# with "No available agent to submit job". Wait until one is accepted: a no-op job, deleted again.
agent_ready() {
  "$env_bin/python" - "$address" <<'PY'
import sys, time
from ray.job_submission import JobStatus, JobSubmissionClient

PROBE = "local-cluster-probe-"
DONE = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED)
deadline, last, n = time.monotonic() + 120, "", 0
while time.monotonic() < deadline:
    n += 1
    try:
        client = JobSubmissionClient(sys.argv[1])
        job = client.submit_job(entrypoint="true", submission_id=f"{PROBE}{n}",
                                metadata={"vitscale": "local-cluster.sh readiness probe"})
    except Exception as exc:  # noqa: BLE001 - 500 "No available agent" until the agent is up
        last = str(exc).splitlines()[0] if str(exc) else repr(exc)
        time.sleep(1)
        continue
    while client.get_job_status(job) not in DONE:
        if time.monotonic() > deadline + 60:
            print(f"the probe job {job} did not finish", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.5)
    # Deleted until none comes back: an attempt the head half-accepted before its agent was up is
    # listed as FAILED, and a probe deleted before its supervisor actor exits reappears as FAILED.
    quiet, end = 0, time.monotonic() + 30
    while quiet < 3 and time.monotonic() < end:
        probes = [d for d in client.list_jobs() if (d.submission_id or "").startswith(PROBE)]
        for d in probes:
            if d.status in DONE:
                client.delete_job(d.submission_id)
        quiet = 0 if probes else quiet + 1
        time.sleep(1)
    sys.exit(0)
print(last, file=sys.stderr)
sys.exit(1)
PY
}
agent_ready 2>"$temp_dir/agent-probe.err" \
  || die "the job agent did not accept a submission within 120 s ($(tail -n 1 "$temp_dir/agent-probe.err")); log: $log_file (stop with: $0 stop --temp-dir $temp_dir)"
rm -f "$temp_dir/agent-probe.err"

# Leave CPUs free for Ray Data: training workers that reserve every CPU stall its tasks.
if ((num_gpus > 0)); then
  workers=$num_gpus; per_worker=$(( (num_cpus - 1) / (2 * num_gpus) )); ((per_worker >= 1)) || per_worker=1
  gpu_flag=" --use-gpu"
else
  workers=$(( num_cpus / 2 )); ((workers >= 1)) || workers=1; per_worker=1; gpu_flag=""
fi
tracking="${MLFLOW_TRACKING_URI:-}"
if [[ -n "$tracking" ]]; then
  runtime_env="{\"env_vars\": {\"MLFLOW_TRACKING_URI\": \"$tracking\"}}"
else
  # The job runs in a copy of the working dir: pin the MLflow store to an absolute path or
  # its runs land in that throwaway copy.
  runtime_env="{\"env_vars\": {\"VITSCALE_HOME\": \"${VITSCALE_HOME:-$repo/mlruns}\"}}"
fi

cat <<MSG
Ray head up: GCS 127.0.0.1:$port, dashboard $address, temp dir $temp_dir (log: $log_file)
Workers run python from $env_bin. Submit from the repository root ($repo); --data must be
absolute, and a relative --output lands under VITSCALE_HOME (the job runs in a throwaway copy):

  RAY_AUTH_MODE=token $ray_bin job submit --address $address --working-dir . --runtime-env-json '$runtime_env' -- python jobs/pretrain.py --data /ABS/PATH/shards --output /ABS/PATH/pretrain_output --variant Ti/16 --img-size 224 --num-workers $workers --cpus-per-worker $per_worker$gpu_flag

Stop it with: $0 stop --temp-dir $temp_dir
MSG
