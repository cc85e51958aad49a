#!/usr/bin/env bash
# A local PostgreSQL server for xc-dagster: Dagster's instance storage and MLflow's tracking/registry store.
#
#   deploy/postgres.sh start [DIR] [--port N]   initdb DIR/data once, start the server on 127.0.0.1, create the
#                                               databases and users once, print the URLs (idempotent)
#   deploy/postgres.sh stop  [DIR]              stop it (nothing to do when it is not running)
#   deploy/postgres.sh url   [DIR]              print the URLs of a folder made by `start`
#
# DIR: the argument, else $XC_POSTGRES_DIR, else $XC_HOME/postgres (XC_HOME default ~/.xc-dagster). The port: --port,
# else $XC_POSTGRES_PORT, else the one chosen on the first start (a free one from 5432 up), kept in DIR/server.env.
# `start` and `url` print shell exports on stdout, so `eval "$(deploy/postgres.sh start)"` points this shell at it:
#   export XC_DAGSTER_POSTGRES_URL=postgresql+psycopg2://dagster:<password>@127.0.0.1:<port>/dagster
#   export MLFLOW_TRACKING_URI=postgresql+psycopg2://mlflow:<password>@127.0.0.1:<port>/mlflow
# Two databases, each owned by its own user (docs in deploy/README.md#postgres). Passwords are random, made on the
# first start, kept in DIR/server.env (mode 600). Run as root, the server runs as the `postgres` system user (Postgres
# refuses root): DIR and its parents must then be reachable by that user (e.g. not under /root).
# Exit status: 0 done, 2 usage or folder error, 3 the server could not be started (binaries missing, no `postgres`
# user, port taken: the reason and the server log's tail on stderr).
set -euo pipefail

die() { echo "postgres.sh: $1" >&2; exit "${2:-2}"; }
say() { echo "postgres.sh: $1" >&2; }

cmd="${1:-}"
[[ "$cmd" =~ ^(start|stop|url)$ ]] || die "usage: postgres.sh start|stop|url [DIR] [--port N]"
shift
dir="" port="${XC_POSTGRES_PORT:-}"
while (($#)); do
    case "$1" in
        --port) [[ "${2:-}" =~ ^[0-9]+$ ]] && ((${2} >= 1 && ${2} <= 65535)) \
                    || die "--port: expected a port number 1-65535, got '${2:-}'"
                port="$2"; shift 2 ;;
        -*) die "unknown option '$1' (usage: postgres.sh start|stop|url [DIR] [--port N])" ;;
        *) [[ -z "$dir" ]] || die "one folder only, got '$dir' and '$1'"; dir="$1"; shift ;;
    esac
done
[[ -z "$port" || "$port" =~ ^[0-9]+$ ]] || die "XC_POSTGRES_PORT: expected a port number, got '$port'"
dir="${dir:-${XC_POSTGRES_DIR:-${XC_HOME:-$HOME/.xc-dagster}/postgres}}"
if [[ "$cmd" == start ]]; then
    mkdir -p "$dir" || die "cannot create the folder $dir"
elif [[ ! -d "$dir" ]]; then
    [[ "$cmd" == stop ]] && { say "not running (no folder $dir)"; exit 0; }
    die "no folder $dir: run 'postgres.sh start $dir' first"
fi
dir="$(cd "$dir" && pwd -P)"
data="$dir/data" run="$dir/run" envfile="$dir/server.env"

# the server's binaries: $PG_BIN, else the folder of `initdb` on PATH, else Debian's newest /usr/lib/postgresql/*/bin
find_bin() {
    if [[ -n "${PG_BIN:-}" ]]; then echo "$PG_BIN"; return; fi
    local initdb
    if initdb="$(command -v initdb)"; then dirname "$(readlink -f "$initdb")"; return; fi
    local newest
    newest="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    [[ -n "$newest" ]] && echo "$newest"
}
bin="$(find_bin || true)"
for tool in initdb pg_ctl psql; do
    [[ -n "$bin" && -x "$bin/$tool" ]] || die "PostgreSQL's $tool not found (looked in \$PG_BIN, PATH and /usr/lib/postgresql/*/bin): install PostgreSQL or set PG_BIN" 3
done

# as root, the server and its files belong to the `postgres` system user
if ((EUID == 0)); then
    id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' system user to run the server as (Postgres refuses root)" 3
    as_server() { (cd / && runuser -u postgres -- "$@"); }  # from a folder it may enter
else
    as_server() { "$@"; }
fi

read_env() {  # PORT, DAGSTER_PASSWORD, MLFLOW_PASSWORD from server.env
    [[ -f "$envfile" ]] || die "$envfile not found: run 'postgres.sh start $dir' first"
    local line key value
    while IFS= read -r line; do
        [[ "$line" =~ ^(PORT|DAGSTER_PASSWORD|MLFLOW_PASSWORD)=([A-Za-z0-9]+)$ ]] || continue
        key="${BASH_REMATCH[1]}" value="${BASH_REMATCH[2]}"
        printf -v "$key" '%s' "$value"
    done <"$envfile"
    [[ -n "${PORT:-}" && -n "${DAGSTER_PASSWORD:-}" && -n "${MLFLOW_PASSWORD:-}" ]] \
        || die "$envfile: expected lines PORT=<number>, DAGSTER_PASSWORD=<hex>, MLFLOW_PASSWORD=<hex>"
}

