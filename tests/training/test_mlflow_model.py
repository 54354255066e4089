"""The MLflow model that every stage logs: its signature, its class names, and the evaluation's
preprocessing, on a real sqlite store and real photographs."""
from __future__ import annotations

import base64
import io

import mlflow
import numpy as np
import pytest
import torch
from PIL import Image

import vitcore
from training import run_artifacts
from training.data import eval_transform

LABELS = ["astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "moon"]


@pytest.fixture(scope="module")
def photos():
    """Five real photographs (skimage.data) at sizes other than the model's 32 px, as RGB pixels."""
    from skimage import data

    out = []
    for name, size in (("astronaut", (61, 47)), ("coffee", (40, 40)), ("chelsea", (90, 33)), ("rocket", (32, 32)),
                       ("camera", (48, 80))):
        arr = getattr(data, name)()
        img = Image.fromarray(arr).convert("RGB")
        out.append(np.asarray(img.resize(size, Image.BICUBIC)))
    return out


def _logged(tmp_path, build_pretrained, *, scores="softmax", labels=LABELS, num_classes=7):
    weights = tmp_path / "model.safetensors"
    if num_classes == 7:
        build_pretrained(weights, img_size=32, representation_size=16)
    else:
        torch.manual_seed(0)
        vitcore.save_checkpoint(vitcore.create_model("Ti/8", num_classes=num_classes, img_size=32, depth=1), weights)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run():
        info = run_artifacts.log_vit_model(weights, name="m", labels=labels, scores=scores)
    return info, vitcore.load_checkpoint(weights).eval()


def _evaluated(model, images) -> torch.Tensor:
    """The model's logits on ``images`` through the evaluation transform the stages score with."""
    apply = eval_transform(32)
    x = np.stack([apply(im, np.random.default_rng(0)) for im in images])
    with torch.inference_mode():
        return model(torch.from_numpy(x)).float()


def test_the_model_has_a_signature_names_its_classes_and_preprocesses_as_the_evaluation(tmp_path, photos,
                                                                                     build_pretrained):
    info, model = _logged(tmp_path, build_pretrained)
    assert [c.name for c in info.signature.inputs.inputs] == ["image"]
    assert [c.name for c in info.signature.outputs.inputs] == LABELS
    loaded = mlflow.pyfunc.load_model(info.model_uri)
    out = loaded.predict({"image": photos})
    assert list(out.columns) == LABELS
    expected = torch.softmax(_evaluated(model, photos), dim=-1).numpy()
    np.testing.assert_allclose(out.to_numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(out.to_numpy().sum(axis=1), 1.0, atol=1e-5)
    assert list(out.idxmax(axis=1)) == [LABELS[i] for i in expected.argmax(axis=1)]

    # File bytes, as a client sends them, give what the decoded pixels give.
    files = []
    for im in photos:
        buf = io.BytesIO()
        Image.fromarray(im).save(buf, "PNG")
        files.append(buf.getvalue())
    import pandas as pd

    np.testing.assert_allclose(loaded.predict(pd.DataFrame({"image": files})).to_numpy(), expected, atol=1e-6)
    # And as base64 text, the form bytes take in the JSON a served model receives.
    text = [base64.b64encode(f).decode("ascii") for f in files]
    np.testing.assert_allclose(loaded.predict({"image": text}).to_numpy(), expected, atol=1e-6)


def test_a_multi_label_model_gives_sigmoids_names_classes_by_index_and_refuses_a_bad_array(tmp_path, photos,
                                                                                           build_pretrained):
    info, model = _logged(tmp_path, build_pretrained, scores="sigmoid", labels=None)
    loaded = mlflow.pyfunc.load_model(info.model_uri)
    out = loaded.predict({"image": photos[:2]})
    assert list(out.columns) == [str(i) for i in range(7)]
    np.testing.assert_allclose(out.to_numpy(), torch.sigmoid(_evaluated(model, photos[:2])).numpy(), atol=1e-6)
    with pytest.raises(Exception, match=r"must be \(H, W, 3\) RGB pixels, got shape \(32, 32\); or pass the image"):
        loaded.predict({"image": [np.zeros((32, 32), np.uint8)]})


def test_a_model_without_a_head_returns_its_features(tmp_path, photos, build_pretrained):
    info, model = _logged(tmp_path, build_pretrained, num_classes=0, labels=None)
    out = mlflow.pyfunc.load_model(info.model_uri).predict({"image": photos[:2]})
    assert isinstance(out, np.ndarray) and out.shape == (2, 192)
    np.testing.assert_allclose(out, _evaluated(model, photos[:2]).numpy(), atol=1e-6)
