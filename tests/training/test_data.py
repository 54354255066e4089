"""The training input pipeline: value range, crops, splits."""
import numpy as np
import pytest

from pipelines.schema import ShardSet
from training.data import (
    DecodeBatch,
    ShardImageDataset,
    eval_transform,
    inception_crop,
    split_rows,
    train_transform,
)


def _photo():
    from common.photos import photo

    return np.asarray(photo("chelsea.png"))


def test_train_and_eval_outputs_are_chw_in_minus_one_one():
    arr = _photo()
    rng = np.random.default_rng(0)
    for t in (train_transform(32), train_transform(32, flip=False, min_area=1.0), eval_transform(48)):
        x = t(arr, rng)
        assert x.dtype == np.float32 and x.shape[0] == 3 and x.shape[1] == x.shape[2]
        assert -1.0 <= x.min() < x.max() <= 1.0


def test_same_seed_same_augmentation():
    arr = _photo()
    t = train_transform(32)
    a = t(arr, np.random.default_rng((0, 1, 7)))
    b = t(arr, np.random.default_rng((0, 1, 7)))
    c = t(arr, np.random.default_rng((0, 2, 7)))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_inception_crop_respects_min_area():
    from PIL import Image

    img = Image.fromarray(_photo())
    out = inception_crop(img, 24, np.random.default_rng(0), area=(0.9, 1.0))
    assert out.size == (24, 24)
    with pytest.raises(ValueError, match="min_area"):
        train_transform(32, min_area=0.0)


def test_split_rows_is_seeded_disjoint_and_complete():
    train, held = split_rows(100, 0.1, seed=3)
    assert len(held) == 10 and len(train) == 90
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(100))
    assert np.array_equal(split_rows(100, 0.1, seed=3)[1], held)
    assert not np.array_equal(split_rows(100, 0.1, seed=4)[1], held)


