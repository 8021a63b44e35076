"""The models: one decoder (``decoder/``), the families that declare what differs (``families/``), the
mixture of experts (``moe/``) and the registry the families register into (``registry.py``).

Importing ``models/families`` here, once, registers every family for whoever imports anything of ``models/``;
the registry itself imports none of them (no import circle: tests/test_layering.py)."""

import titan_ulysses.models.families  # noqa: F401 (registers every family)
