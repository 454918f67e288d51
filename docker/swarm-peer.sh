#!/bin/sh
# Entry point of compose.yaml's peers:  swarm-peer found|follow [diloco-peer join flags]
#
# Followers must dial the founder by its full multiaddr, /dns4/peer1/tcp/31337/p2p/<peer id>,
# and the peer id comes from a key. So every peer keeps one key in its own /data volume (a
# restarted peer and its checkpoints come back under the same id), and:
#   found   makes the key if missing, writes `<its --announce>/p2p/<its peer id>` to the address
#           file on the volume all peers share, then runs `diloco-peer join` with that key;
#   follow  makes its key if missing, waits for the address file, then runs
#           `diloco-peer join --swarm <address>` with its key.
# The rest of the arguments go to `diloco-peer join` unchanged. The founder's id never changes,
# so an address file left by an earlier start is still right; compose.yaml also starts the
# followers only once the founder is healthy (serving metrics, so listening and published).
#
# Environment (the defaults are the image's layout): SWARM_DATA_DIR=/data,
# SWARM_ADDRESS_FILE=/swarm/founder.maddr, SWARM_WAIT_S=300 (how long a follower waits).
set -eu

data_dir=${SWARM_DATA_DIR:-/data}
address_file=${SWARM_ADDRESS_FILE:-/swarm/founder.maddr}
wait_s=${SWARM_WAIT_S:-300}
key=$data_dir/identity.key

fail() {
    echo "swarm-peer: $1" >&2
    exit 2
}

role=${1:-}
[ $# -gt 0 ] && shift
case $role in
    found | follow) ;;
    *) fail "usage: swarm-peer found|follow [diloco-peer join flags]" ;;
esac

if [ ! -f "$key" ]; then
    diloco-peer keygen --out "$key" >/dev/null
fi

if [ "$role" = found ]; then
    announce=
    previous=
    for arg in "$@"; do
        case $previous in --announce) announce=$arg ;; esac
        case $arg in --announce=*) announce=${arg#--announce=} ;; esac
        previous=$arg
    done
    [ -n "$announce" ] || fail "the founder needs --announce, the address the followers dial"
    peer_id=$(python -c 'import sys
from diloco_peer.identity import Identity
print(Identity.load(sys.argv[1]).peer_id_str)' "$key")
    # Written whole, then renamed: a follower never reads half an address.
    printf '%s/p2p/%s\n' "$announce" "$peer_id" >"$address_file.tmp"
    mv "$address_file.tmp" "$address_file"
    exec diloco-peer join --identity "$key" "$@"
fi

waited_s=0
while [ ! -s "$address_file" ]; do
    [ "$waited_s" -lt "$wait_s" ] || fail "no founder address in $address_file after ${wait_s}s"
    sleep 1
    waited_s=$((waited_s + 1))
done
address=$(cat "$address_file")
exec diloco-peer join --swarm "$address" --identity "$key" "$@"
