#!/usr/bin/env bash
# Create the credentials of the compose cluster (run again: existing tokens are kept):
#
#   sudo compose/init-secrets.sh [DIR]      # DIR: $SHOAL_SECRETS_DIR or compose/secrets
#
#   DIR/user-token     your bearer token (the `cli` service reads it)          secret
#   DIR/admin-token    an admin token, for the operator only (never mounted)    secret
#   DIR/service-token  what the services present to each other                  secret
#   DIR/tokens         the services' tokens file: sha256 digests of the three,  not secret
#                      one "sha256:<hex> PRINCIPAL ROLE" line each (see shoal.runtime.auth)
#
# Tokens are 256 random bits from /dev/urandom. Existing token files are kept. The three lines
# this script writes in DIR/tokens end in "# init-secrets" and are rewritten from the token
# files; any other line (another user's, added by hand) is kept as it is.
# Compose bind-mounts secrets with their owner and mode, and the services run as uid 10001 (the
# image's user, see Dockerfile): run as root (sudo) so that the files the containers read are
# given to that uid, readable by your group too.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-${SHOAL_SECRETS_DIR:-$here/secrets}}"
uid=10001
principal="${SHOAL_USER:-${SUDO_USER:-${USER:-user}}}"

case "$principal" in
'' | *[[:space:]#]*)
    echo "init-secrets: SHOAL_USER ($principal) must be one word without '#'" >&2
    exit 2
    ;;
esac

umask 077
mkdir -p "$dir"

new_token() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
digest() { printf '%s' "$(tr -d '[:space:]' <"$1")" | sha256sum | cut -d' ' -f1; }

for name in user admin service; do
    file="$dir/$name-token"
    if [ ! -s "$file" ]; then
        new_token >"$file"
        echo "init-secrets: wrote $file"
    fi
done

mark="# init-secrets"
tmp="$(mktemp "$dir/.tokens.XXXXXX")"
{
    if [ -f "$dir/tokens" ]; then
        grep -v -e "$mark\$" "$dir/tokens" || true
    else
        echo "# TOKEN PRINCIPAL ROLE, one per line; a token may be given as sha256:<hex digest>"
    fi
    echo "sha256:$(digest "$dir/user-token") $principal user $mark"
    echo "sha256:$(digest "$dir/service-token") shoal-services service $mark"
    echo "sha256:$(digest "$dir/admin-token") admin admin $mark"
} >"$tmp"
chmod 0644 "$tmp"
mv -f "$tmp" "$dir/tokens"
echo "init-secrets: wrote $dir/tokens"

if [ "$(id -u)" -eq 0 ]; then
    # The containers' user reads these two; the invoking user's group may read them too.
    group="${SUDO_GID:-0}"
    chown "$uid:$group" "$dir/service-token" "$dir/user-token"
    chmod 0440 "$dir/service-token" "$dir/user-token"
    if [ -n "${SUDO_UID:-}" ]; then
        chown "$SUDO_UID:$SUDO_GID" "$dir/admin-token" "$dir/tokens"
    fi
else
    echo "init-secrets: not root: the containers (uid $uid) cannot read $dir/service-token" \
        "and $dir/user-token yet; run: sudo chown $uid $dir/service-token $dir/user-token" >&2
fi
