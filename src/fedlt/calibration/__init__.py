"""Classifier calibration for federated long-tailed learning, in three layers:

- :mod:`fedlt.calibration.math`: the math, as pure tensor functions (feature statistics,
  closed-form heads, virtual features, head re-training, CReFF's gradient matching, random
  Fourier features, SFD's feature synthesis); it imports nothing from the two modules below nor
  from :mod:`fedlt.methods`.
- :mod:`fedlt.calibration.calibrators`: the server-side calibrators (what each asks the clients
  for, how it builds a head) and their ``calibration_args`` knobs.
- :mod:`fedlt.calibration.wrapper`: the wrapper that adds calibrators to any method
  (``calibration=[...]``), its statistics query and the client-side feature extraction.
"""
