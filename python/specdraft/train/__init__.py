"""Training draft heads by self-distillation from their target (``specdraft train``).

Needs the optional extra: ``pip install 'specdraft[train]'`` (JAX and optax). The modules:
``data`` (corpora and the held-out split), ``cache`` (the target's hidden states on disk),
``targets`` (the target's shape, frozen weights and hidden extraction), ``methods`` (the
heads ``--method`` names: ``method_mtp``, ``method_eagle3``), ``layer`` (the decoder layer
the heads share), ``mtp`` and ``eagle3`` (each head's own row forward and weights), ``head``
(the training-time-test unroll and loss of any head), ``trainer`` (AdamW, checkpoints),
``evaluate`` (greedy acceptance), ``vocab`` (the draft vocabulary and its coverage),
``export`` and ``export_eagle3`` (the heads' files) and ``pipeline`` (all of it in order).
"""
