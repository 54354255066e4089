"""Reading the MLflow store back: the comparison report of every stage's runs (``jobs/report.py``).

It reads what the stages logged (params, metrics, tags, a few JSON artifacts) and nothing on
disk beside the store, so it works against a remote server as well as the embedded sqlite one.
"""
