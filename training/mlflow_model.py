"""A vitcore ViT as an MLflow pyfunc model, logged from code (MLflow's "models from code").

MLflow loads this file, not a pickle: ``load_context`` rebuilds the model from the weights
artifact, a safetensors checkpoint (``vitcore.load_checkpoint``: tensors and a JSON config, no
unpickling). ``mlflow.pytorch.log_model`` is not used because it saves the whole module with
``torch.save`` (pickle) and loads it with ``torch.load(weights_only=False)``.

``predict`` takes a batch of images: an ``(N, H, W, 3)`` array of pixels (uint8, or floats in
0..255), a list of ``(H, W, 3)`` arrays of any sizes, or an ``(N, 3, S, S)`` float array already
normalised to [-1, 1] at the model's resolution. Pixel images are resized (bilinear) and
normalised as the training pipeline's eval transform does. It returns the model's logits as an
``(N, classes)`` float32 array (the pre-logits features for a head-less model); the class names, in
column order, are in the model's metadata (``labels``).
"""
from __future__ import annotations

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


class VitClassifier(PythonModel):
    # predict takes several input layouts on purpose (above), so it has no type hint for MLflow's
    # schema validation; without this MLflow warns about the missing hint on every import.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        import torch

        import vitcore

        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
        self.model = vitcore.load_checkpoint(context.artifacts["weights"]).eval()
        self.size = tuple(self.model.config.img_size)

    def _batch(self, images) -> "np.ndarray":
        from PIL import Image

        if hasattr(images, "to_numpy") and not isinstance(images, np.ndarray):  # a DataFrame of arrays
            images = list(images.iloc[:, 0])
        if isinstance(images, np.ndarray) and images.ndim == 4 and images.shape[1] == 3 and images.shape[-1] != 3:
            return images.astype(np.float32)  # already CHW and normalised
        if isinstance(images, np.ndarray) and images.ndim == 3:
            images = images[None]
        out = []
        for img in images:
            arr = np.asarray(img)
            if arr.ndim != 3 or arr.shape[-1] != 3:
                raise ValueError(f"predict: expected images of shape (H, W, 3), got {arr.shape}; pass RGB pixels "
                                 "or an (N, 3, S, S) array normalised to [-1, 1]")
            arr = np.clip(arr, 0, 255).astype(np.uint8)
            if arr.shape[:2] != self.size:
                arr = np.asarray(Image.fromarray(arr).resize(self.size[::-1], Image.BILINEAR))
            out.append((arr.astype(np.float32).transpose(2, 0, 1) - 127.5) / 127.5)
        return np.stack(out)

    def predict(self, context, model_input, params=None):
        import torch
        import torch.nn.functional as F

        x = torch.from_numpy(self._batch(model_input))
        if tuple(x.shape[-2:]) != self.size:
            x = F.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        with torch.inference_mode():
            return self.model(x).float().numpy()


mlflow.models.set_model(VitClassifier())
