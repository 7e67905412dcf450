"""shoal.cli: the ``shoal`` command."""
