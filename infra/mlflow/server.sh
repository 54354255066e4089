#!/usr/bin/env bash
# Run the MLflow tracking server that every vitscale job logs to (MLFLOW_TRACKING_URI).
#
#   infra/mlflow/server.sh local [--port 5000] [--dry-run]
#       The store the jobs write by default (sqlite under $VITSCALE_HOME, else ./mlruns),
#       served on 127.0.0.1 only. Jobs may keep writing to the sqlite file or point at
#       MLFLOW_TRACKING_URI=http://127.0.0.1:5000.
#
#   infra/mlflow/server.sh remote [--dry-run]
#       A shared server: Postgres for runs, an object store for artifacts, every value from
#       the environment (the container in docker-compose.yml and k8s.yaml runs this):
#         MLFLOW_BACKEND_STORE_URI   postgresql://user:pass@host:5432/db, or give the parts:
#         MLFLOW_DB_HOST MLFLOW_DB_PORT(5432) MLFLOW_DB_NAME MLFLOW_DB_USER MLFLOW_DB_PASSWORD
#         MLFLOW_ARTIFACTS_DESTINATION   s3://bucket/prefix (gs://... needs google-cloud-storage)
#         AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY, MLFLOW_S3_ENDPOINT_URL for MinIO/non-AWS
#         MLFLOW_HOST (127.0.0.1; 0.0.0.0 only inside a container behind a Service)
#         MLFLOW_PORT (5000)  MLFLOW_WORKERS (4)
#         MLFLOW_SERVER_ALLOWED_HOSTS   Host headers to accept besides localhost and private
#                                       IPs, e.g. mlflow.vitscale.svc:5000 (read by mlflow)
#
#   Either mode: MLFLOW_SERVER_ENABLE_JOB_EXECUTION defaults to false here. It runs MLflow's
#   GenAI jobs (scorers, judges, evaluations), which vitscale never submits; on, it starts a
#   job runner and seven queue consumers, about 1.1 GB of memory, and leaves their queue
#   folder in /dev/shm after every stop. Set it to true to have them.
#
#   Either mode: MLFLOW_AUTH=basic turns on MLflow basic auth (needs mlflow[auth]), with
#   MLFLOW_AUTH_ADMIN_PASSWORD (first start creates the admin user; MLFLOW_AUTH_ADMIN_USERNAME,
#   default admin) and MLFLOW_FLASK_SERVER_SECRET_KEY (shared by all workers). Clients then set
#   MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD.
set -euo pipefail

die() { echo "server.sh: $*" >&2; exit 2; }
usage() { sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

mode="${1:-}"
[[ -n "$mode" ]] || usage 2
shift
dry_run=0
port="${MLFLOW_PORT:-5000}"
while (($#)); do
  case "$1" in
    --port) [[ $# -ge 2 ]] || die "--port needs a value"; port="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage 0 ;;
    *) die "unknown argument '$1'; see infra/mlflow/server.sh --help" ;;
  esac
done
[[ "$port" =~ ^[0-9]+$ ]] || die "--port/MLFLOW_PORT must be a number, got '$port'"

mlflow_bin="${MLFLOW_BIN:-mlflow}"
args=()
auth_db=""
conf_dir=""

case "$mode" in
  local)
    # The same layout as common/tracking.py's default store, so runs already logged by
    # `make demo` or a job without MLFLOW_TRACKING_URI show up.
    home_dir="$(python3 -c 'import os, sys; print(os.path.abspath(sys.argv[1]))' "${VITSCALE_HOME:-mlruns}")"
    ((dry_run)) || mkdir -p "$home_dir/artifacts"
    host="127.0.0.1"
    args=(--backend-store-uri "sqlite:///$home_dir/mlflow.db"
          --artifacts-destination "$home_dir/artifacts"
          --host "$host" --port "$port" --workers "${MLFLOW_WORKERS:-1}")
    auth_db="sqlite:///$home_dir/basic_auth.db"
    ;;
  remote)
    backend="${MLFLOW_BACKEND_STORE_URI:-}"
    if [[ -z "$backend" ]]; then
      for v in MLFLOW_DB_HOST MLFLOW_DB_NAME MLFLOW_DB_USER MLFLOW_DB_PASSWORD; do
        [[ -n "${!v:-}" ]] || die "remote mode needs MLFLOW_BACKEND_STORE_URI or $v (and the other MLFLOW_DB_* parts)"
      done
      # The password may hold URL-reserved characters (@ : /); quote it for the URI.
      pw="$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$MLFLOW_DB_PASSWORD")"
      backend="postgresql://${MLFLOW_DB_USER}:${pw}@${MLFLOW_DB_HOST}:${MLFLOW_DB_PORT:-5432}/${MLFLOW_DB_NAME}"
    fi
    # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which neither the image nor the
    # dev extra installs; name the driver they do install (psycopg2-binary). A URI that names
    # its own driver (postgresql+psycopg://) is kept.
    backend="$(sed -E 's#^postgres(ql)?://#postgresql+psycopg2://#' <<<"$backend")"
    dest="${MLFLOW_ARTIFACTS_DESTINATION:-}"
    [[ -n "$dest" ]] || die "remote mode needs MLFLOW_ARTIFACTS_DESTINATION (e.g. s3://my-bucket/mlflow)"
    if [[ "$dest" == s3://* && -z "${AWS_ACCESS_KEY_ID:-}" && -z "${AWS_ROLE_ARN:-}" && -z "${AWS_PROFILE:-}" ]]; then
      echo "server.sh: warning: no AWS_ACCESS_KEY_ID, AWS_PROFILE or AWS_ROLE_ARN; relying on an instance role for $dest" >&2
    fi
    host="${MLFLOW_HOST:-127.0.0.1}"
    # Artifacts go through the server (mlflow-artifacts:/), so training pods need no bucket
    # credentials, only the tracking URI.
    args=(--backend-store-uri "$backend"
          --artifacts-destination "$dest" --serve-artifacts
          --host "$host" --port "$port" --workers "${MLFLOW_WORKERS:-4}")
    auth_db="$backend"
    ;;
  -h|--help) usage 0 ;;
  *) die "unknown mode '$mode'; use 'local' or 'remote'" ;;
