"""On-disk dataset formats, one module per format.

Each module turns the files a dataset ships as into a :class:`~fedlt.data.dataset.DatasetPair`
and converts every problem with those files into a one-line
:class:`~fedlt.errors.DataError`. Name resolution and default folders live in
:mod:`fedlt.data.registry`.
"""
