"""Training, evaluation, checkpoints and the experiments behind the ``fastweights`` command."""
