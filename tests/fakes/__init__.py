"""Test doubles at the library boundaries: pynvml (fake_pynvml), DCGM's DcgmReader
(fake_dcgm), the control daemon subprocess (fake_control)."""
