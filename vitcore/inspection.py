"""Inspecting a ViT (Section 4.5, Appendices D.7 and D.8).

Each function returns NumPy arrays and, given `path`, also writes a PNG figure.
Matplotlib is imported only when a figure is asked for.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from .model import VisionTransformer


@contextlib.contextmanager
def _frozen(model: torch.nn.Module):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _require(model: torch.nn.Module, part: str) -> None:
    """One line naming the model and the part it lacks (see `model.lacks`)."""
    if part in getattr(model, "lacks", ()):
        raise ValueError(f"{model.config.variant} has no {part.replace('_', ' ')} to inspect ({part!r} is in "
                         f"model.lacks); skip this figure for it")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str | os.PathLike) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    _pyplot().close(fig)


def embedding_filter_pcs(model: VisionTransformer, num_components: int = 28,
                         path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Principal components of the patch-embedding filters (Figure 7, left).

    The D rows of E (each a 3 x P x P filter) are centred and decomposed; returns
    (components (k, 3, P, P), each of unit norm so values lie in [-1, 1], and the
    fraction of variance each explains (k,)).
    """
    if getattr(model.config, "resnet_layers", None) is not None:
        raise ValueError(f"{model.config.variant}: a hybrid's 1x1 patch embedding acts on ResNet features, "
                         f"not pixels, so its filters are not images; inspect a plain ViT")
    _require(model, "embedding_filters")
    w = model.patch_embed.proj.weight.detach().float().cpu().numpy()
    d, c, p, _ = w.shape
    flat = w.reshape(d, -1)
    flat = flat - flat.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(flat, full_matrices=False)
    k = min(num_components, vt.shape[0])
    var = s ** 2
    components = vt[:k].reshape(k, c, p, p)
    ratio = var[:k] / var.sum()
    if path is not None:
        plt = _pyplot()
        cols = 7
        rows = -(-k // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(cols, rows), squeeze=False)
        for i, ax in enumerate(axes.flat):
            ax.axis("off")
            if i < k:
                img = components[i].transpose(1, 2, 0)
                img = (img - img.min()) / (np.ptp(img) + 1e-12)
                ax.imshow(img if c == 3 else img[..., 0], cmap=None if c == 3 else "gray")
        fig.suptitle(f"RGB embedding filters (first {k} principal components)")
        _save(fig, path)
    return components, ratio


def _patch_position_embeddings(model: VisionTransformer) -> torch.Tensor:
    cfg = model.config
    if cfg.posemb == "learn":
        return model.pos_embed[0, cfg.num_prefix_tokens:]
    if cfg.posemb == "sincos2d":
        return model.pos_embed[0]
    if cfg.posemb == "2d":
        return model.pos_embed_2d.patch_embeddings()[0]
    raise ValueError(f"model has posemb={cfg.posemb!r}: no absolute position embeddings to compare")


def position_embedding_similarity(model: VisionTransformer,
                                  path: str | os.PathLike | None = None) -> np.ndarray:
    """Cosine similarity between the position embedding of every patch and all others
    (Figure 7, centre). Returns (gh, gw, gh, gw) in [-1, 1]; [r, c] is the tile of the
    patch in row r, column c."""
    _require(model, "position_embeddings")
    gh, gw = model.config.grid
    with torch.no_grad():
        e = _patch_position_embeddings(model).detach().float().cpu()
        e = torch.nn.functional.normalize(e, dim=-1)
        sim = (e @ e.t()).clamp(-1, 1).reshape(gh, gw, gh, gw).numpy()
    if path is not None:
        plt = _pyplot()
        fig, axes = plt.subplots(gh, gw, figsize=(gw, gh), squeeze=False)
        for r in range(gh):
            for c in range(gw):
                im = axes[r, c].imshow(sim[r, c], vmin=-1, vmax=1, cmap="viridis")
                axes[r, c].set_xticks([])
                axes[r, c].set_yticks([])
        for c in range(gw):
            axes[-1, c].set_xlabel(str(c + 1))
        for r in range(gh):
            axes[r, 0].set_ylabel(str(r + 1))
        fig.colorbar(im, ax=axes, shrink=0.6, label="cosine similarity")
        fig.suptitle("Position embedding similarity")
        _save(fig, path)
    return sim


def attention_weights(model: VisionTransformer, images: torch.Tensor) -> list[torch.Tensor]:
    """Softmax attention of every layer, (B, heads, L, L) each, via the explicit path."""
    _require(model, "attention")
    with _frozen(model):
        _, out = model(images, return_attention=True)
    return [a.float().cpu() for a in out["attention"]]


def mean_attention_distance(model: VisionTransformer, images: torch.Tensor,
                            path: str | os.PathLike | None = None) -> np.ndarray:
    """Appendix D.7: for each head and layer, the distance in pixels between a query
    patch and the patches it attends to, weighted by the attention weight, averaged over
    query patches and images. Returns (depth, heads), each in [0, largest patch-centre
    distance].

    The [class] token has no pixel position, so its row and column are left out and the
    weights over patch keys are renormalised to sum to one.
    """
    _require(model, "attention")
    cfg = model.config
    gh, gw = cfg.grid
    yy, xx = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    centres = np.stack([yy.ravel(), xx.ravel()], 1) * cfg.patch_size
    dist = torch.from_numpy(np.linalg.norm(centres[:, None] - centres[None], axis=-1)).float()
    p = cfg.num_prefix_tokens
    rows = []
    for a in attention_weights(model, images):
        a = a[:, :, p:, p:]
        a = a / a.sum(-1, keepdim=True).clamp_min(1e-12)
        rows.append((a * dist).sum(-1).mean(dim=(0, 2)))  # (heads,)
    result = torch.stack(rows).numpy()
    if path is not None:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(5, 4))
        for h in range(result.shape[1]):
            ax.scatter(np.arange(1, cfg.depth + 1), result[:, h], s=12, label=f"head {h + 1}")
        ax.set_xlabel("Network depth (layer)")
        ax.set_ylabel("Mean attention distance (pixels)")
        ax.set_ylim(0, None)
        ax.set_title(f"{cfg.variant}: attended area by head and depth")
        if result.shape[1] <= 16:
            ax.legend(fontsize=6, ncol=2)
        _save(fig, path)
    return result