esac

if [[ "${MLFLOW_AUTH:-}" == "basic" ]]; then
  [[ -n "${MLFLOW_AUTH_ADMIN_PASSWORD:-}" ]] || die "MLFLOW_AUTH=basic needs MLFLOW_AUTH_ADMIN_PASSWORD (the admin user is created from it on first start)"
  [[ -n "${MLFLOW_FLASK_SERVER_SECRET_KEY:-}" ]] || die "MLFLOW_AUTH=basic needs MLFLOW_FLASK_SERVER_SECRET_KEY (the same value for every worker and restart)"
  if [[ -z "${MLFLOW_AUTH_CONFIG_PATH:-}" && "$dry_run" == 0 ]]; then
    # The shipped basic_auth.ini keeps users in ./basic_auth.db, which a container loses on
    # restart; keep them next to the runs instead. Its database_uri holds the database
    # password, so it lives in a 0700 folder only while the server runs.
    conf_dir="$(umask 077; mktemp -d)"
    trap 'rm -rf "$conf_dir"' EXIT
    # MLflow reads the file with configparser, where % starts an interpolation: a quoted
    # password (p%40ss) must be written as p%%40ss.
    cat > "$conf_dir/basic_auth.ini" <<INI
[mlflow]
default_permission = READ
database_uri = ${auth_db//%/%%}
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
    export MLFLOW_AUTH_CONFIG_PATH="$conf_dir/basic_auth.ini"
  fi
  args+=(--app-name basic-auth)
fi

export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
cmd=("$mlflow_bin" server "${args[@]}")
if ((dry_run)); then
  # The password in a postgres URI is not printed.
  printf '%q ' "${cmd[@]}" | sed -E 's#(postgresql(\+[a-z0-9]+)?://[^:/]+:)[^@]+@#\1***@#g'
  echo
  exit 0
fi
echo "MLflow tracking server on http://$host:$port (clients: export MLFLOW_TRACKING_URI=http://$host:$port)" >&2
if [[ -z "$conf_dir" ]]; then
  exec "${cmd[@]}"
fi
# Not exec: this shell stays to remove the auth ini when the server ends, and passes a stop
# signal on to it (as PID 1 of a container, too).
"${cmd[@]}" &
server_pid=$!
trap 'kill -TERM "$server_pid" 2>/dev/null || true' TERM INT HUP
status=0
while true; do
  wait "$server_pid" && status=0 || status=$?
  kill -0 "$server_pid" 2>/dev/null || break
done
exit "$status"
