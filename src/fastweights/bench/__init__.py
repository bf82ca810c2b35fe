"""Benchmarks: timing, memory and FLOP-rate measurements of ops and mixers, and plots.

Each module is functions that measure and return rows (``suite.run`` for the suite; ``run`` in
the focused benchmarks: ``decode``, ``multistream``, ``fla_decode``, ``recompute``,
``context_parallel``, ``fwp_forms``, ``family_compare``, ``ttt_modes``, ``ttt_mlp_backward``).
Their command line is ``fastweights bench [NAME]`` (``fastweights.cli.bench``);
``python -m fastweights.bench.NAME`` runs the same command."""
