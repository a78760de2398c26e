"""The math of classifier calibration: pure tensor functions (no config, files or federation
logic) used by the calibrators that fix a biased classifier after (or during) federated training.
Nothing here imports a method, a calibrator or the wrapper.

- :mod:`~fedlt.calibration.math.stats`: per-class feature sums that clients send and a server adds
  up, and the class means/covariances derived from them (CCVR, FedNCM).
- :mod:`~fedlt.calibration.math.classifiers`: closed-form and post-hoc heads (FedNCM, Fed3R,
  tau-norm).
- :mod:`~fedlt.calibration.math.virtual`: CCVR's virtual features sampled from per-class
  Gaussians.
- :mod:`~fedlt.calibration.math.retrain`: SGD re-training of a linear head on (real, virtual or
  federated) features.
- :mod:`~fedlt.calibration.math.creff`: CReFF's per-class classifier gradients and the federated
  features learned by gradient matching.
- :mod:`~fedlt.calibration.math.rff`: random Fourier features of the RBF kernel from a shared seed
  (SFD's privacy-compatible MMD).
- :mod:`~fedlt.calibration.math.safs`: SFD's statistically aligned feature synthesis (MeanCov
  Aligner, random-feature MMD and range regulariser on a per-class memory bank).

Randomness always comes from an explicit ``torch.Generator``.
"""