@pytest.fixture(scope="module")
def multi_label_shards(tmp_path_factory, mlflow_store):
    """A real shard set from a JFT-style manifest: two rows with two labels, two with one."""
    import json

    from common.photos import photo
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("multi")
    rows = []
    for i, (name, labels) in enumerate([("chelsea.png", ["cat", "indoor"]), ("coffee.png", ["cup"]),
                                        ("astronaut.png", ["person", "indoor"]), ("rocket.jpg", ["rocket"])]):
        photo(name, max_side=64).save(root / f"{i}.png")
        rows.append({"uri": str(root / f"{i}.png"), "labels": labels})
    (root / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_prepare(PrepareConfig(input=[str(root / "labels.jsonl")], output=str(root / "shards"), size=32, workers=1))
    return ShardSet(str(root / "shards"))


def test_both_loaders_refuse_a_multi_label_row_in_single_label_mode(multi_label_shards):
    from common.config import ConfigError

    ss = multi_label_shards
    multi = [i for i in range(len(ss)) if len(ss[i]["labels"]) == 2]
    assert len(multi) == 2
    with pytest.raises(ConfigError, match="has 2 labels but label_mode='single'"):
        ShardImageDataset(ss, eval_transform(16), label_mode="single")[multi[0]]
    batch = next(ss.iter_batches()).to_pydict()
    with pytest.raises(ConfigError, match="has 2 labels but label_mode='single'"):
        DecodeBatch(16, label_mode="single", num_classes=len(ss.label_map), holdout=0.0)(batch)


def test_both_loaders_encode_multi_hot_targets_alike(multi_label_shards):
    ss = multi_label_shards
    ds = ShardImageDataset(ss, eval_transform(16), label_mode="multi")
    mapped = np.stack([ds[i][1].numpy() for i in range(len(ss))])
    batch = next(ss.iter_batches()).to_pydict()
    assert len(batch["key"]) == len(ss) == 4
    streamed = DecodeBatch(16, label_mode="multi", num_classes=len(ss.label_map), holdout=0.0)(batch)["label"]
    np.testing.assert_array_equal(mapped, streamed)
    names = ss.label_names
    assert sorted(names[j] for j in np.nonzero(mapped[multi_row(ss)])[0]) == ["cat", "indoor"]


def multi_row(ss):
    return next(i for i in range(len(ss)) if ss[i]["source"].endswith("0.png"))


# -- the crop split: CPU half (ShardCropDataset, DecodeBatch with a canvas), device half (augment) --

@pytest.fixture(scope="module")
def photo_shards(tmp_path_factory, mlflow_store):
    """Real photos of several aspect ratios, stored as JPEG shards with a 64 px shorter side."""
    from common.photos import photo
    from pipelines.config import PrepareConfig
    from pipelines.ingest import run_prepare

    root = tmp_path_factory.mktemp("photos")
    for name in ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg", "camera.png", "china.jpg"):
        (root / "src" / name.split(".")[0]).mkdir(parents=True)
        photo(name, max_side=200).save(root / "src" / name.split(".")[0] / "0.png")
    run_prepare(PrepareConfig(input=[str(root / "src")], output=str(root / "shards"), size=64, workers=1))
    return ShardSet(str(root / "shards"))


def _device_path(ds, positions):
    from training.augment import crop_resize_flip

    b = ds.__getitems__(positions)
    return (crop_resize_flip(b["image"], b["box"], b["extent"], b["flip"], ds.size) * 127.5 + 127.5).numpy(), b


def _reference(ss, positions, transform, seed, epoch):
    from pipelines.schema import decode_row_image

    return np.stack([transform(decode_row_image(ss[i]), np.random.default_rng((seed, epoch, i)))
                     for i in positions]).astype(np.float32)


def test_crop_split_matches_the_per_item_reference(photo_shards):
    """Same seed, same rows: the same boxes and flips as train_transform, and its pixels up to the
    rounding of PIL's two uint8 passes (one grey level)."""
    from training.data import ShardCropDataset

    ss, positions = photo_shards, list(range(len(photo_shards))) * 4
    for epoch in range(3):
        ds = ShardCropDataset(ss, 48, seed=5)
        ds.set_epoch(epoch)
        ours, batch = _device_path(ds, positions)
        ref = _reference(ss, positions, train_transform(48, uint8=True), 5, epoch)
        assert np.abs(ours - ref).max() <= 1.01
        assert 0 < batch["flip"].sum() < len(positions) or epoch


def test_reduced_scale_decode_stays_within_interpolation_error(photo_shards):
    """Crops at least twice the output are decoded at 1/2 or 1/4 DCT scale. Against the
    full-scale reference they differ less than the reference's own bilinear differs from bicubic."""
    from PIL import Image

    from pipelines.schema import decode_row_image
    from training.data import ShardCropDataset, inception_box

    ss, positions = photo_shards, list(range(len(photo_shards))) * 4
    ds = ShardCropDataset(ss, 16, seed=1)
    ours, batch = _device_path(ds, positions)
    ref = _reference(ss, positions, train_transform(16, uint8=True), 1, 0)
    bicubic = []
    for i in positions:
        rng = np.random.default_rng((1, 0, i))
        img = Image.fromarray(decode_row_image(ss[i]))
        out = img.resize((16, 16), Image.BICUBIC, box=inception_box(*img.size, rng))
        bicubic.append(np.asarray(out.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else out).transpose(2, 0, 1))
    ours_err, filter_err = np.abs(ours - ref), np.abs(np.stack(bicubic).astype(np.float32) - ref)
    assert (batch["extent"].max(1).values < 64).sum() >= len(positions) // 4  # scaled decodes happened
    assert ours_err.mean() <= filter_err.mean()
    assert np.percentile(ours_err, 99) <= np.percentile(filter_err, 99)


def test_crop_split_keeps_the_vtab_exclusions(photo_shards):
    from training.data import ShardCropDataset

    ss, positions = photo_shards, list(range(len(photo_shards)))
    ds = ShardCropDataset(ss, 40, flip=False, min_area=1.0, seed=2)
    ours, batch = _device_path(ds, positions)
    assert not batch["flip"].any()
    for t in (train_transform(40, flip=False, min_area=1.0, uint8=True), eval_transform(40, uint8=True)):
        assert np.abs(ours - _reference(ss, positions, t, 2, 0)).max() <= 1.01
    no_flip, _ = _device_path(ShardCropDataset(ss, 40, flip=False, seed=2), positions)
    assert np.abs(no_flip - _reference(ss, positions, train_transform(40, flip=False, uint8=True), 2, 0)).max() <= 1.01


def test_crop_batches_resume_exactly_whatever_the_worker_layout(photo_shards):
    """A resumed run (a fresh dataset, its epoch set, the epoch's remaining rows) gets the batches
    the uninterrupted run got, through DataLoader processes as in process."""
    import torch

    from training.data import ShardCropDataset, collate_crops

    ss = photo_shards
    rows = np.random.default_rng(0).permutation(len(ss) * 2) % len(ss)

    def batches(workers, start):
        ds = ShardCropDataset(ss, 32, seed=9)
        ds.set_epoch(3)
        loader = torch.utils.data.DataLoader(ds, batch_size=3, sampler=rows[start:].tolist(), drop_last=True,
                                             num_workers=workers, collate_fn=collate_crops)
        return list(loader)

    run = batches(0, 0)
    for resumed in (batches(0, 3), batches(2, 3)):
        assert len(resumed) == len(run) - 1
        for a, b in zip(run[1:], resumed):
            for field in ("box", "extent", "flip", "label"):
                assert torch.equal(a[field], b[field])
            for k, (h, w) in enumerate(a["extent"].tolist()):
                assert torch.equal(a["image"][k, :h, :w], b["image"][k, :h, :w])


def test_decode_batch_with_a_canvas_yields_crop_batches(photo_shards):
    """The Ray Data step's crop mode: a fixed canvas (so Ray can re-batch), held-out rows dropped,
    and on the eval side the same pixels as the per-item eval input."""
    from pipelines.schema import decode_row_image
    from training.augment import crop_resize_flip
    from training.data import canvas_shape, is_held_out

    ss = photo_shards
    batch = next(ss.iter_batches()).to_pydict()
    canvas = canvas_shape(ss, 24)
    kept = [i for i, k in enumerate(batch["key"]) if not is_held_out(k, 0.5)]
    train = DecodeBatch(24, label_mode="single", num_classes=len(ss.label_map), holdout=0.5, canvas=canvas)(batch)
    assert train["image"].shape == (len(kept), *canvas, 3)
    assert train["label"].tolist() == [batch["labels"][i][0] for i in kept]
    train = DecodeBatch(24, label_mode="single", num_classes=len(ss.label_map), holdout=0.0, canvas=canvas)(batch)
    x = crop_resize_flip(*(torch_from(train[f]) for f in ("image", "box", "extent", "flip")), 24)
    assert x.shape == (len(ss), 3, 24, 24) and -1.0 <= x.min() < x.max() <= 1.0

    held = DecodeBatch(40, label_mode="single", num_classes=len(ss.label_map), holdout=1.0, train=False,
                       canvas=canvas_shape(ss, 40, min_area=1.0))(batch)
    assert not held["flip"].any()
    x = crop_resize_flip(*(torch_from(held[f]) for f in ("image", "box", "extent", "flip")), 40) * 127.5 + 127.5
    ref = np.stack([eval_transform(40, uint8=True)(decode_row_image(bytes(data), fmt), None)
                    for data, fmt in zip(batch["image"], batch["format"])]).astype(np.float32)
    assert np.abs(x.numpy() - ref).max() <= 1.01


def torch_from(a):
    import torch

    return torch.from_numpy(np.asarray(a))


def test_crop_batches_train_a_model_through_the_device_half(photo_shards):
    """The wiring the trainer will use: DataLoader of crop batches, then device_batch after the copy."""
    import torch

    import vitcore
    from training.augment import device_batch
    from training.data import ShardCropDataset, collate_crops

    ds = ShardCropDataset(photo_shards, 32, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, drop_last=True, collate_fn=collate_crops)
    torch.manual_seed(0)
    model = vitcore.create_model("Ti/16", num_classes=ds.num_classes, img_size=32, depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = device_batch(next(iter(loader)), 32, "cpu")
    assert x.shape == (4, 3, 32, 32) and y.dtype == torch.int64
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)



def _crop_batches(ss, rows, *, workers, ring, release, copy=True):
    """The batches as the consumer sees them: each copied before it asks for the next (``copy``),
    or the batches themselves, held to the end."""
    import torch

    from training.data import ShardCropDataset, collate_crops, release_canvases

    ds = ShardCropDataset(ss, 32, seed=4, ring=ring)
    ds.set_epoch(1)
    loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=rows, drop_last=True, num_workers=workers,
                                         prefetch_factor=2 if workers else None, collate_fn=collate_crops)
    seen, slots = [], []
    for b in (release_canvases(loader) if release else loader):
        seen.append({k: b[k].clone() for k in ("image", "box", "extent", "flip", "label")} if copy else b)
        slots.append(b.get("slot"))
    return seen, slots


