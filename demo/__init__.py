"""The end-to-end demo (run) and the corpus and downstream task it generates (data).

``make demo`` runs it through jobs/demo.py; tests and benchmarks reuse its generated data.
"""
