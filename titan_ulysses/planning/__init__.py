"""The memory planner: what one rank holds during a training step, known before any GPU is used.

``inputs.py`` what the planner takes (Layout, Switches, from_config); ``layer_terms.py`` what one layer keeps
per local token; ``groups.py`` activation checkpointing in groups; ``estimate.py`` the step's phases and its
peak; ``recommend.py`` the layout and switches that fit, and the launch's warning; ``track.py`` the same step
under fake tensors on CPU (``phases.py`` reads it per phase, ``fake_step.py`` fakes it), ``extrapolate.py``
which steps it traces; ``dry_run.py`` the text of ``train.py --dry-run``. The derivation:
docs/memory_model.md. Nothing here runs during a training step (tests/test_layering.py).
"""
