"""diloco-peer: decentralized DiLoCo training over a peer-to-peer swarm."""

__version__ = "0.1.0"
