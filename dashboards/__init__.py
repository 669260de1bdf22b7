"""grafanalib dashboards for mps-exporter (see generate.py)."""
