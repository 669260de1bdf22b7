"""`mps-exporter status`: the node's MPS state on one screen (command.py)."""
