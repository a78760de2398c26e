"""An example fedlt plug-in: the ``clipavg`` method and the ``equalnorm`` calibration, found by
fedlt through the entry points in this package's pyproject.toml."""
