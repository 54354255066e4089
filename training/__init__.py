"""The pre-training stage: a ViT on Ray Train (pretrain, trainer), its checkpoints (checkpointer),
rank 0's metrics (metrics), its shard loaders and augmentation (data, augment, mixup), the loop's pieces
(loop, step, losses, ema: the loss and the weight average fine-tuning shares), and the Ray and MLflow-model helpers that transfer/ uses too (ray_utils,
loopback_torch, mlflow_model, run_artifacts).

It stands on common, vitcore, pipelines and dedup; transfer/, reports/, demo/ and jobs/ import it.
"""
