"""Build the demo's data on disk, offline: a labelled pre-training corpus and a downstream task.

Pre-training corpus (``corpus/<class>/<file>``, the class is the folder name, as in ImageNet):
- procedurally drawn classes (shapes, stripes, checkerboards, gradients) in random colours;
- one class per real photograph bundled with scikit-image and scikit-learn, filled with random
  crops, flips and rescales of that photograph;
- deliberately bad inputs (zero-byte, truncated, not an image) that ingest must quarantine;
- exact byte copies that ingest must drop as corpus duplicates;
- *planted* copies of downstream test images, resized and re-encoded, that ingest must drop as
  near-duplicates of the test set (Section 4.1: pre-training data is de-duplicated against the
  downstream test sets).

Downstream task (``downstream/{train,test}/<digit>/<file>.png``): scikit-learn's handwritten
digits, upsampled to 32x32 RGB.

Everything is seeded, so the same arguments always produce the same files.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from common.photos import photo

SHAPE_CLASSES = ("circle", "square", "triangle", "hstripes", "vstripes", "checker", "gradient", "ring")

# Real photographs (common.photos), one class each. Grayscale ones are included on purpose: ingest turns them into RGB.
PHOTO_NAMES = ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "retina.jpg", "rocket.jpg",
               "motorcycle_left.png", "ihc.png", "brick.png", "grass.png", "camera.png", "coins.png",
               "china.jpg", "flower.jpg")


@dataclasses.dataclass
class DemoData:
    root: Path
    corpus: Path
    train: Path
    test: Path
    corpus_images: int
    planted: int
    corrupt: int
    exact_copies: int
    classes: int
    downstream_classes: int
    train_images: int
    test_images: int

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}




def _random_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, 3))


def draw_shape(kind: str, size: int, rng: np.random.Generator) -> Image.Image:
    bg, fg = _random_colour(rng), _random_colour(rng)
    img = Image.new("RGB", (size, size), bg)
    d = ImageDraw.Draw(img)
    s = size
    if kind in ("circle", "square", "triangle", "ring"):
        r = rng.uniform(0.2, 0.4) * s
        cx, cy = rng.uniform(r, s - r, 2)
        box = (cx - r, cy - r, cx + r, cy + r)
        if kind == "circle":
            d.ellipse(box, fill=fg)
        elif kind == "ring":
            d.ellipse(box, outline=fg, width=max(2, int(r / 4)))
        elif kind == "square":
            d.rectangle(box, fill=fg)
        else:
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    elif kind in ("hstripes", "vstripes"):
        period = int(rng.integers(6, 20))
        for k in range(0, s, period):
            rect = (0, k, s, k + period // 2) if kind == "hstripes" else (k, 0, k + period // 2, s)
            d.rectangle(rect, fill=fg)
    elif kind == "checker":
        cell = int(rng.integers(8, 24))
        for y in range(0, s, cell):
            for x in range(0, s, cell):
                if (x // cell + y // cell) % 2 == 0:
                    d.rectangle((x, y, x + cell - 1, y + cell - 1), fill=fg)
    elif kind == "gradient":
        t = np.linspace(0, 1, s)[None, :, None]
        a, b = np.array(bg)[None, None], np.array(fg)[None, None]
        arr = (a * (1 - t) + b * t).repeat(s, axis=0)
        if rng.random() < 0.5:
            arr = arr.transpose(1, 0, 2)
        img = Image.fromarray(arr.astype(np.uint8))
    else:
        raise ValueError(f"unknown shape class {kind!r}; known: {', '.join(SHAPE_CLASSES)}")
    noise = rng.normal(0, 6, (s, s, 3))
    return Image.fromarray(np.clip(np.asarray(img, np.float32) + noise, 0, 255).astype(np.uint8))


def random_crop(img: Image.Image, out: int, rng: np.random.Generator) -> Image.Image:
    w, h = img.size
    area = rng.uniform(0.08, 0.5) * w * h
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw = int(min(w, max(8, round(np.sqrt(area * aspect)))))
    ch = int(min(h, max(8, round(np.sqrt(area / aspect)))))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    crop = img.crop((x, y, x + cw, y + ch)).resize((out, out), Image.BICUBIC)
    return crop.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop


def _save(img: Image.Image, path: Path, rng: np.random.Generator) -> Path:
    if rng.random() < 0.7:
        path = path.with_suffix(".jpg")
        img.save(path, "JPEG", quality=int(rng.integers(75, 96)))
    else:
        path = path.with_suffix(".png")
        img.save(path, "PNG")
    return path


def digit_images() -> tuple[list[Image.Image], np.ndarray]:
    """scikit-learn's 8x8 digits as 32x32 RGB images (bicubic upsampling)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    imgs = []
    for arr in digits.images:
        g = Image.fromarray((arr * (255.0 / 16.0)).astype(np.uint8), "L").resize((32, 32), Image.BICUBIC)
        imgs.append(g.convert("RGB"))
    return imgs, digits.target.astype(int)


