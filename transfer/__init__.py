"""The transfer stages of a pre-trained ViT: fine-tuning over a Ray Tune learning-rate grid
(finetune), the VTAB-1k protocol (vtab, with its task registry vtab_tasks and its task folders
vtab_data) and few-shot linear evaluation (fewshot), on the SGD loop (sgd) and the resumable Tune
sweeps (sweep, tune_state) they share.

It stands on training/ (its loaders, loop pieces and Ray and MLflow-model helpers) and everything
below it; reports/, demo/ and jobs/ import it.
"""
