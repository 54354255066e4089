"""The base layer every other package stands on: typed configs and the CLI runner (config, cli),
text rules (text), fsspec and atomic-write helpers (fs), and the MLflow helper (tracking).

It imports nothing else of the project (tests/test_layering.py).
"""
