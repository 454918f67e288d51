"""State download: how a joining or behind peer gets the swarm's state (DESIGN.md §3, 1).

    server = StateServer(service, "run1", provide=lambda: cached_blob,   # every peer with state
                         updates=update_log.get)                          # and its replay log
    server.start()
    server.wait_until_ready(timeout_s=30)
    ...
    blob = download_state(service, "run1", donor_peer_id, timeout_s=600)  # joining, far behind
    blob = download_state_multi(service, "run1", donor_ids, head_hash,     # or from several
                                timeout_s=600)                              # donors at once
    tensors = safetensors_load(blob.data)      # safetensors, never pickle (DESIGN.md §4)
    if my_state_hash(tensors) != advertised_hash: ...  # the caller checks, see below
    ...
    data = download_update(service, "run1", donor_peer_id, state.version, timeout_s=60)
    record = UpdateRecord.from_bytes(data, shapes=...)   # behind by <= L: replay (update_log.py)

A donor serves the state it holds as one immutable blob: safetensors bytes (tensors plus string
metadata, `safetensors.torch.save(tensors, metadata)`), its version and its state hash. `provide`
is called in the service's loop thread for every request, so it must be cheap: return a blob built
once per version and cached, or None while there is no state yet.

A donor with an update log also serves single updates: `updates(base_version)` (also called in
the loop thread, so a dict lookup such as `UpdateLog.get`) returns the serialised UpdateRecord
that takes its state from `base_version` to `base_version + 1`, or None when it no longer (or
never) had it. `download_update` returns those bytes raw; `UpdateRecord.from_bytes` parses them.

**The requester does not trust the header.** `StateBlob.version` and `StateBlob.state_hash` are
what the donor claims; a buggy or hostile donor can send any bytes under any hash. The caller must
load `data` with safetensors (which never executes code), recompute the state hash itself, and
compare it with the hash the head peers advertise in their signed DHT records before using it.
Likewise an update is checked by replaying it: the result must hash to its `result_hash`, and the
last one to the advertised head.

Every failure is a `StateTransferFailed` whose `kind` (`TransferFailure`) says how it failed and,
for a refusal, whose `refusal` (`RefusalCode`) says why: callers branch on those, never on the
message, which is for humans.

Chunking keeps every frame small, so a state of hundreds of MB never becomes one giant frame. The
requester enforces `max_bytes` on the header before reading any data (catch-up passes the most
this run's model can take, not 2**31), checks every frame against what is left, and bounds the
whole transfer with one `timeout_s` and each stream's silence with `stall_timeout_s` (every
download, single-donor ones included), so a donor that stops sending is given up long before the
download's timeout. The donor takes one of its `max_uploads` slots only for a valid request of
an allowed peer, at most `max_uploads_per_peer` per requester, and drops a requester that reads
slower than `min_upload_bytes_s` on average (server.py). A multi-donor download's stalled donor
loses its range to another, and in its end game the rest of a range is fetched again only from
a stalled donor, cancelling the slower copy (endgame.py); see
`download_state_multi` for how ranges are shared out, re-queued and checked. `allow` sees the
requester's libp2p-authenticated peer id (the stream's, never a claimed field), which is how a
private swarm refuses downloads to peers outside its allowlist.

Modules, by job:

    wire.py        the wire format (v1): requests, answer header, refusals and their codes,
                   limits, StateBlob; the one place bytes off the wire become typed values
    server.py      StateServer, the donor's side
    transfer.py    one download on one stream, and the time bounds shared by the downloads
    single.py      download_state, download_range, download_update: one donor
    multi.py       download_state_multi: several donors at once, with its fallback
    multi_job.py   MultiDownload, the multi-donor download's ranges, copies and donors
    endgame.py     when a range in flight is fetched again: the pure end-game rule
"""

from diloco_peer.coordinator_free.state_transfer.multi import RANGE_BYTES, download_state_multi
from diloco_peer.coordinator_free.state_transfer.server import StateServer
from diloco_peer.coordinator_free.state_transfer.single import (
    StateRange,
    download_range,
    download_state,
    download_update,
)
from diloco_peer.coordinator_free.state_transfer.wire import CHUNK_BYTES, StateBlob
from diloco_peer.errors import RefusalCode, StateTransferFailed, TransferFailure

__all__ = [
    "CHUNK_BYTES",
    "RANGE_BYTES",
    "RefusalCode",
    "StateBlob",
    "StateRange",
    "StateServer",
    "StateTransferFailed",
    "TransferFailure",
    "download_range",
    "download_state",
    "download_state_multi",
    "download_update",
]
