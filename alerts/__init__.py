"""Alert and recording rule definitions for mps-exporter (see generate.py)."""