def attention_rollout(model: VisionTransformer, images: torch.Tensor,
                      path: str | os.PathLike | None = None) -> np.ndarray:
    """Appendix D.8, Attention Rollout (Abnar & Zuidema 2020): average each layer's
    attention over heads, add the identity for the residual path and renormalise rows,
    then multiply the matrices of all layers. Returns (B, gh, gw) maps in [0, 1], the
    rolled-out attention from the output token (the mean over tokens for 'gap' models)
    to each patch, divided by its maximum."""
    _require(model, "attention")
    cfg = model.config
    gh, gw = cfg.grid
    joint = None
    for a in attention_weights(model, images):
        a = a.mean(dim=1)
        a = a + torch.eye(a.shape[-1])
        a = a / a.sum(-1, keepdim=True)
        joint = a if joint is None else a @ joint
    p = cfg.num_prefix_tokens
    maps = joint[:, 0, p:] if p else joint.mean(dim=1)
    maps = maps / maps.amax(dim=-1, keepdim=True).clamp_min(1e-12)
    maps = maps.reshape(-1, gh, gw).numpy()
    if path is not None:
        plt = _pyplot()
        n = len(maps)
        fig, axes = plt.subplots(2, n, figsize=(2.2 * n, 4.4), squeeze=False)
        up = torch.nn.functional.interpolate(torch.from_numpy(maps)[:, None], size=cfg.img_size,
                                             mode="bilinear", align_corners=False)[:, 0].numpy()
        for i in range(n):
            img = ((images[i].detach().float().cpu().permute(1, 2, 0).numpy() + 1) / 2).clip(0, 1)
            axes[0, i].imshow(img)
            axes[1, i].imshow(img * up[i][..., None].clip(0, 1))
            axes[0, i].axis("off")
            axes[1, i].axis("off")
        axes[0, 0].set_title("input")
        axes[1, 0].set_title("attention rollout")
        _save(fig, path)
    return maps
