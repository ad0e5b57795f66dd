"""The ``mismatch-monitor`` command line."""
