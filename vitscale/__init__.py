"""Cross-cutting pieces shared by every stage: typed configs, MLflow tracking, Ray helpers."""
