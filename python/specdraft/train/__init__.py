"""Training MTP draft heads by self-distillation from their target (``specdraft train-mtp``).

Needs the optional extra: ``pip install 'specdraft[train]'`` (JAX and optax). The modules:
``data`` (corpora and the held-out split), ``cache`` (the target's hidden states on disk),
``targets`` (the target's shape, frozen weights and hidden extraction), ``head`` (the head's
forward and loss), ``trainer`` (AdamW, checkpoints), ``evaluate`` (greedy acceptance),
``vocab`` (draft-vocabulary coverage), ``export`` (the head's files) and ``pipeline`` (all
of it in order).
"""
