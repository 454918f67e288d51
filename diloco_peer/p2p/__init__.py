"""This process's side of the libp2p daemon: the shared loop and replica (`service`), stream
handlers with one lifecycle (`handler`), and the framing helpers every stream protocol uses
(`streams`). Below `averaging` and `coordinator_free`, above `identity`, `config`, `errors`."""
