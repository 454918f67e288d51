"""The protocol simulator (`diloco-peer simulate-swarm`): the swarm's round protocol, with its
real rules (`coordinator_free.swarm_view`, `update_log.replays`), driven in virtual time for
many peers, with modelled links, churn and stragglers and no training. It answers what a swarm
of a given size and shape does: versions per hour, bytes per peer per version, the wait of a
round, forks, and how many finished phases reach an applied update.

The package itself imports nothing: `engine` pulls in hivemind (through the signed records),
which the CLI must not pay for on every command. Import `swarm_sim.engine` and `swarm_sim.spec`.
"""
