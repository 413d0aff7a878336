"""The labelling loop's pure parts, no server: where a reviewed label puts a file in either
layout, the manifest that never doubles, a journal finished from any point, and the
labelling config and answers as Label Studio spells them (tests/review/test_label_loop.py
runs the whole loop against a real server)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from trainyard.core.errors import TrainyardError
from trainyard.review.label_files import (
    JOURNAL,
    MANIFEST,
    append_manifest,
    free_name,
    label_of,
    read_manifest,
    refiled,
)
from trainyard.review.pull import apply_journal, latest_answer
from trainyard.track.label_studio import (
    IMPORT_BATCH,
    IMPORT_BYTES,
    _batches,
    choice_result,
    chosen,
    label_config,
)


@pytest.mark.parametrize(
    ("rel", "label", "moved"),
    [
        ("dog/x.jpg", "cat", "cat/x.jpg"),
        ("dog/2024/x.jpg", "cat", "cat/2024/x.jpg"),  # subfolders kept
        ("train/dog/x.jpg", "cat", "train/cat/x.jpg"),  # the split kept
        ("test/dog/a/x.jpg", "cat", "test/cat/a/x.jpg"),
    ],
)
def test_a_file_moves_to_its_new_class_in_the_same_split(rel, label, moved):
    assert label_of(rel) == "dog"
    assert refiled(rel, label) == moved
    assert label_of(moved) == label


def test_a_taken_name_gets_the_task_tag(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "x.jpg").write_bytes(b"1")
    assert free_name(tmp_path, "cat/y.jpg", set(), "t7") == "cat/y.jpg"
    assert free_name(tmp_path, "cat/x.jpg", set(), "t7") == "cat/x-t7.jpg"
    assert free_name(tmp_path, "cat/y.jpg", {"cat/y.jpg"}, "t8") == "cat/y-t8.jpg"


def test_the_manifest_adds_a_review_once(tmp_path):
    one = {"review": "1/2/3@t", "action": "moved"}
    assert append_manifest(tmp_path, [one]) == 1
    assert append_manifest(tmp_path, [one, {"review": "1/4/5@t", "action": "kept"}]) == 1
    assert [r["review"] for r in read_manifest(tmp_path)] == ["1/2/3@t", "1/4/5@t"]


def _journal(tmp_path, ops):
    (tmp_path / JOURNAL).parent.mkdir(parents=True, exist_ok=True)
    records = [{"review": f"r{i}", "to": op["to"]} for i, op in enumerate(ops)]
    (tmp_path / JOURNAL).write_text(json.dumps({"ops": ops, "records": records}))


def test_a_journal_is_finished_whichever_renames_were_made(tmp_path):
    for name in ("dog/a.png", "cat/b.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    ops = [{"from": "dog/a.png", "to": "cat/a.png"}, {"from": "cat/b.png", "to": "dog/b.png"}]
    _journal(tmp_path, ops)
    (tmp_path / "dog/a.png").rename(tmp_path / "cat/a.png")  # the first made before a kill
    assert apply_journal(tmp_path) == 2
    assert (tmp_path / "cat/a.png").read_bytes() == b"dog/a.png"
    assert (tmp_path / "dog/b.png").read_bytes() == b"cat/b.png"
    assert not (tmp_path / JOURNAL).exists()
    assert len((tmp_path / MANIFEST).read_text().splitlines()) == 2


def test_a_journal_whose_file_is_in_neither_place_stops_and_stays(tmp_path):
    _journal(tmp_path, [{"from": "dog/gone.png", "to": "cat/gone.png"}])
    with pytest.raises(TrainyardError, match=r"neither dog/gone\.png nor cat/gone\.png"):
        apply_journal(tmp_path)
    assert (tmp_path / JOURNAL).exists()
    assert not (tmp_path / MANIFEST).exists()


def test_the_labelling_config_has_one_choice_per_class_quoted():
    config = ET.fromstring(label_config(["cat", 'say "hi" & <bye>']))
    values = [c.get("value") for c in config.iter("Choice")]
    assert values == ["cat", 'say "hi" & <bye>']
    assert chosen(choice_result("cat")) == ["cat"]


def test_the_latest_submitted_answer_counts_and_a_skip_is_none():
    answers = [
        {"id": 1, "updated_at": "2026-01-01", "result": choice_result("cat")},
        {"id": 2, "updated_at": "2026-01-03", "result": choice_result("dog")},
        {"id": 3, "updated_at": "2026-01-04", "result": [], "was_cancelled": True},
    ]
    assert latest_answer({"annotations": answers})["id"] == 2
    assert latest_answer({"annotations": answers[2:]}) is None


def test_imports_are_cut_by_count_and_by_size():
    """Photos travel as data URLs: a request stays far under Label Studio's 250 MB."""
    big = {"data": {"image": "x" * (IMPORT_BYTES // 2 + 1)}}
    small = [{"data": {"n": i}} for i in range(IMPORT_BATCH + 5)]
    sizes = [len(b) for b in _batches([big, big, *small])]
    assert sizes == [1, IMPORT_BATCH, 6]
    assert sum(sizes) == len(small) + 2