print_urls() {
    echo "export XC_DAGSTER_POSTGRES_URL=postgresql+psycopg2://dagster:$DAGSTER_PASSWORD@127.0.0.1:$PORT/dagster"
    echo "export MLFLOW_TRACKING_URI=postgresql+psycopg2://mlflow:$MLFLOW_PASSWORD@127.0.0.1:$PORT/mlflow"
}

running() { [[ -f "$data/PG_VERSION" ]] && as_server "$bin/pg_ctl" status -D "$data" >/dev/null 2>&1; }

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

free_port() {
    local p
    for ((p = 5432; p < 5532; p++)); do port_in_use "$p" || { echo "$p"; return; }; done
    die "no free port in 5432-5531: give one with --port" 3
}

make_env() {  # the port and the two passwords, made once (mode 600, written whole)
    local tmp="$envfile.tmp.$$" first_port="$port"
    [[ -n "$first_port" ]] || first_port="$(free_port)"
    (umask 077; {
        echo "# xc-dagster PostgreSQL server of this folder (deploy/postgres.sh): its port and users' passwords"
        echo "PORT=$first_port"
        echo "DAGSTER_PASSWORD=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
        echo "MLFLOW_PASSWORD=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
    } >"$tmp")
    mv "$tmp" "$envfile"
}

init_cluster() {  # initdb into a temporary folder, then move it in place: no half-made data folder
    local tmp="$dir/data.initdb.$$"
    rm -rf "$tmp"
    mkdir -m 700 "$tmp"
    if ((EUID == 0)); then chown postgres: "$tmp"; fi
    say "initdb $data"
    as_server "$bin/initdb" -D "$tmp" --auth-local=peer --auth-host=scram-sha-256 -E UTF8 --locale=C \
        >"$dir/initdb.log" 2>&1 || { tail -n 20 "$dir/initdb.log" >&2; rm -rf "$tmp"; die "initdb failed" 3; }
    # the socket folder: readable by the server user only, so only it (and root) can connect through it
    cat >>"$tmp/postgresql.conf" <<EOF

# deploy/postgres.sh: TCP on the loopback only (password auth), a socket in its own folder (peer auth)
listen_addresses = '127.0.0.1'
unix_socket_directories = '$run'
EOF
    mv "$tmp" "$data"
}

start() {
    exec 9>"$dir/.start.lock"
    flock 9  # concurrent starts of one folder: one makes it, the others find it running
    ((${#run} + 20 < 107)) || die "folder path too long for the server's socket ($run): give a shorter folder"
    if ((EUID == 0)) && ! runuser -u postgres -- test -x "$dir"; then
        chmod o+x "$dir" 2>/dev/null || true  # our folder: let the server user through (not list it)
        runuser -u postgres -- test -x "$dir" || die "the 'postgres' user cannot reach $dir (a parent folder is not \
searchable by it, e.g. /root): give a folder it can reach, e.g. 'postgres.sh start /var/lib/xc-postgres'"
    fi
    [[ -f "$envfile" ]] || make_env
    read_env
    if [[ -n "$port" && "$port" != "$PORT" ]]; then  # a new port for this folder: kept for later starts
        sed -i "s/^PORT=.*/PORT=$port/" "$envfile"
        PORT="$port"
        if running; then say "restarting on port $PORT"; as_server "$bin/pg_ctl" stop -D "$data" -m fast -w >/dev/null; fi
    fi
    [[ -f "$data/PG_VERSION" ]] || init_cluster
    mkdir -p "$run"
    chmod 700 "$run"
    if ((EUID == 0)); then chown postgres: "$run"; fi
    if running; then
        say "already running ($data, port $PORT)"
    else
        say "starting on 127.0.0.1:$PORT ($data)"
        as_server "$bin/pg_ctl" start -D "$data" -l "$run/server.log" -w -t 60 -o "-p $PORT" \
            </dev/null >/dev/null 2>&1 9>&- || {  # the server keeps no fd of ours (9: the start lock)
            tail -n 20 "$run/server.log" >&2 || true
            die "the server did not start (port $PORT taken? see $run/server.log)" 3
        }
    fi
    make_users
    print_urls
}

make_users() {  # each user and its database once; the passwords from server.env each time (via stdin, not argv)
    as_server "$bin/psql" -X -q -v ON_ERROR_STOP=1 -h "$run" -p "$PORT" -d postgres >/dev/null <<EOF
SELECT 'CREATE ROLE dagster LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'dagster') \gexec
SELECT 'CREATE ROLE mlflow LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mlflow') \gexec
ALTER ROLE dagster PASSWORD '$DAGSTER_PASSWORD';
ALTER ROLE mlflow PASSWORD '$MLFLOW_PASSWORD';
SELECT 'CREATE DATABASE dagster OWNER dagster' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'dagster') \gexec
SELECT 'CREATE DATABASE mlflow OWNER mlflow' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mlflow') \gexec
REVOKE CONNECT ON DATABASE dagster FROM PUBLIC;
REVOKE CONNECT ON DATABASE mlflow FROM PUBLIC;
EOF
}

case "$cmd" in
    start) start ;;
    stop)
        if running; then
            say "stopping ($data)"
            as_server "$bin/pg_ctl" stop -D "$data" -m fast -w >/dev/null
        else
            say "not running ($data)"
        fi ;;
    url) read_env; print_urls ;;
esac
