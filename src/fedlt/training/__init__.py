"""Local training: one client's SGD (:mod:`fedlt.training.sequential`) and the same for many
clients at once in one batched computation (:mod:`fedlt.training.batched`, used by the vectorized
backend of :mod:`fedlt.engine.vectorized`)."""
