"""The GPU correctness cases: the package ``gpu`` beside the tests' helpers (tests/conftest.py puts
``tests/`` on the path). pytest runs them under the ``gpu`` marker (``test_cases.py``), skipped
without CUDA; ``scripts/gpu_suite.py`` runs them with the performance cases in time-boxed parts."""
