"""A vitcore model as an MLflow pyfunc model, logged from code (MLflow's "models from code").

MLflow loads this file, not a pickle: ``load_context`` rebuilds the model from the weights
artifact, a safetensors checkpoint (``vitcore.load_checkpoint``: tensors and a JSON config, no
unpickling). ``mlflow.pytorch.log_model`` is not used because it saves the whole module with
``torch.save`` (pickle) and loads it with ``torch.load(weights_only=False)``.

The model's signature (``training.run_artifacts.model_signature``) takes one column, ``image``: per row an image file's
bytes (PNG, JPEG, WebP ...; base64 text when it comes as JSON to ``mlflow models serve``) or its
pixels as a ``(H, W, 3)`` uint8 array, of any size. Each image is decoded to RGB, resized and
normalised as the evaluation does (``training.data.eval_transform``: Pillow's bilinear resize to
the model's resolution, then ``(x - 127.5) / 127.5``). ``predict`` returns a DataFrame with one
column per class, named after it, holding the class probabilities (softmax, or sigmoid for a
multi-label head); ``df.idxmax(axis=1)`` is the top class. A model without a classification head
(masked patch prediction) returns its pre-logits features as an ``(N, D)`` float32 array.
"""
from __future__ import annotations

import base64
import io

import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel


class VitClassifier(PythonModel):
    # The ``image`` column holds bytes or arrays, which a type hint cannot say; without this MLflow
    # warns about the missing hint on every import. The logged signature is the contract.
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        import torch

        import vitcore

        torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
        self.model = vitcore.load_checkpoint(context.artifacts["weights"]).eval()
        self.size = tuple(self.model.config.img_size)
        config = context.model_config or {}
        self.scores = config.get("scores", "softmax")
        self.labels = list(config.get("labels") or [])

    def pixels(self, image) -> np.ndarray:
        """One image (file bytes, base64 text or an HWC array) as the model's normalised CHW input."""
        from PIL import Image

        if isinstance(image, str):
            image = base64.b64decode(image)
        if isinstance(image, (bytes, bytearray, memoryview)):
            with Image.open(io.BytesIO(bytes(image))) as img:
                arr = np.asarray(img.convert("RGB"))
        else:
            arr = np.asarray(image)
            if arr.ndim != 3 or arr.shape[-1] != 3:
                raise ValueError(f"predict: an image array must be (H, W, 3) RGB pixels, got shape {arr.shape}; "
                                 "or pass the image file's bytes")
            arr = np.clip(arr, 0, 255).astype(np.uint8)
        if arr.shape[:2] != self.size:
            arr = np.asarray(Image.fromarray(arr).resize(self.size[::-1], Image.BILINEAR))
        return (arr.astype(np.float32).transpose(2, 0, 1) - 127.5) / 127.5

    def predict(self, context, model_input, params=None):
        import pandas as pd
        import torch

        column = model_input["image"] if isinstance(model_input, (dict, pd.DataFrame)) else model_input
        images = []
        for entry in column:  # MLflow makes {"image": [text, ...]} one row holding the list
            several = (isinstance(entry, np.ndarray) and entry.dtype == object) or (
                isinstance(entry, list) and bool(entry) and isinstance(entry[0], (str, bytes, np.ndarray)))
            images.extend(entry if several else [entry])
        x = torch.from_numpy(np.stack([self.pixels(im) for im in images]))
        with torch.inference_mode():
            out = self.model(x).float()
        if self.scores == "features":
            return out.numpy()
        probs = (torch.sigmoid(out) if self.scores == "sigmoid" else torch.softmax(out, dim=-1)).numpy()
        return pd.DataFrame(probs, columns=self.labels or [str(i) for i in range(probs.shape[1])])


mlflow.models.set_model(VitClassifier())
