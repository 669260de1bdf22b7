"""mps-exporter: Prometheus exporter for NVIDIA MPS."""

__version__ = "0.1.0"