def build(
    root: str | Path,
    *,
    per_shape: int = 60,
    per_photo: int = 24,
    image_size: int = 96,
    train_images: int = 1000,
    test_images: int = 300,
    planted: int = 20,
    seed: int = 0,
) -> DemoData:
    """Write the demo corpus and downstream task under ``root`` (replacing what is there)."""
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    corpus, train_dir, test_dir = root / "corpus", root / "downstream" / "train", root / "downstream" / "test"
    rng = np.random.default_rng(seed)
    n = 0
    for kind in SHAPE_CLASSES:
        (corpus / kind).mkdir(parents=True)
        for i in range(per_shape):
            _save(draw_shape(kind, image_size, rng), corpus / kind / f"{kind}_{i:04d}", rng)
            n += 1
    for name in PHOTO_NAMES:
        cls = Path(name).stem
        (corpus / cls).mkdir(parents=True)
        base = photo(name)
        for i in range(per_photo):
            _save(random_crop(base, image_size, rng), corpus / cls / f"{cls}_{i:04d}", rng)
            n += 1

    # Downstream task: a seeded split of the digits.
    imgs, labels = digit_images()
    order = rng.permutation(len(imgs))
    if train_images + test_images > len(order):
        raise ValueError(
            f"train_images + test_images = {train_images + test_images} exceeds the {len(order)} digits available"
        )
    test_paths: list[Path] = []
    for split_dir, idx in ((train_dir, order[:train_images]), (test_dir, order[train_images:train_images + test_images])):
        for j in idx:
            d = split_dir / str(labels[j])
            d.mkdir(parents=True, exist_ok=True)
            p = d / f"digit_{j:04d}.png"
            imgs[j].save(p)
            if split_dir is test_dir:
                test_paths.append(p)

    # Planted near-duplicates of test images: rescaled 1x-2x and re-encoded as JPEG.
    plant_dir = corpus / SHAPE_CLASSES[0]
    for k, j in enumerate(rng.choice(len(test_paths), size=planted, replace=False)):
        src = Image.open(test_paths[j]).convert("RGB")
        scale = float(rng.uniform(1.0, 2.0))  # prepare quarantines images under 32 px
        side = max(16, int(round(32 * scale)))
        src.resize((side, side), Image.BICUBIC).save(
            plant_dir / f"planted_{k:03d}.jpg", "JPEG", quality=int(rng.integers(70, 95))
        )

    # Exact copies of three corpus files under new names: ingest keeps one of each.
    copies = 0
    for kind in SHAPE_CLASSES[1:4]:
        first = sorted((corpus / kind).iterdir())[0]
        shutil.copyfile(first, first.with_name("copy_of_" + first.name))
        copies += 1

    # Bad inputs: each must end up in quarantine.jsonl with a reason.
    bad = corpus / SHAPE_CLASSES[1]
    (bad / "empty.jpg").write_bytes(b"")
    good = io.BytesIO()
    draw_shape("square", image_size, rng).save(good, "JPEG", quality=90)
    (bad / "truncated.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 3])
    (bad / "notes.jpg").write_text("this is not an image\n")
    corrupt = 3

    data = DemoData(
        root=root,
        corpus=corpus,
        train=train_dir,
        test=test_dir,
        corpus_images=n + planted + copies + corrupt,
        planted=planted,
        corrupt=corrupt,
        exact_copies=copies,
        classes=len(SHAPE_CLASSES) + len(PHOTO_NAMES),
        downstream_classes=10,
        train_images=train_images,
        test_images=test_images,
    )
    (root / "demo_data.json").write_text(json.dumps(data.to_dict(), indent=2))
    return data



# -- VTAB-style tasks: one small generated task per VTAB group -----------------------------------------

TEXTURES = ("grain", "blobs", "lines", "dots")
VTAB_TASKS = {"digits": "natural", "textures": "specialized", "count": "structured"}
# count: a crop can cut shapes out of the picture and change the label (cf. VTAB's CLEVR count).
VTAB_NO_CROP = ("count",)


def draw_texture(kind: str, size: int, rng: np.random.Generator) -> Image.Image:
    """A procedural texture, the stand-in for a specialised (remote-sensing, medical) image."""
    a, b = np.array(_random_colour(rng), np.float32), np.array(_random_colour(rng), np.float32)
    if kind == "grain":  # fine, high-frequency noise
        t = rng.random((size, size))
    elif kind == "blobs":  # smooth low-frequency noise: a coarse grid upsampled
        coarse = Image.fromarray((rng.random((4, 4)) * 255).astype(np.uint8)).resize((size, size), Image.BICUBIC)
        t = np.asarray(coarse, np.float32) / 255.0
    elif kind == "lines":  # parallel lines at a random angle
        angle, period = rng.uniform(0, np.pi), rng.uniform(4, 9)
        yy, xx = np.mgrid[0:size, 0:size]
        t = (np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period) > 0).astype(np.float32)
    elif kind == "dots":  # a jittered lattice of dots
        img = Image.new("L", (size, size), 0)
        d = ImageDraw.Draw(img)
        step = int(rng.integers(6, 10))
        for y in range(step // 2, size, step):
            for x in range(step // 2, size, step):
                jx, jy = rng.integers(-1, 2, 2)
                d.ellipse((x + jx - 1.5, y + jy - 1.5, x + jx + 1.5, y + jy + 1.5), fill=255)
        t = np.asarray(img, np.float32) / 255.0
    else:
        raise ValueError(f"unknown texture {kind!r}; known: {', '.join(TEXTURES)}")
    arr = a * (1 - t[..., None]) + b * t[..., None] + rng.normal(0, 6, (size, size, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def draw_count(n: int, size: int, rng: np.random.Generator) -> Image.Image:
    """``n`` non-overlapping small shapes on a plain background: the label is how many there are."""
    img = Image.new("RGB", (size, size), _random_colour(rng))
    d = ImageDraw.Draw(img)
    r = size / 10
    placed: list[tuple[float, float]] = []
    while len(placed) < n:
        cx, cy = rng.uniform(r + 1, size - r - 1, 2)
        if all((cx - px) ** 2 + (cy - py) ** 2 > (2.4 * r) ** 2 for px, py in placed):
            placed.append((cx, cy))
            box = (cx - r, cy - r, cx + r, cy + r)
            (d.ellipse if rng.random() < 0.5 else d.rectangle)(box, fill=_random_colour(rng))
    return img


def build_vtab_tasks(root: str | Path, *, train: int = 200, test: int = 100, size: int = 32,
                     seed: int = 0) -> dict[str, Path]:
    """Write three class-folder tasks, ``root/<task>/{train,test}/<class>/*.png``: digits (natural),
    textures (specialized) and a count of drawn shapes (structured). ``train`` images per task are
    what jobs/vtab_prepare.py --source folders cuts train and val from, ``test`` for testing. Returns ``{task: folder}``."""
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    rng = np.random.default_rng(seed + 1)
    imgs, labels = digit_images()
    order = rng.permutation(len(imgs))
    makers = {
        "digits": lambda i: (imgs[order[i]].resize((size, size), Image.BICUBIC), str(labels[order[i]])),
        "textures": lambda i: (draw_texture(TEXTURES[i % len(TEXTURES)], size, rng), TEXTURES[i % len(TEXTURES)]),
        "count": lambda i: (draw_count(1 + i % 4, size, rng), str(1 + i % 4)),
    }
    out = {}
    for task, make in makers.items():
        for split, start, n in (("train", 0, train), ("test", train, test)):
            for i in range(start, start + n):
                img, cls = make(i)
                d = root / task / split / cls
                d.mkdir(parents=True, exist_ok=True)
                img.save(d / f"{task}_{i:05d}.png")
        out[task] = root / task
    return out

if __name__ == "__main__":  # pragma: no cover - convenience
    import sys

    print(json.dumps(build(sys.argv[1] if len(sys.argv) > 1 else "demo_output/data").to_dict(), indent=2))
    os._exit(0)
