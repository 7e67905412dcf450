#!/usr/bin/env bash
# Create the certificates of the compose cluster for mutual TLS (run again: existing ones are
# kept), for compose.tls.yaml:
#
#   sudo compose/init-certs.sh [DIR]      # DIR: $SHOAL_CERTS_DIR or compose/certs
#   docker compose -f compose/compose.yaml -f compose/compose.tls.yaml up -d
#
#   DIR/ca.pem, DIR/ca-key.pem       the cluster CA (keep ca-key.pem offline: it is never mounted)
#   DIR/etcd-etcd-N.pem (+ -key)     etcd member N, server and peer (names etcd-N, 127.0.0.1)
#   DIR/service-NAME.pem (+ -key)    each shoal service process (names NAME, 127.0.0.1): it serves
#                                    with it and presents it to the services and to etcd
#   DIR/learner-host-N.pem (+ -key)  what host agent N gives its learners (carries no service
#                                    role: the services accept only learner credentials over it)
#   DIR/user.pem (+ -key)            your client certificate (CN user:$SHOAL_USER), for the cli
#
# The certificates are made by shoal.runtime.pki (the `cryptography` package): with a Python that
# has shoal installed here ($SHOAL_PYTHON, default python3), or else inside the shoal image
# ($SHOAL_IMAGE, default shoal:latest).
# Keys are written 0600; run as root (sudo) so that the keys the containers read are given to the
# image's uid (10001, see the Dockerfile), as compose/init-secrets.sh does for the tokens.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-${SHOAL_CERTS_DIR:-$here/certs}}"
uid=10001
principal="${SHOAL_USER:-${SUDO_USER:-${USER:-user}}}"

case "$principal" in
'' | *[!A-Za-z0-9._@+-]*)
    echo "init-certs: SHOAL_USER ($principal) must be letters, digits and ._@+-" >&2
    exit 2
    ;;
esac

umask 077
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

python="${SHOAL_PYTHON:-python3}"
if "$python" -c "import shoal.runtime.pki" 2>/dev/null; then
    pki=("$python" -m shoal.runtime.pki)
else
    pki=(docker run --rm -i --user "$(id -u):$(id -g)" -v "$dir:$dir"
        "${SHOAL_IMAGE:-shoal:latest}" python -m shoal.runtime.pki)
fi

{
    for n in 1 2 3; do
        echo "etcd etcd-$n $dir/etcd-etcd-$n etcd-$n"
    done
    for name in resource-manager-0 resource-manager-1 parameter-sync-0 parameter-sync-1 \
        job-scheduler-0 job-scheduler-1 host-agent-1 host-agent-2; do
        echo "service $name $dir/service-$name $name"
    done
    for n in 1 2; do
        echo "learner host-$n $dir/learner-host-$n"
    done
    echo "user $principal $dir/user"
} | "${pki[@]}" batch "$dir" | sed 's/^/init-certs: wrote /'

for file in "$dir"/*.pem; do
    case "$file" in
    *-key.pem) ;;
    *) chmod 0644 "$file" ;; # certificates are public; keys stay as pki wrote them (0600)
    esac
done
if [ "$(id -u)" -eq 0 ]; then
    # The containers' user reads the keys (user-key.pem too, for the cli container; the
    # invoking user's group as well); the CA key stays root's and is never mounted.
    for key in "$dir"/*-key.pem; do
        [ "$key" = "$dir/ca-key.pem" ] && continue
        chown "$uid:${SUDO_GID:-0}" "$key"
        chmod 0440 "$key"
    done
else
    echo "init-certs: not root: the containers (uid $uid) cannot read the keys in $dir yet;" \
        "run: sudo chown $uid $dir/*-key.pem (but not ca-key.pem)" >&2
fi
