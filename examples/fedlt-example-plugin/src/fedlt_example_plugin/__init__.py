"""An example fedlt plug-in: the ``clipavg`` method, the ``equalnorm`` calibration and the ``mlp``
model, found by fedlt through the entry points in this package's pyproject.toml."""
