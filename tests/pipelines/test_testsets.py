"""pipelines.testsets: test sets read as the ingest reads them, indexed incrementally, bad images quarantined."""
import pytest

from pipelines.sources import SourceError
from pipelines.testsets import add_source, build_test_set_index, check_sources


def test_bad_test_images_are_quarantined_not_fatal(tmp_path, photos):
    src = tmp_path / "testset"
    src.mkdir()
    photos["astronaut"].save(src / "good.png")
    photos["chelsea"].save(src / "good2.jpg")
    (src / "empty.jpg").write_bytes(b"")
    (src / "notes.jpg").write_text("not an image at all")
    (src / "truncated.jpg").write_bytes((src / "good2.jpg").read_bytes()[:300])
    index = build_test_set_index({"mixed": str(src)})
    assert index.counts() == {"mixed": 2}
    assert len(index.quarantine) == 3
    assert all(q.reason and q.test_set == "mixed" for q in index.quarantine)
    counts = add_source(index, "mixed", str(src))  # rebuild: nothing new is decoded into the index
    assert counts["added"] == 0 and counts["already_indexed"] == 2 and counts["quarantined"] == 3
    assert len(index.quarantine) == 3


def test_a_missing_test_set_is_refused_by_name_before_any_work(tmp_path):
    (tmp_path / "here").mkdir()
    check_sources({"here": str(tmp_path / "here")})
    with pytest.raises(SourceError, match=f"test_set gone: {tmp_path / 'gone'}: input not found"):
        check_sources({"here": str(tmp_path / "here"), "gone": str(tmp_path / "gone")})
