"""Hostile image items in an image-chat corpus (issue 29): an image path that leaves the corpus directory
(`..`, absolute, `file://`, a symbolic link out) is refused before anything is opened, with the same
message whether the file outside exists or not; a FIFO, a device or an oversized file is refused before
its bytes are read; a NUL in a path is a named error."""

from __future__ import annotations

import faulthandler
import json
import os
import tracemalloc

import pytest

from prepack.errors import InputError
from prepack.formats.images import ImageLimits
from prepack.sources.images import prepare_image_chat
from tests.vision_inputs import PHOTOS, SAMPLE_DATA, processor_directory


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return processor_directory(tmp_path_factory.mktemp("proc") / "processor")


def image_record(path: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "?"}]},
                         {"role": "assistant", "content": "a photo"}]}


def corpus_with(directory, path: str):
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "chats.jsonl"
    corpus.write_text(json.dumps(image_record(path)) + "\n")
    return corpus


@pytest.fixture
def layout(tmp_path):
    """`tmp/corpus/` (the corpus's directory, holding a photo) and `tmp/outside/photo.png`, a valid image
    that must never be read; `tmp/outside/missing.png` does not exist."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "corpus" / "inside.png").write_bytes((SAMPLE_DATA / PHOTOS[1]).read_bytes())
    (tmp_path / "outside" / "photo.png").write_bytes((SAMPLE_DATA / PHOTOS[1]).read_bytes())
    return tmp_path


def refusal(processor, corpus, out, **options) -> str:
    with pytest.raises(InputError) as caught:
        prepare_image_chat(corpus, processor, out, **options)
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))  # nothing half-written
    return str(caught.value)


@pytest.mark.parametrize(
    "escape",
    [
        lambda tmp, name: f"../outside/{name}",
        lambda tmp, name: f"../../{tmp.name}/outside/{name}",
        lambda tmp, name: str(tmp / "outside" / name),
        lambda tmp, name: f"file://{tmp / 'outside' / name}",
        lambda tmp, name: f"link-{name}",  # a symbolic link in the corpus directory, pointing out
        lambda tmp, name: f"dir-link/{name}",  # a directory link on the way
    ],
    ids=["dotdot", "dotdot-back-in-name", "absolute", "file-uri", "file-symlink", "directory-symlink"],
)
def test_an_image_path_out_of_the_corpus_directory_is_refused_alike_whether_the_file_exists(
    processor, layout, escape
):
    corpus_dir = layout / "corpus"
    (corpus_dir / "dir-link").symlink_to(layout / "outside")
    messages = {}
    for name in ("photo.png", "missing.png"):
        (corpus_dir / f"link-{name}").symlink_to(layout / "outside" / name)
        path = escape(layout, name)
        corpus = corpus_with(corpus_dir, path)
        message = refusal(processor, corpus, layout / "out")
        assert message.startswith(f"{corpus}, row 0, column messages[0].content: the image path ")
        messages[name] = message.replace(path, "PATH")
    assert messages["photo.png"] == messages["missing.png"]  # says nothing of what lies outside


def test_an_images_root_names_the_one_directory_images_come_from(processor, layout):
    """Relative paths resolve against it, absolute ones are taken when they lie inside it; a link out of
    it is refused as from the corpus directory."""
    corpus = layout / "corpus" / "chats.jsonl"
    records = [image_record("photo.png"), image_record(str(layout / "outside" / "photo.png"))]
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    summary = prepare_image_chat(corpus, processor, layout / "out", images_root=layout / "outside")
    assert (summary.references, summary.images) == (2, 1)
    escaping = corpus_with(layout / "corpus", "../corpus/inside.png")
    message = refusal(processor, escaping, layout / "out2", images_root=layout / "outside")
    assert "leads out of" in message and str(layout / "outside") in message
    (layout / "outside" / "back").symlink_to(layout / "corpus" / "inside.png")
    corpus = corpus_with(layout / "corpus", "back")
    message = refusal(processor, corpus, layout / "out3", images_root=layout / "outside")
    assert "leads out of" in message


def test_an_image_path_with_a_nul_is_a_named_error(processor, layout):
    corpus = corpus_with(layout / "corpus", "inside\0.png")
    message = refusal(processor, corpus, layout / "out")
    assert f"{corpus}, row 0, column messages[0].content" in message and "NUL" in message


def test_a_device_is_refused_before_a_byte_is_read(processor, layout):
    message = refusal(processor, corpus_with(layout / "corpus", "zero"), layout / "out", images_root="/dev")
    assert "is not a regular file (a character device)" in message


@pytest.mark.slow
def test_a_fifo_named_as_an_image_does_not_block(processor, layout):
    from tests.cli import WIDE, failure, run_prepack

    os.mkfifo(layout / "corpus" / "pipe.png")
    corpus = corpus_with(layout / "corpus", "pipe.png")
    result = run_prepack("prepare-images", corpus, "--processor", processor, "--out", layout / "out", env=WIDE,
                         timeout=60)
    assert "row 0, column messages[0].content: the image" in failure(result)
    assert "is not a regular file (a FIFO)" in failure(result)


def test_an_oversized_image_file_is_refused_by_its_size_before_it_is_read(processor, layout):
    big = layout / "corpus" / "big.png"
    with open(big, "wb") as file:  # sparse: 64 MiB that take no disk
        file.truncate(64 * 2**20)
    corpus = corpus_with(layout / "corpus", "big.png")
    tracemalloc.start()
    try:
        message = refusal(processor, corpus, layout / "out", limits=ImageLimits(max_image_bytes=2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"has {64 * 2**20} bytes, more than the limit {2**20}" in message
    assert peak < 8 * 2**20  # the file's 64 MiB were never read into memory


def test_a_fifo_as_the_processor_config_is_refused_not_waited_on(processor, tmp_path):
    import shutil

    from prepack.sources.images import processor_rule

    other = shutil.copytree(processor, tmp_path / "proc")
    (other / "preprocessor_config.json").unlink()
    os.mkfifo(other / "preprocessor_config.json")
    faulthandler.dump_traceback_later(30, exit=True)  # before the fix, opening it blocked for ever
    try:
        with pytest.raises(InputError, match=r"preprocessor_config.json is not a regular file \(a FIFO\)"):
            processor_rule(other)
    finally:
        faulthandler.cancel_dump_traceback_later()
