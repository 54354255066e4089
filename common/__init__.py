"""The base layer every other package stands on: typed configs and the CLI runner (config, cli),
text rules (text), fsspec and atomic-write helpers (fs), the MLflow helper (tracking), and the
one loader of the photographs bundled with scikit-image and scikit-learn (photos).

It imports nothing else of the project (tests/test_layering.py).
"""
