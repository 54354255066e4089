"""The training and transfer stages: pre-training on Ray Train (pretrain), fine-tuning over a
Ray Tune learning-rate grid (finetune), with their shard loaders (data), training-loop pieces
(loop) and Ray helpers (ray_utils).

It stands on common, vitcore, pipelines and dedup; only demo/ and jobs/ import it.
"""
