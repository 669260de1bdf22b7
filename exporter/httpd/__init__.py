"""The HTTP stack: the server (web.py), its web config file (webconfig.py) and systemd's
socket activation (systemd.py). It knows the collector only as a registry that may encode
itself (web.SelfEncoding): nothing here imports the collector."""
