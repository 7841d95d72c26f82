"""Hypothesis fuzzing of image sets (issue 29): random corruptions of a valid image set (a field of
`images.json` set to an odd value or deleted, its text broken, bytes of `images.arrow` or `documents.arrow`
changed with or without the manifest's size and sha256 made to match, a file deleted, emptied or replaced by
a symbolic link, a FIFO, a directory or `/dev/zero`) fed to every reader of one: `read_image_set`, with and
without `verify`, `verify --images --decode` (`verify_images`) and `ImagePackedDataset`. The only allowed
outcomes are success, a verify finding (a list of problems) or a `PrepackError`; never a traceback, never
a hang.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepack import build
from prepack.check.images import verify_images
from prepack.errors import PrepackError
from prepack.formats.images import DOCUMENTS_FILE, IMAGE_SET_MANIFEST, IMAGES_FILE, read_image_set
from prepack.sources.images import prepare_image_chat
from tests.attacks.test_fuzz_build_dir import _ODD_INTS, _PATHS, _leaves
from tests.corpus import make_not_a_file
from tests.vision_inputs import processor_directory
from tests.train.test_vision_end_to_end import image_chat_corpus


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    """`prepared/images` (an image set of 8 chats, 3 distinct photographs) and `build/`, their build."""
    root = tmp_path_factory.mktemp("fuzz-images")
    processor = processor_directory(root / "processor")
    summary = prepare_image_chat(image_chat_corpus(root / "corpus", rows=8), processor, root / "prepared")
    build(summary.corpus, root / "build", max_len=160, tokenizer=processor, chat=True, overflow="error")
    return root


def _manifest(directory: Path) -> dict | None:
    """The manifest as JSON, None once an earlier corruption broke its text."""
    try:
        return json.loads((directory / IMAGE_SET_MANIFEST).read_text())
    except (ValueError, RecursionError):
        return None


def _record(directory: Path, name: str) -> None:
    """Make the manifest's size and sha256 of `name` match its bytes, as a careful forger would."""
    manifest = _manifest(directory)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        return
    data = (directory / name).read_bytes()
    for entry in manifest["files"]:
        if isinstance(entry, dict) and entry.get("name") == name:
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (directory / IMAGE_SET_MANIFEST).write_text(json.dumps(manifest))


_VALUES = (
    st.sampled_from(_ODD_INTS)
    | st.sampled_from([None, True, False, 0.5, 1e300, [], {}, [1], {"a": 1}, "f" * 64, "grid", "fixed",
                       IMAGES_FILE, DOCUMENTS_FILE, *_PATHS])
    | st.text(max_size=12)
)


@st.composite
def corruptions(draw, directory: Path) -> str:
    """Corrupt the image set `directory` one way; what was done, for the failure message."""
    kind = draw(st.sampled_from(["field", "delete-field", "text", "bytes", "file"]), label="kind")
    manifest_path = directory / IMAGE_SET_MANIFEST
    if kind in ("field", "delete-field"):
        raw = _manifest(directory)
        if raw is None:
            return f"{kind}: the manifest is no longer JSON"
        path = draw(st.sampled_from([path for path, _ in _leaves(raw)]), label="field")
        parent = raw
        for step in path[:-1]:
            parent = parent[step]
        old = parent[path[-1]]
        if kind == "delete-field":
            del parent[path[-1]]
        elif isinstance(old, int) and not isinstance(old, bool) and draw(st.booleans(), label="nudge"):
            parent[path[-1]] = old + draw(st.integers(-3, 3), label="by")
        else:
            parent[path[-1]] = draw(_VALUES, label="value")
        manifest_path.write_text(json.dumps(raw))
        return f"{kind} {path}"
    if kind == "text":
        text = manifest_path.read_bytes()
        if len(text) < 2:
            return "text: too little left to corrupt"
        how = draw(st.sampled_from(["truncate", "flip", "nest", "not-utf8", "big-int", "repeat-key"]), label="how")
        if how == "truncate":
            text = text[: draw(st.integers(0, len(text) - 1))]
        elif how == "flip":
            at = draw(st.integers(0, len(text) - 1))
            text = text[:at] + bytes([text[at] ^ (1 << draw(st.integers(0, 7)))]) + text[at + 1 :]
        elif how == "nest":
            depth = draw(st.sampled_from([100, 100_000]))
            text = text.rstrip()[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
        elif how == "not-utf8":
            text = text.replace(b'"placeholder": "', b'"placeholder": "\xff', 1)
        elif how == "big-int":
            text = text.replace(b'"images": ', b'"images": ' + b"9" * draw(st.sampled_from([20, 5000])), 1)
        else:
            text = text.rstrip()[:-1] + b', "documents": 1}'
        manifest_path.write_bytes(text)
        return f"text {how}"
    name = draw(st.sampled_from([IMAGES_FILE, DOCUMENTS_FILE]), label="file")
    path = directory / name
    if kind == "bytes":
        if path.is_symlink() or not path.is_file() or path.stat().st_size == 0:
            return f"{name}: bytes: not a file with bytes after an earlier corruption"
        data = bytearray(path.read_bytes())
        how = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]), label="how")
        at = draw(st.integers(0, len(data) - 1), label="at")
        if how == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "truncate":
            data = data[:at]
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            data[at : at + 8] = draw(st.binary(min_size=8, max_size=8))
        path.write_bytes(bytes(data))
        if draw(st.booleans(), label="manifest made to match"):
            _record(directory, name)
        return f"{name}: bytes {how} at {at}"
    how = draw(st.sampled_from(["delete", "empty", "symlink", "fifo", "directory", "dev-zero"]), label="how")
    if path.is_symlink() or not path.is_file():
        return f"{name}: {how}: not a file after an earlier corruption"
    if how == "delete":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
        _record(directory, name)
    else:
        make_not_a_file(path, how)
    return f"{name}: {how}"


def _serve_every_pack(build_dir: Path, images: Path) -> None:
    from prepack.training.vision_dataset import ImagePackedDataset

    dataset = ImagePackedDataset(build_dir, images)
    for index in range(len(dataset)):
        served = dataset[index]
        assert all(isinstance(image, bytes) for image in served["images"])


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("FUZZ_IMAGE_CASES", 200)), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupted_image_set_is_a_named_error_or_a_finding(valid, data):
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(valid / "prepared" / "images", Path(tmp) / "images"))
        for _ in range(data.draw(st.integers(1, 3))):
            data.draw(corruptions(copy), label="corruption")  # hypothesis reports each with a failure
        readers = {
            "read_image_set": lambda: read_image_set(copy),
            "read_image_set(verify)": lambda: read_image_set(copy, verify=True),
            "verify_images(decode)": lambda: verify_images(valid / "build", copy, decode=True),
            "ImagePackedDataset": lambda: _serve_every_pack(valid / "build", copy),
        }
        faulthandler.dump_traceback_later(60, exit=True)  # a reader that hangs fails the run
        try:
            for reader in readers.values():  # each ends in its result or a PrepackError, nothing else
                try:
                    reader()
                except PrepackError:
                    pass
        finally:
            faulthandler.cancel_dump_traceback_later()
