"""vitcore: the Vision Transformer family of "An Image is Worth 16x16 Words" in PyTorch.

Build a model from a variant name; inputs are float images (B, 3, H, W) in [-1, 1]::

    model = vitcore.create_model("B/16", num_classes=1000, img_size=224)
    logits = model(images)                                   # (B, num_classes)

Representations by name (big_vision style). The few-shot evaluator consumes
"pre_logits", the image representation y of Eq. 4 (after the tanh pre-logits layer
when the model has one)::

    logits, out = model(images, return_intermediates=True)
    out["pre_logits"]   # (B, representation_size or width)
    out["encoded"]      # (B, L, width): every token after the final LayerNorm
    # also out["stem"] (patch embeddings) and out["with_posemb"]
    model.forward_features(images)   # == out["encoded"] (timm semantics)

The paper's convolutional baselines, BiT ResNets (Section 4.1, Table 6), come from the
same function and answer the same calls; a ResNet's "encoded" is its last feature map
(B, C, h, w) and "pre_logits" its global average. `model.lacks` names the parts of
`INSPECTION_PARTS` a model has not (a ResNet: all of them), so callers skip those figures::

    model = vitcore.create_model("BiT-R50x1", num_classes=1000, img_size=224)
    if "attention" not in model.lacks: ...

Fine-tuning (Section 3.2): `reset_head(model, K)` drops the pre-training head and
attaches a zero-initialised linear layer; `load_checkpoint(path, img_size=384)`
re-grids the position embeddings.

Weights: `load_npz` (official vit_jax / big_vision / BiT), `load_timm_state_dict`, and our own
`save_checkpoint` / `load_checkpoint` (safetensors with the config in its metadata).

This package imports no Ray, Beam or MLflow.
"""

from .checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from .convert import LoadReport, load_npz, load_timm_state_dict, npz_to_state_dict
from .fewshot import compute_representations, fewshot_accuracy, fit_ridge, select_shots
from .flops import bf16_peak_flops, count_macs, train_flops_per_image
from .inspection import (
                         attention_rollout,
                         attention_weights,
                         embedding_filter_pcs,
                         mean_attention_distance,
                         position_embedding_similarity,
)
from .model import OPTIONS, VisionTransformer, ViTConfig, create_model, reset_head, set_gelu
from .mpp import MaskedPatchPrediction, corrupt_patches, mpp_targets
from .posembed import adapt_pos_embed, resize_grid, sincos_2d
from .reference import ReferenceViT
from .resnet import INSPECTION_PARTS, BiTConfig, ResNetV2
from .variants import VARIANTS, accepted_variants, decode_variant, is_bit_variant

__all__ = [
    "BiTConfig", "INSPECTION_PARTS", "ResNetV2", "is_bit_variant",
    "LoadReport", "MaskedPatchPrediction", "OPTIONS", "ReferenceViT", "VARIANTS", "ViTConfig",
    "VisionTransformer", "accepted_variants", "adapt_pos_embed", "attention_rollout", "attention_weights",
    "bf16_peak_flops", "compute_representations", "corrupt_patches", "count_macs", "create_model",
    "decode_variant", "embedding_filter_pcs", "fewshot_accuracy", "fit_ridge", "load_checkpoint",
    "load_npz", "load_timm_state_dict", "mean_attention_distance", "mpp_targets", "npz_to_state_dict",
    "position_embedding_similarity", "read_checkpoint", "reset_head", "resize_grid", "save_checkpoint",
    "select_shots", "set_gelu", "sincos_2d", "train_flops_per_image",
]
