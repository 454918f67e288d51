"""`python -m diloco_peer` runs the command line, like the `diloco-peer` script."""

from diloco_peer.cli.main import main

main()