def _same_batches(a_list, b_list):
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        for field in ("box", "extent", "flip", "label"):
            assert (a[field] == b[field]).all()
        for k, (h, w) in enumerate(a["extent"].tolist()):
            assert (a["image"][k, :h, :w] == b["image"][k, :h, :w]).all()


def test_dataloader_processes_reuse_released_canvases_and_batches_stay_the_same(photo_shards):
    """With release_canvases, each DataLoader process writes its batches into a few shared canvases
    again and again; every batch is still the one the process-free loader gives, pixel for pixel."""
    from training.data import CANVAS_RING

    rows = (np.random.default_rng(1).permutation(len(photo_shards) * 6) % len(photo_shards)).tolist()
    reference, _ = _crop_batches(photo_shards, rows, workers=0, ring=CANVAS_RING, release=False)
    reused, slots = _crop_batches(photo_shards, rows, workers=2, ring=CANVAS_RING, release=True)
    assert len(reused) > 2 * CANVAS_RING
    assert all(s is not None for s in slots)  # no batch needed fresh shared memory
    assert len({s.key for s in slots}) <= 2 * CANVAS_RING
    _same_batches(reference, reused)


def test_a_canvas_never_released_is_never_written_again(photo_shards):
    """A consumer that keeps every batch (no release_canvases) gets fresh shared memory once the
    ring is used up, so no batch it holds changes under it."""
    from training.data import CANVAS_RING

    rows = (np.random.default_rng(2).permutation(len(photo_shards) * 6) % len(photo_shards)).tolist()
    reference, _ = _crop_batches(photo_shards, rows, workers=0, ring=CANVAS_RING, release=False)
    held, slots = _crop_batches(photo_shards, rows, workers=1, ring=CANVAS_RING, release=False, copy=False)
    assert [s is not None for s in slots] == [k < CANVAS_RING for k in range(len(slots))]
    _same_batches(reference, held)
