"""Image-chat corpora and image sets: placeholder counts from headers equal the image processor's own,
images stored once by sha256, limits and bad images refused by file, row and column, the same bytes twice,
and `read_image_set(verify=True)` catching every kind of tampering."""

from __future__ import annotations

import hashlib
import io
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from prepack.errors import FormatError, InputError, OutputError
from prepack.formats.images import IMAGES_FILE, ImageLimits, read_image_set, smart_resize
from prepack.sources.images import prepare_image_chat, processor_rule
from tests.vision_inputs import PHOTOS, SAMPLE_DATA, image_processor, photo_bytes, processor_directory


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return processor_directory(tmp_path_factory.mktemp("proc") / "processor")


def chats(directory, records) -> object:
    corpus = directory / "chats.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    return corpus


def with_image(path: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "Hi"}]},
                         {"role": "assistant", "content": "Hello"}]}


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000))
def test_smart_resize_is_transformers_own(height, width):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    try:
        expected = reference(height, width, 28, 28 * 28 * 2, 28 * 28 * 8)
    except ValueError:
        with pytest.raises(ValueError):
            smart_resize(height, width, 28, 28 * 28 * 2, 28 * 28 * 8)
        return
    assert smart_resize(height, width, 28, 28 * 28 * 2, 28 * 28 * 8) == expected


def test_placeholders_from_the_header_equal_the_processors_grid(processor):
    """No pixel decoded at prepare time, yet the count is what the image processor makes of the pixels."""
    rule, placeholder_id = processor_rule(processor)
    reference = image_processor("qwen2_5_vl")
    for data in photo_bytes():
        with Image.open(io.BytesIO(data)) as image:
            grid = reference(images=[image.convert("RGB")])["image_grid_thw"][0]
            size = image.size
        assert rule.placeholders(*size) == int(np.prod(grid)) // 4
    assert placeholder_id > 50256  # an added special token


def test_prepare_stores_each_image_once_and_writes_the_same_bytes_twice(processor, tmp_path):
    (tmp_path / "p").mkdir()
    for name in PHOTOS:
        (tmp_path / "p" / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    records = [with_image(f"p/{PHOTOS[row % 3]}") for row in range(7)]
    records.append({"messages": [{"role": "user", "content": "<image><image> two?"}, {"role": "assistant", "content": "x"}],
                    "images": [f"p/{PHOTOS[0]}", f"p/{PHOTOS[1]}"]})
    corpus = chats(tmp_path, records)
    first = prepare_image_chat(corpus, processor, tmp_path / "one")
    prepare_image_chat(corpus, processor, tmp_path / "two")
    for name in ("corpus.parquet", "images/images.arrow", "images/documents.arrow", "images/images.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert (first.images, first.references, first.documents) == (3, 9, 8)
    image_set = read_image_set(first.image_set, verify=True)
    assert image_set.images_of(7).tolist() == [0, 1]
    digests = {image_set.sha256[n].as_py() for n in range(3)}
    assert digests == {hashlib.sha256((SAMPLE_DATA / name).read_bytes()).digest() for name in PHOTOS}
    rule, _ = processor_rule(processor)
    expected = rule.start + rule.placeholder * int(image_set.tokens[0]) + rule.end
    messages = pq.read_table(first.corpus).column("messages").to_pylist()
    assert messages[0][0]["content"] == expected + "Hi"
    with pytest.raises(OutputError, match="exists"):
        prepare_image_chat(corpus, processor, tmp_path / "one")


def test_images_as_bytes_in_a_parquet_column(processor, tmp_path):
    data = photo_bytes()
    table = pa.table({
        "messages": [[{"role": "user", "content": "<image> a"}, {"role": "assistant", "content": "b"}]] * 2,
        "images": [[{"bytes": data[1], "path": None}], [{"bytes": data[2], "path": None}]],
    })
    pq.write_table(table, tmp_path / "chats.parquet")
    summary = prepare_image_chat(tmp_path / "chats.parquet", processor, tmp_path / "out")
    assert (summary.images, summary.references) == (2, 2)


@pytest.mark.parametrize(
    ("record", "limits", "message"),
    [
        (with_image("https://example.com/a.png"), None, "row 0, column messages\\[0\\].content: .*URI"),
        (with_image("missing.png"), None, "row 0, column messages\\[0\\].content: the image .* cannot be read"),
        (with_image("p/not-an-image.png"), None, "not a readable image"),
        (with_image(f"p/{PHOTOS[0]}"), ImageLimits(max_image_bytes=1000), "more than the limit 1000"),
        (with_image(f"p/{PHOTOS[0]}"), ImageLimits(max_pixels=1000), "more than the limit of 1000 pixels"),
        ({"messages": [{"role": "user", "content": "<image><image>"}], "images": [f"p/{PHOTOS[0]}"] * 2},
         ImageLimits(max_images_per_document=1), "more than 1 images"),
        ({"messages": [{"role": "user", "content": "<image>"}], "images": []}, None, "images column has no more"),
        ({"messages": [{"role": "user", "content": "no marker"}], "images": [f"p/{PHOTOS[0]}"]}, None,
         "1 images that no message places"),
        # A header Pillow reads, pixels it cannot: refused here, not in the training DataLoader.
        (with_image("p/truncated.png"), None, "row 0, column messages\\[0\\].content: the image cannot be decoded"),
        (with_image("p/truncated.jpg"), None, "row 0, column messages\\[0\\].content: the image cannot be decoded"),
    ],
)
def test_bad_images_are_refused_by_row_and_column(processor, tmp_path, record, limits, message):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / PHOTOS[0]).write_bytes((SAMPLE_DATA / PHOTOS[0]).read_bytes())
    (tmp_path / "p" / "not-an-image.png").write_text("hello")
    png, jpeg = (SAMPLE_DATA / PHOTOS[1]).read_bytes(), (SAMPLE_DATA / PHOTOS[0]).read_bytes()
    (tmp_path / "p" / "truncated.png").write_bytes(png[: len(png) // 2])
    (tmp_path / "p" / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    corpus = chats(tmp_path, [record])
    with pytest.raises(InputError, match=message):
        prepare_image_chat(corpus, processor, tmp_path / "out", limits=limits)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))  # nothing half-written


@pytest.fixture
def image_set_dir(processor, tmp_path):
    data = photo_bytes()
    table = pa.table({"messages": [[{"role": "user", "content": "<image>"}]] * 3,
                      "images": [[{"bytes": d, "path": None}] for d in data]})
    pq.write_table(table, tmp_path / "chats.parquet")
    return prepare_image_chat(tmp_path / "chats.parquet", processor, tmp_path / "out").image_set


def rewrite_images(directory, column: str, row: int, value) -> None:
    """Replace one value of images.arrow and fix the manifest's size and sha256, as a careful forger would."""
    from prepack.sources.images import _write_batch  # the writer's own framing

    reader = pa.ipc.open_stream((directory / IMAGES_FILE).read_bytes())
    table = reader.read_all()
    values = table.column(column).to_pylist()
    values[row] = value
    field = table.schema.field(column)
    table = table.set_column(table.schema.get_field_index(column), field, pa.array(values, field.type))
    written = _write_batch(directory / IMAGES_FILE, table.to_batches()[0])
    manifest = json.loads((directory / "images.json").read_text())
    manifest["files"][0] = json.loads(written.model_dump_json())
    (directory / "images.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("data", b"\x89PNG-other-bytes", "do not have the sha256"),
        ("tokens", 1, "the rule gives|image_tokens is not the sum"),
        ("width", 10**6, "outside the set's limits|rule gives"),
    ],
)
def test_verify_catches_a_tampered_image_set(image_set_dir, column, value, message):
    read_image_set(image_set_dir, verify=True)
    rewrite_images(image_set_dir, column, 1, value)
    with pytest.raises(FormatError, match=message):
        read_image_set(image_set_dir, verify=True)


def test_the_set_keeps_the_sha256_of_the_images_json_it_read(image_set_dir):
    import hashlib

    expected = hashlib.sha256((image_set_dir / "images.json").read_bytes()).hexdigest()
    assert read_image_set(image_set_dir).manifest_sha256 == expected


def test_verify_catches_a_changed_file(image_set_dir):
    path = image_set_dir / IMAGES_FILE
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="sha256"):
        read_image_set(image_set_dir, verify=True)


def test_an_unknown_image_processor_is_refused(processor, tmp_path):
    import shutil

    other = tmp_path / "proc"
    shutil.copytree(processor, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config["image_processor_type"] = "SomeOtherImageProcessor"
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="SomeOtherImageProcessor"):
        processor_rule(other)


@pytest.mark.slow
def test_a_text_corpus_with_an_images_column_builds_and_serves_its_images(processor, tmp_path):
    from prepack.training.vision_dataset import ImagePackedDataset
    from tests.cli import run_prepack

    data = photo_bytes()
    table = pa.table({
        "text": ["<image> a blue pack", "no image here", "<image> and <image>: two"],
        "images": [[{"bytes": data[1], "path": None}], [], [{"bytes": data[0], "path": None}, {"bytes": data[2], "path": None}]],
    })
    pq.write_table(table, tmp_path / "texts.parquet")
    summary = prepare_image_chat(tmp_path / "texts.parquet", processor, tmp_path / "out")
    assert pq.read_table(summary.corpus).column_names == ["text"]
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--max-len", 64, "--overflow", "error",
                         "--out", tmp_path / "build")
    assert result.returncode == 0, result.stderr
    dataset = ImagePackedDataset(tmp_path / "build", summary.image_set)
    served = sorted(len(dataset[i]["images"]) for i in range(len(dataset)))
    assert sum(served) == 3 and summary.image_tokens > 0


@pytest.mark.parametrize(
    ("model_type", "processor_config", "tokens"),
    [
        ("gemma3", {"image_seq_length": 4}, ("<start_of_image>", "<image_soft_token>", "<end_of_image>")),
        ("llava", {"patch_size": 14, "vision_feature_select_strategy": "default"}, ("<image>",)),
        ("internvl", {"image_seq_length": 4, "processor_class": "InternVLProcessor"},
         ("<img>", "<IMG_CONTEXT>", "</img>")),
        pytest.param("gemma3n", {"image_seq_length": 4, "processor_class": "Gemma3nProcessor"},
                     ("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
                     marks=pytest.mark.slow),  # its config imports timm, seconds
    ],
)
def test_fixed_size_processors_count_what_the_tiny_towers_take(tmp_path, model_type, processor_config, tokens):
    """Gemma 3's, LLaVA's, InternVL's and Gemma 3n's processor directories give the placeholder count their towers make
    (`VisionSpec.of` on the tiny model's config), whatever the image's size."""
    from tokenizers import Tokenizer

    from prepack.model.tiny_vision_models import tiny_vision_config
    from prepack.training.vision_collate import VisionSpec
    from tests.demo_inputs import CHATML, gpt2_directory

    directory = gpt2_directory(tmp_path / "proc", CHATML)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(list(tokens))
    tokenizer.save(str(directory / "tokenizer.json"))
    image_processor(model_type).save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps(processor_config))
    rule, placeholder_id = processor_rule(directory)
    expected = VisionSpec.of(tiny_vision_config(model_type)).tokens_per_image
    assert [rule.placeholders(*size) for size in ((512, 600), (128, 128), (542, 130))] == [expected] * 3
    assert placeholder_id == tokenizer.token_to_id(rule.placeholder)


def rewrite_documents(directory, references: list[list[int]]) -> None:
    """Replace documents.arrow (and its size and sha256 in the manifest)."""
    from prepack.formats.images import DOCUMENTS_FILE, DOCUMENTS_SCHEMA
    from prepack.sources.images import _write_batch

    batch = pa.record_batch([pa.array(references, DOCUMENTS_SCHEMA.field(0).type)], schema=DOCUMENTS_SCHEMA)
    written = _write_batch(directory / DOCUMENTS_FILE, batch)
    manifest = json.loads((directory / "images.json").read_text())
    manifest["files"][1] = json.loads(written.model_dump_json())
    manifest["references"] = sum(map(len, references))
    (directory / "images.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("references", "message"),
    [
        ([[0], [1], [7]], "refers to image 7; the set holds 3"),
        ([[0], [1], [2, 2]], "image_tokens is not the sum"),
        ([[0], [1]], "3 rows; the files hold 3 and 2"),
    ],
)
def test_a_hostile_documents_file_is_refused_before_use(image_set_dir, references, message):
    rewrite_documents(image_set_dir, references)
    with pytest.raises(FormatError, match=message):
        read_image_set(image_set_dir)


def test_an_unknown_image_set_version_is_refused(image_set_dir):
    manifest = json.loads((image_set_dir / "images.json").read_text())
    manifest["image_set_version"] = 2
    (image_set_dir / "images.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="image_set_version 2 is not one this prepack reads"):
        read_image_set(image_set_dir)


def test_the_prepare_images_command(processor, tmp_path):
    from tests.cli import WIDE, failure, run_prepack

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / PHOTOS[1]).write_bytes((SAMPLE_DATA / PHOTOS[1]).read_bytes())
    corpus = chats(tmp_path, [with_image(f"p/{PHOTOS[1]}"), with_image("p/missing.png")])
    refused = run_prepack("prepare-images", corpus, "--processor", processor, "--out", tmp_path / "bad", env=WIDE)
    assert "row 1, column messages[0].content: the image" in failure(refused)
    good = chats(tmp_path / "p", [with_image(PHOTOS[1])])
    done = run_prepack("prepare-images", good, "--processor", processor, "--out", tmp_path / "out", "--max-images", 2)
    assert done.returncode == 0 and "prepared 1 records, 1 images (1 distinct" in done.stdout
    assert read_image_set(tmp_path / "out" / "images", verify=True).manifest.limits.max_images_per_document == 2
    too_large = run_prepack("prepare-images", good, "--processor", processor, "--out", tmp_path / "x",
                            "--max-images", 10**6, env=WIDE)
    assert "A limit is out of range" in failure(too_large)


def edited_processor(processor, tmp_path, file: str, edit) -> object:
    """A copy of the processor directory whose `file` (a JSON config) `edit` changed in place."""
    import shutil

    other = tmp_path / "edited"
    shutil.copytree(processor, other)
    config = json.loads((other / file).read_text())
    edit(config)
    (other / file).write_text(json.dumps(config))
    return other


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("preprocessor_config.json", lambda c: c["size"].update(shortest_edge=0), "size.shortest_edge is 0"),
        ("preprocessor_config.json", lambda c: c["size"].update(longest_edge=-5), "size.longest_edge is -5"),
        ("preprocessor_config.json", lambda c: c.update(patch_size=0), "patch_size is 0"),
        ("preprocessor_config.json", lambda c: c.update(merge_size=-2), "merge_size is -2"),
        ("preprocessor_config.json", lambda c: c.update(patch_size="14"), "patch_size is '14'"),
        ("preprocessor_config.json", lambda c: c.update(size="large"), "size is 'large'"),
        ("preprocessor_config.json", lambda c: c.update(image_processor_type=7), "image_processor_type 7"),
        ("preprocessor_config.json", lambda c: c["size"].update(shortest_edge=10**7), "more than size.longest_edge"),
    ],
)
def test_a_processor_config_with_an_unusable_size_is_a_named_error(processor, tmp_path, file, edit, message):
    edited = edited_processor(processor, tmp_path, file, edit)
    with pytest.raises(InputError, match=re.escape(f"{edited / file}: ") + ".*" + re.escape(message)):
        processor_rule(edited)


@pytest.mark.parametrize(
    ("processor_config", "message"),
    [({"patch_size": 0}, "patch_size is 0"), ({"patch_size": 1000}, "no image tokens"),
     ({"image_seq_length": 0}, "image_seq_length is 0")],
)
def test_a_fixed_size_processor_config_with_an_unusable_size_is_a_named_error(tmp_path, processor_config, message):
    from tests.demo_inputs import CHATML, gpt2_directory

    model_type = "gemma3" if "image_seq_length" in processor_config else "llava"
    directory = gpt2_directory(tmp_path / "proc", CHATML)
    image_processor(model_type).save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps(processor_config))
    with pytest.raises(InputError, match=re.escape(message)):
        processor_rule(directory)


@pytest.mark.parametrize("tokenizer", [None, "{not json", '{"version": "1.0"}'], ids=["missing", "broken", "not-one"])
def test_a_processor_without_a_usable_tokenizer_is_a_named_error(processor, tmp_path, tokenizer):
    import shutil

    other = shutil.copytree(processor, tmp_path / "proc")
    if tokenizer is None:
        (other / "tokenizer.json").unlink()
    else:
        (other / "tokenizer.json").write_text(tokenizer)
    with pytest.raises(InputError, match="tokenizer.json"):
        processor_rule(other)


def test_a_corpus_that_is_not_utf8_is_refused_by_row(processor, tmp_path):
    corpus = tmp_path / "chats.jsonl"
    corpus.write_bytes(json.dumps(with_image("a.png")).encode() + b"\n" + b'{"text": "caf\xe9 <image>"}\n')
    with pytest.raises(InputError, match=re.escape(f"{corpus}, row 1: not valid JSON")):
        prepare_image_chat(corpus, processor, tmp_path / "out")


def test_out_under_a_missing_directory_is_made(processor, tmp_path):
    good = chats(tmp_path, [{"text": "no image"}])
    summary = prepare_image_chat(good, processor, tmp_path / "not" / "yet" / "out")
    assert summary.documents == 1 and (tmp_path / "not" / "yet" / "out" / "images" / "images.json").is_file()


@pytest.mark.slow
def test_a_second_run_to_the_same_out_is_refused_by_name(processor, tmp_path):
    """Exclusive: while one run holds --out, another is refused at once; after it, --out exists."""
    from prepack.storage.output import output_lock

    good = chats(tmp_path, [{"text": "no image"}])
    with output_lock(tmp_path / "out"):
        with pytest.raises(OutputError, match="another prepack build is writing"):
            prepare_image_chat(good, processor, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    prepare_image_chat(good, processor, tmp_path / "out")
    with pytest.raises(OutputError, match="exists"):
        prepare_image_chat(good, processor, tmp_path / "out")


def sharegpt(images: list[str], system: str | None = None) -> dict:
    """A LlamaFactory (ShareGPT-style) multimodal record."""
    record = {"conversations": [{"from": "human", "value": "<image>" * len(images) + "What is it?"},
                                {"from": "gpt", "value": "A photo."}], "images": images}
    return record if system is None else {**record, "system": system}


@pytest.mark.parametrize("layout", ["jsonl", "json-array"])
def test_llamafactory_sharegpt_records_are_read_as_chats(processor, tmp_path, layout):
    for name in PHOTOS[:2]:
        (tmp_path / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    records = [sharegpt([PHOTOS[0]], system="Be brief."), sharegpt([PHOTOS[0], PHOTOS[1]]), sharegpt([])]
    if layout == "jsonl":
        corpus = chats(tmp_path, records)
    else:  # LlamaFactory's own files (mllm_demo.json): one JSON array
        corpus = tmp_path / "mllm_demo.json"
        corpus.write_text(json.dumps(records, indent=2))
    summary = prepare_image_chat(corpus, processor, tmp_path / "out")
    assert (summary.documents, summary.references, summary.images) == (3, 3, 2)
    image_set = read_image_set(summary.image_set, verify=True)
    rule, _ = processor_rule(processor)
    rows = pq.read_table(summary.corpus).column("messages").to_pylist()
    assert [message["role"] for message in rows[0]] == ["system", "user", "assistant"]
    assert rows[0][0]["content"] == "Be brief." and rows[0][2]["content"] == "A photo."
    expected = rule.start + rule.placeholder * int(image_set.tokens[0]) + rule.end
    assert rows[0][1]["content"] == expected + "What is it?"
    assert [message["role"] for message in rows[2]] == ["user", "assistant"]


def test_an_unknown_sharegpt_speaker_is_refused_by_row_and_column(processor, tmp_path):
    record = {"conversations": [{"from": "human", "value": "hi"}, {"from": "narrator", "value": "x"}]}
    corpus = chats(tmp_path, [record])
    with pytest.raises(InputError, match=re.escape(f"{corpus}, row 0, column conversations[1].from: 'narrator'")):
        prepare_image_chat(corpus, processor, tmp_path / "out")


def test_a_hugging_face_save_to_disk_folder_is_read(processor, tmp_path):
    """`datasets`' Image feature: stored as {bytes, path} structs in the folder's Arrow files."""
    import datasets

    for name in PHOTOS:
        (tmp_path / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "images": datasets.Sequence(datasets.Image()),
    })
    chat = [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "a photo"}]
    rows = {"messages": [chat] * 3, "images": [[str(tmp_path / name)] for name in PHOTOS]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(tmp_path / "saved")
    summary = prepare_image_chat(tmp_path / "saved", processor, tmp_path / "out")
    assert (summary.documents, summary.images) == (3, 3)
    image_set = read_image_set(summary.image_set, verify=True)
    assert {image_set.data(n) for n in range(3)} == set(photo_bytes())


@pytest.mark.slow
def test_memory_holds_one_image_not_all_of_them(processor, tmp_path):
    """Each image goes to the output as it is read: the Python heap's peak stays near one image's size,
    not the sum of the images' (tracemalloc; Pillow's pixels and Arrow's buffers are outside it, and an
    image's bytes are the part that grows with the corpus)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    names = []
    for number in range(24):  # noise does not compress: ~300 kB each
        name = f"noise-{number}.png"
        Image.fromarray(rng.integers(0, 256, size=(320, 320, 3), dtype=np.uint8)).save(tmp_path / name)
        names.append(name)
    one = max((tmp_path / name).stat().st_size for name in names)
    corpus = chats(tmp_path, [with_image(name) for name in names])
    processor_rule(processor)  # the tokenizer's own allocations, once, outside the measure
    tracemalloc.start()
    try:
        summary = prepare_image_chat(corpus, processor, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert summary.images == 24
    assert peak < 4 * one + 4 * 2**20, (peak, one)  # the images together are 24 * one


@pytest.mark.slow
def test_prepare_images_refuses_by_name_from_the_command_line(processor, tmp_path):
    """The command's refusals (exit 2, one line, no traceback) for each kind of input that crashed it."""
    from tests.cli import WIDE, failure, run_prepack

    bad_utf8 = tmp_path / "bad.jsonl"
    bad_utf8.write_bytes(b'{"text": "caf\xe9"}\n')
    nul = chats(tmp_path, [with_image("a\0b.png")])
    zero = edited_processor(processor, tmp_path, "preprocessor_config.json", lambda c: c.update(patch_size=0))
    cases = [(bad_utf8, processor, "row 0: not valid JSON"), (nul, processor, "NUL"), (nul, zero, "patch_size is 0")]
    for corpus, directory, message in cases:
        result = run_prepack("prepare-images", corpus, "--processor", directory, "--out", tmp_path / "out", env=WIDE)
        assert message in failure(result)
        assert not (tmp_path / "out").exists()


def expanded_by_the_processor(processor, rule, image_prompt: str, **options):
    """Each of many images, of awkward sizes, through `processor` with the prompt "a {image_prompt} b": yields the
    image's bytes, its (width, height), the processor's output and its ids, once the rule's text for that image, set
    in the prompt, has been asserted to be the text the processor expands it to and to tokenize to those ids."""
    from tests.vision_inputs import images_of_many_sizes

    for data in images_of_many_sizes():
        with Image.open(io.BytesIO(data)) as image:
            picture, size = image.convert("RGB"), image.size
        out = processor(images=[picture], text=[f"a {image_prompt} b"], return_tensors="np", **options)
        expected = out["input_ids"][0].tolist()
        text = "a " + rule.text(*size) + " b"
        assert processor.tokenizer.decode(expected) == text
        assert processor.tokenizer(text)["input_ids"] == expected
        yield data, size, out, expected


def internvl_directory(directory, image_seq_length: int = 4, **image_options):
    """An InternVL processor directory (InternVLProcessor's tokens, GOT-OCR2's image processor at 56 pixels) and
    transformers' own InternVLProcessor over the same parts."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from tests.vision_inputs import family_processor_directory, internvl_processor

    parts = GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, **image_options)
    tokens = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
              "video_token": "<video>"}
    directory, tokenizer = family_processor_directory(
        directory, tokens, parts, {"image_seq_length": image_seq_length, "processor_class": "InternVLProcessor"})
    return directory, internvl_processor(parts, tokenizer, image_seq_length)


def test_internvl_placeholders_and_text_are_the_processors_own(tmp_path):
    """InternVL untiled (crop_to_patches false, as its image processor's config says): `<img>`, image_seq_length
    `<IMG_CONTEXT>`, `</img>` per image, whatever its size; the expanded text tokenizes to the ids
    InternVLProcessor gives the same prompt."""
    directory, processor = internvl_directory(tmp_path / "proc", crop_to_patches=False)
    rule, placeholder_id = processor_rule(directory)
    assert placeholder_id == processor.image_token_id
    for _, size, out, ids in expanded_by_the_processor(processor, rule, "<IMG_CONTEXT>", crop_to_patches=False):
        assert rule.placeholders(*size) == ids.count(placeholder_id) == 4
        assert len(out["pixel_values"]) == 1


@pytest.mark.parametrize("patches", [(1, 12), (1, 4), (2, 6)])
def test_internvl_tiled_placeholders_and_text_are_the_processors_own(tmp_path, patches):
    """InternVL tiled (crop_to_patches true, InternVLProcessor's default): image_seq_length placeholders per view, the
    views being the tiles of the canvas nearest the image's shape (min_patches to max_patches tiles) and, when there
    is more than one tile, a thumbnail; the expanded text tokenizes to InternVLProcessor's ids."""
    min_patches, max_patches = patches
    directory, processor = internvl_directory(tmp_path / "proc", crop_to_patches=True, min_patches=min_patches,
                                              max_patches=max_patches)
    rule, placeholder_id = processor_rule(directory)
    views = set()
    for _, size, out, ids in expanded_by_the_processor(processor, rule, "<IMG_CONTEXT>"):
        assert rule.placeholders(*size) == ids.count(placeholder_id) == 4 * len(out["pixel_values"])
        views.add(len(out["pixel_values"]))
    assert len(views) > 1  # the sizes exercise several canvases


def test_non_square_internvl_tiles_and_other_got_ocr2_processors_are_refused(tmp_path):
    """Tiles of another shape than square are refused by their field, as is GOT-OCR2's own processor, which shares
    the image processor."""
    directory, _ = internvl_directory(tmp_path / "tiled", crop_to_patches=True)
    config = json.loads((directory / "preprocessor_config.json").read_text())
    (directory / "preprocessor_config.json").write_text(json.dumps(config | {"size": {"height": 56, "width": 84}}))
    with pytest.raises(InputError, match="preprocessor_config.json: size"):
        processor_rule(directory)
    other, _ = internvl_directory(tmp_path / "got", crop_to_patches=False)
    config = json.loads((other / "processor_config.json").read_text())
    (other / "processor_config.json").write_text(json.dumps(config | {"processor_class": "GotOcr2Processor"}))
    with pytest.raises(InputError, match="GotOcr2Processor"):
        processor_rule(other)


def mistral3_directory(directory, longest_edge: int = 112):
    """A Mistral 3 processor directory (PixtralProcessor's tokens, patch 14 merged 2x2, Pixtral's image processor up
    to `longest_edge` pixels) and transformers' own PixtralProcessor over the same parts."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from tests.vision_inputs import family_processor_directory, pixtral_processor

    parts = PixtralImageProcessorPil(size={"longest_edge": longest_edge}, patch_size={"height": 14, "width": 14})
    tokens = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    directory, tokenizer = family_processor_directory(
        directory, tokens, parts, {"patch_size": 14, "spatial_merge_size": 2, "processor_class": "PixtralProcessor"})
    return directory, pixtral_processor(parts, tokenizer, 14, 2)


def test_the_pixtral_processors_stand_in_module_is_given_back(tmp_path):
    """Building transformers' PixtralProcessor without torchvision leaves no PIL module under the torchvision
    module's name for later imports to find."""
    import sys

    import transformers.models.pixtral.image_processing_pil_pixtral as pil

    mistral3_directory(tmp_path / "mistral3")
    assert sys.modules.get("transformers.models.pixtral.image_processing_pixtral") is not pil


@pytest.mark.parametrize("longest_edge", [112, 1540])
def test_mistral3_placeholders_and_text_are_the_processors_own(tmp_path, longest_edge):
    """Mistral 3 (Pixtral's image processor): an image resized within longest_edge to whole 28-pixel cells becomes a
    row of `[IMG]` per cell row, each row but the last closed by `[IMG_BREAK]`, the last by `[IMG_END]`; the count
    is the `[IMG]` tokens, which the tower fills. The expanded text and its ids are PixtralProcessor's own, and the
    count is what its image processor's image_sizes give."""
    directory, processor = mistral3_directory(tmp_path / "proc", longest_edge)
    rule, placeholder_id = processor_rule(directory)
    assert placeholder_id == processor.image_token_id
    counts = set()
    for _, size, out, ids in expanded_by_the_processor(processor, rule, "[IMG]"):
        height, width = out["image_sizes"][0]
        assert rule.placeholders(*size) == ids.count(placeholder_id) == (height // 28) * (width // 28)
        counts.add(rule.placeholders(*size))
    assert len(counts) > 2  # the sizes exercise more than one grid


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([(28, 112), (28, 1540), (16, 1024)]))
def test_pixtral_grid_is_transformers_own(height, width, cell_and_edge):
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    from prepack.formats.images import pixtral_grid

    cell, edge = cell_and_edge
    resized = get_resize_output_image_size(np.zeros((3, height, width)), (edge, edge), (cell, cell), "channels_first")
    assert pixtral_grid(height, width, cell, edge) == (resized[0] // cell, resized[1] // cell)


def test_a_rows_rule_leaves_the_earlier_kinds_manifests_as_they_were(processor, tmp_path):
    """Fields the rows kind added (longest_edge, row_end) are written for it only: a grid rule's manifest is
    byte-identical to what earlier releases wrote."""
    rule, _ = processor_rule(processor)
    assert {"longest_edge", "row_end"}.isdisjoint(json.loads(rule.model_dump_json()))
    rows, _ = processor_rule(mistral3_directory(tmp_path / "proc")[0])
    assert json.loads(rows.model_dump_json())["row_end"] == "[IMG_BREAK]"


def test_a_pixtral_processor_without_a_longest_edge_is_refused(tmp_path):
    directory, _ = mistral3_directory(tmp_path / "proc")
    config = json.loads((directory / "preprocessor_config.json").read_text())
    config["size"] = {"height": 112, "width": 112}
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="preprocessor_config.json: size.longest_edge is missing"):
        processor_rule(directory)


GLM4V_TOKENS = {"image_token": "<|image|>", "begin_image": "<|begin_of_image|>", "end_image": "<|end_of_image|>"}


def glm4v_directory(directory, size: dict):
    """A GLM-4V processor directory (its image tokens, its image processor with patch 14 merged 2x2 over 2 frames,
    `size` in pixels) and transformers' own Glm4vProcessor over the same parts."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from tests.vision_inputs import family_processor_directory, glm4v_processor

    parts = Glm4vImageProcessorPil(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    directory, tokenizer = family_processor_directory(directory, GLM4V_TOKENS, parts,
                                                      {"processor_class": "Glm4vProcessor"})
    return directory, glm4v_processor(parts, tokenizer)


@pytest.mark.parametrize("size", [{"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000},
                                  {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}])
def test_glm4v_placeholders_and_text_are_the_processors_own(tmp_path, size):
    """GLM-4V's image processor resizes by its own rule (a small side scaled up first, the area counted over two
    frames): `<|begin_of_image|>`, the grid's `<|image|>` tokens, `<|end_of_image|>`, as its chat template writes
    them and Glm4vProcessor expands them; the count is its image_grid_thw's over the 2x2 merge. GLM-4V-MoE's
    processor is the same."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    assert PROCESSOR_MAPPING_NAMES["glm4v_moe"] == "Glm4vProcessor"

    directory, processor = glm4v_directory(tmp_path / "proc", size)
    rule, placeholder_id = processor_rule(directory)
    assert placeholder_id == processor.image_token_id
    counts = set()
    image_prompt = "<|begin_of_image|><|image|><|end_of_image|>"
    for _, image_size, out, ids in expanded_by_the_processor(processor, rule, image_prompt):
        grid = out["image_grid_thw"][0]
        assert rule.placeholders(*image_size) == ids.count(placeholder_id) == int(np.prod(grid)) // 4
        counts.add(rule.placeholders(*image_size))
    assert len(counts) > 2  # the sizes exercise more than one grid


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000), st.sampled_from([(28 * 28 * 2, 28 * 28 * 8), (112 * 112, 28 * 28 * 15000)]))
def test_glm4v_resize_is_transformers_own(height, width, bounds):
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as reference

    from prepack.formats.images import glm4v_resize

    try:
        expected = reference(2, height, width, 2, 28, *bounds)
    except ValueError:
        with pytest.raises(ValueError):
            glm4v_resize(height, width, 28, *bounds, 2)
        return
    assert glm4v_resize(height, width, 28, *bounds, 2) == expected


def paligemma_directory(directory):
    """A PaliGemma processor directory (its `<image>` token, BOS and EOS; SigLIP's image processor at 56 pixels with
    image_seq_length 16) and transformers' own PaliGemmaProcessor over the same parts."""
    from transformers.models.paligemma.processing_paligemma import PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from tests.vision_inputs import family_processor_directory

    parts = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    parts.image_seq_length = 16  # as PaliGemma's preprocessor_config.json records it
    directory, tokenizer = family_processor_directory(directory, {"image_token": "<image>"}, parts,
                                                      {"processor_class": "PaliGemmaProcessor"},
                                                      {"bos_token": "<bos>", "eos_token": "<eos>"})
    return directory, PaliGemmaProcessor(image_processor=parts, tokenizer=tokenizer)


def test_paligemma_placeholders_text_and_token_types_are_the_processors_own(tmp_path):
    """PaliGemma: image_seq_length `<image>` per image whatever its size, then PaliGemmaProcessor's BOS, prompt and
    newline (a corpus writes those itself); with a suffix, the token types VisionCollator derives from the labels
    (0 before the first target) are the processor's own."""
    from prepack.training.vision_collate import VisionCollator, VisionSpec
    from tests.vision_inputs import images_of_many_sizes

    directory, processor = paligemma_directory(tmp_path / "proc")
    rule, placeholder_id = processor_rule(directory)
    assert placeholder_id == processor.image_token_id
    collator = VisionCollator(VisionSpec("prefix blocks", placeholder_id, tokens_per_image=16),
                              processor.image_processor, pad_token_id=0)
    for data in images_of_many_sizes():
        with Image.open(io.BytesIO(data)) as image:
            picture, size = image.convert("RGB"), image.size
        out = processor(images=[picture], text=["<image>caption es"], suffix=["a cat"], return_tensors="np")
        expected = out["input_ids"][0].tolist()
        prompt = rule.text(*size) + "<bos>caption es\n"
        assert processor.tokenizer.decode(expected) == prompt + "a cat<eos>"
        assert processor.tokenizer(prompt)["input_ids"] == expected[: len(processor.tokenizer(prompt)["input_ids"])]
        assert rule.placeholders(*size) == expected.count(placeholder_id) == 16
        pack = {"input_ids": out["input_ids"][0], "cu_seqlens": np.array([0, len(expected)]),
                "labels": out["labels"][0], "images": [data]}
        assert collator([pack])["token_type_ids"][0].tolist() == out["token_type_ids"][0].tolist()


def gemma3n_directory(directory, image_seq_length: int = 4):
    """A Gemma 3n processor directory (the image and audio tokens Gemma3nProcessor reads from its tokenizer; SigLIP's
    image processor at 64 pixels, the tiny tower's side) and transformers' own Gemma3nProcessor over the same parts,
    its audio feature extractor built from its defaults."""
    from transformers.models.gemma3n.feature_extraction_gemma3n import Gemma3nAudioFeatureExtractor
    from transformers.models.gemma3n.processing_gemma3n import Gemma3nProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from tests.vision_inputs import family_processor_directory

    parts = SiglipImageProcessorPil(size={"height": 64, "width": 64})
    tokens = {**GEMMA_IMAGE_TOKENS,
              "audio_token": "<audio_soft_token>", "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>"}
    directory, tokenizer = family_processor_directory(
        directory, tokens, parts, {"image_seq_length": image_seq_length, "processor_class": "Gemma3nProcessor"})
    return directory, Gemma3nProcessor(feature_extractor=Gemma3nAudioFeatureExtractor(), image_processor=parts,
                                       tokenizer=tokenizer, image_seq_length=image_seq_length)


def gemma3_directory(directory, image_seq_length: int = 4):
    """A Gemma 3 processor directory (Gemma 3's image processor at 64 pixels, the image tokens Gemma3Processor reads
    from its tokenizer) and transformers' own Gemma3Processor over the same parts."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    from tests.vision_inputs import family_processor_directory

    parts = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    directory, tokenizer = family_processor_directory(directory, GEMMA_IMAGE_TOKENS, parts,
                                                      {"image_seq_length": image_seq_length})
    return directory, Gemma3Processor(image_processor=parts, tokenizer=tokenizer, image_seq_length=image_seq_length)


# The image tokens Gemma 3's and Gemma 3n's processors read from their tokenizers.
GEMMA_IMAGE_TOKENS = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}


@pytest.mark.parametrize("image_seq_length", [4, pytest.param(256, marks=pytest.mark.slow)])  # 256: its processor's default
@pytest.mark.parametrize("made", [gemma3_directory, gemma3n_directory], ids=["gemma3", "gemma3n"])
def test_gemma_placeholders_and_text_are_the_processors_own(tmp_path, made, image_seq_length):
    """Gemma 3 (its own image processor, as Gemma3Processor uses it) and Gemma 3n (SigLIP's, as Gemma3nProcessor uses
    it): image_seq_length `<image_soft_token>` per image whatever its size, between `<start_of_image>` and
    `<end_of_image>` with a blank line each side (the processor's `full_image_sequence`); the expanded text tokenizes
    to the ids the processor gives the same prompt."""
    directory, processor = made(tmp_path / "proc", image_seq_length)
    rule, placeholder_id = processor_rule(directory)
    assert placeholder_id == processor.tokenizer.image_token_id
    for _, size, out, ids in expanded_by_the_processor(processor, rule, processor.image_token):
        assert rule.placeholders(*size) == ids.count(placeholder_id) == image_seq_length
        assert len(out["pixel_values"]) == 1


def test_siglip_for_another_processor_is_refused_by_its_class(tmp_path):
    """SigLIP's image processor serves PaliGemma's and Gemma 3n's processors, counted each by its own rule; under
    another processor class it is refused by name."""
    directory, _ = gemma3n_directory(tmp_path / "proc")
    config = json.loads((directory / "processor_config.json").read_text())
    (directory / "processor_config.json").write_text(json.dumps(config | {"processor_class": "SiglipProcessor"}))
    with pytest.raises(InputError, match="processor_class 'SiglipProcessor'.*PaliGemmaProcessor or Gemma3nProcessor"):
        processor_rule(directory)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([(1, 12), (1, 4), (2, 6), (1, 1), (3, 40)]))
def test_tiled_canvas_is_transformers_own(height, width, tiles):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    from prepack.formats.images import tiled_canvas

    assert tiled_canvas(height, width, 448, *tiles) == get_optimal_tiled_canvas((height, width), (448, 448), *tiles)
# LLaVA-NeXT's tiling (llava-hf/llava-v1.6-*'s processor sizes): the resolutions images are tiled to, 336-pixel tiles.
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# (width, height): photographs' shapes, square, just off a tile, and extreme aspect ratios both ways.
TILED_SIZES = ((640, 480), (480, 640), (336, 336), (337, 335), (1008, 336), (2000, 20), (20, 2000), (3000, 7),
               (7, 3000), (1, 1), (5, 999), (1500, 1499))


@pytest.fixture(scope="module")
def llava_next_directory(tmp_path_factory):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from tests.vision_inputs import transformers_processor_directory

    images = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    processor = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
    return transformers_processor_directory(tmp_path_factory.mktemp("llava-next") / "processor", images, processor,
                                            ("<image>",))


@pytest.mark.slow
def test_llava_next_placeholders_and_text_are_its_processors_own(llava_next_directory):
    """The tiling rule read from a LLaVA-NeXT processor directory expands an image as transformers' LlavaNextProcessor
    (loaded from the same directory) does: the same tokens, from the header alone, at every aspect ratio."""
    from transformers import LlavaNextProcessor

    rule, placeholder_id = processor_rule(llava_next_directory)
    reference = LlavaNextProcessor.from_pretrained(llava_next_directory)
    assert rule.kind == "anyres" and placeholder_id == reference.image_token_id
    for width, height in TILED_SIZES:
        expected = reference(text="a<image>b", images=[Image.new("RGB", (width, height), "gray")])["input_ids"][0]
        got = reference.tokenizer("a" + rule.text(width, height) + "b")["input_ids"]
        assert got == list(expected), (width, height)
        assert rule.placeholders(width, height) == list(expected).count(placeholder_id), (width, height)


def test_llava_next_counts_equal_its_processors_at_any_size(llava_next_directory):
    """Without pixels: the processor's own count (`_get_num_multimodal_tokens`) for any size."""
    from transformers import LlavaNextProcessor

    rule, _ = processor_rule(llava_next_directory)
    reference = LlavaNextProcessor.from_pretrained(llava_next_directory)

    @settings(max_examples=100, deadline=None)
    @given(st.integers(1, 5000), st.integers(1, 5000))
    def counts_agree(width, height):
        expected = reference._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0]
        assert rule.placeholders(width, height) == expected

    counts_agree()


# LLaVA-OneVision's tiling (llava-hf/llava-onevision-qwen2-*'s processor): 384-pixel tiles of 729 features, at most
# about 9 tiles' worth of features kept, pinpoints up to 6x6 tiles.
ONEVISION_PINPOINTS = [[384 * rows, 384 * columns] for rows in range(1, 7) for columns in range(1, 7)]


@pytest.fixture(scope="module")
def onevision_directory(tmp_path_factory):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    from tests.vision_inputs import transformers_processor_directory

    images = LlavaOnevisionImageProcessorPil(size={"height": 384, "width": 384}, image_grid_pinpoints=ONEVISION_PINPOINTS)
    processor = {"num_image_tokens": 729, "vision_aspect_ratio": "anyres_max_9", "vision_feature_select_strategy": "full"}
    return transformers_processor_directory(tmp_path_factory.mktemp("onevision") / "processor", images, processor,
                                            ("<image>", "<video>"))


def onevision_processor(directory):
    """transformers' LlavaOnevisionProcessor with the directory's image processor and processor_config.json, and
    no tokenizer or video processor (its __init__ wants a video processor, which needs torchvision): its own
    counting and expansion methods, which read only these."""
    from transformers import LlavaOnevisionProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    processor = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    processor.image_processor = LlavaOnevisionImageProcessorPil.from_pretrained(directory)
    processor.image_token = "<image>"
    for key, value in json.loads((directory / "processor_config.json").read_text()).items():
        setattr(processor, key, value)
    return processor


@pytest.mark.slow
def test_llava_onevision_placeholders_and_text_are_its_processors_own(onevision_directory):
    """As for LLaVA-NeXT: transformers' LlavaOnevisionProcessor expands one image of a single-image prompt
    (`replace_image_token` on its image processor's output) into the text the rule writes."""
    rule, _ = processor_rule(onevision_directory)
    reference = onevision_processor(onevision_directory)
    assert rule.kind == "anyres"
    for width, height in TILED_SIZES:
        inputs = reference.image_processor(images=[Image.new("RGB", (width, height), "gray")])
        assert reference.replace_image_token(inputs, 0) == rule.text(width, height), (width, height)


@pytest.mark.parametrize("strategy", ["full", "default"])
def test_llava_onevision_counts_equal_its_processors_at_any_size(onevision_directory, tmp_path, strategy):
    """Without pixels: the processor's own count (`_get_num_multimodal_tokens`: "full" keeps the CLS feature,
    "default" takes one off) for any size."""
    directory = edited_processor(onevision_directory, tmp_path, "processor_config.json",
                                 lambda config: config.update(vision_feature_select_strategy=strategy))
    rule, _ = processor_rule(directory)
    reference = onevision_processor(directory)

    @settings(max_examples=50, deadline=None)
    @given(st.integers(1, 8000), st.integers(1, 8000))
    def counts_agree(width, height):
        expected = reference._get_num_multimodal_tokens(image_sizes=[(height, width)])["num_image_tokens"][0]
        assert rule.placeholders(width, height) == expected

    counts_agree()


def test_llava_onevision_refuses_a_record_of_several_images(onevision_directory, tmp_path):
    """Its processor expands an image of a multi-image prompt to the base features only: refused by row, not
    counted as tiles, at the second image, before it is read (here it does not even exist)."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / PHOTOS[0]).write_bytes((SAMPLE_DATA / PHOTOS[0]).read_bytes())
    record = {"messages": [{"role": "user", "content": "<image><image>"}], "images": [f"p/{PHOTOS[0]}", "p/absent.png"]}
    with pytest.raises(InputError, match="row 0, column images: a second image in one record. LLaVA-OneVision's"):
        prepare_image_chat(chats(tmp_path, [record]), onevision_directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_each_image_is_counted_once_however_often_it_is_placed(llava_next_directory, tmp_path, monkeypatch):
    """An image placed three times: its tiling chosen once (when first met), its text written from that count."""
    import prepack.formats.images as image_formats

    (tmp_path / "p").mkdir()
    (tmp_path / "p" / PHOTOS[0]).write_bytes((SAMPLE_DATA / PHOTOS[0]).read_bytes())
    choices = []
    select = image_formats.select_best_resolution
    monkeypatch.setattr(image_formats, "select_best_resolution", lambda *args: choices.append(args) or select(*args))
    record = {"messages": [{"role": "user", "content": "<image>a<image>b<image>"}], "images": [f"p/{PHOTOS[0]}"] * 3}
    summary = prepare_image_chat(chats(tmp_path, [record]), llava_next_directory, tmp_path / "out")
    assert len(choices) == 1 and summary.references == 3


def test_a_rule_without_tiles_is_written_as_before_tiling_existed(processor, llava_next_directory):
    """images.json of a Qwen (or Gemma 3, LLaVA) processor keeps its bytes: no tiling fields, not even as null."""
    rule, _ = processor_rule(processor)
    assert list(json.loads(rule.model_dump_json())) == [
        "kind", "placeholder", "start", "end", "patch_size", "merge_size", "min_pixels", "max_pixels", "tokens"]
    tiled, _ = processor_rule(llava_next_directory)
    assert json.loads(tiled.model_dump_json())["pinpoints"] == LLAVA_NEXT_PINPOINTS


# Idefics3's (HuggingFaceM4/Idefics3-8B-Llama3) and SmolVLM's (SmolVLM-256M) splitting: images resized to a longest
# side, then split into tiles of a side, each tile and the whole image `image_seq_len` placeholders.
SPLITTING = {
    "idefics3": ({"longest_edge": 4 * 364}, {"longest_edge": 364}, 169),
    "smolvlm": ({"longest_edge": 4 * 512}, {"longest_edge": 512}, 64),
}


def splitting_directory(directory, model_type: str):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from tests.vision_inputs import SPLIT_TOKENS, transformers_processor_directory

    size, max_image_size, image_seq_len = SPLITTING[model_type]
    kind = Idefics3ImageProcessorPil if model_type == "idefics3" else SmolVLMImageProcessorPil
    return transformers_processor_directory(directory, kind(size=size, max_image_size=max_image_size),
                                            {"image_seq_len": image_seq_len}, SPLIT_TOKENS)


@pytest.mark.slow
def test_idefics3_placeholders_and_text_are_its_processors_own(tmp_path):
    """transformers' Idefics3Processor, loaded from the directory prepare-images reads, tokenizes a prompt with an
    image of each size (extreme aspect ratios, smaller than a tile, 1x1) as the rule's text tokenizes."""
    from transformers import Idefics3Processor

    directory = splitting_directory(tmp_path / "processor", "idefics3")
    rule, placeholder_id = processor_rule(directory)
    reference = Idefics3Processor.from_pretrained(directory)
    assert rule.kind == "split" and placeholder_id == reference.image_token_id
    for width, height in TILED_SIZES:
        expected = reference(text="a<image>b", images=[Image.new("RGB", (width, height), "gray")])["input_ids"][0]
        assert reference.tokenizer("a" + rule.text(width, height) + "b")["input_ids"] == list(expected), (width, height)
        assert rule.placeholders(width, height) == list(expected).count(placeholder_id)


@pytest.mark.slow
def test_smolvlm_text_is_its_processors_own(tmp_path):
    """SmolVLM's processor needs num2words and torchvision (its video processor), so its own expansion
    (`get_image_prompt_string`) is run on the rows and columns its image processor gives, for each size."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    directory = splitting_directory(tmp_path / "processor", "smolvlm")
    rule, _ = processor_rule(directory)
    images = SmolVLMImageProcessorPil.from_pretrained(directory)
    for width, height in TILED_SIZES:
        out = images(images=[Image.new("RGB", (width, height), "gray")], return_row_col_info=True)
        expected = get_image_prompt_string(out["rows"][0][0], out["cols"][0][0], 64, "<fake_token_around_image>",
                                           "<image>", "<global-img>")
        assert rule.text(width, height) == expected, (width, height)


# Idefics3 image processor setups (24-pixel tiles) and the sizes drawn for each: resized to 4 tiles' side; not
# resized (tiles grow with the image); resized past 4096 at extreme aspect ratios, so the 4096 bound cuts in; unsplit.
EXTREME = st.tuples(st.integers(1, 3), st.integers(500, 1000)).flatmap(lambda sides: st.sampled_from([sides, sides[::-1]]))
SPLIT_SETUPS = {
    "resized": ({"size": {"longest_edge": 4 * 24}}, st.tuples(st.integers(1, 700), st.integers(1, 700))),
    "not resized": ({"do_resize": False}, st.tuples(st.integers(1, 700), st.integers(1, 700))),
    "within 4096": ({"size": {"longest_edge": 5000}}, EXTREME),
    "not split": ({"size": {"longest_edge": 4 * 24}, "do_image_splitting": False},
                  st.tuples(st.integers(1, 700), st.integers(1, 700))),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SPLIT_SETUPS))
def test_split_tiles_equal_the_image_processors_at_any_size(tmp_path, setup):
    """At sizes drawn at random (small tiles, so that the processor's pixels are cheap): the rule's tiles are the
    rows and columns Idefics3's image processor makes, its count the processor's, for each setup the rule reads."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from tests.vision_inputs import SPLIT_TOKENS, transformers_processor_directory

    options, sizes = SPLIT_SETUPS[setup]
    images = Idefics3ImageProcessorPil(max_image_size={"longest_edge": 24}, **options)
    directory = transformers_processor_directory(tmp_path / "processor", images, {"image_seq_len": 5}, SPLIT_TOKENS)
    rule, _ = processor_rule(directory)
    assert (rule.resize_edge, rule.splitting) == (options.get("size", {}).get("longest_edge"),
                                                  options.get("do_image_splitting", True))

    @settings(max_examples=30, deadline=None)
    @given(sizes)
    def tiles_agree(size):
        width, height = size
        out = images(images=[Image.new("RGB", (width, height))], return_row_col_info=True)
        rows, columns = out["rows"][0][0], out["cols"][0][0]
        assert rule.placeholders(width, height) == (rows * columns + 1) * 5 == 5 * len(out["pixel_values"][0])

    tiles_agree()


@pytest.mark.parametrize(
    ("family", "file", "edit", "message"),
    [
        ("llava_next", "preprocessor_config.json", lambda c: c.update(image_grid_pinpoints=[[336]]),
         "image_grid_pinpoints is [[336]]; expected [[height, width], ...]"),
        ("llava_next", "preprocessor_config.json", lambda c: c.update(image_grid_pinpoints=[[0, 336]]),
         "image_grid_pinpoints is [[0, 336]]"),
        ("llava_next", "preprocessor_config.json", lambda c: c["crop_size"].update(height=0), "crop_size.height is 0"),
        ("llava_next", "processor_config.json", lambda c: c.pop("patch_size"), "a LLaVA-NeXT processor needs patch_size"),
        ("llava_next", "processor_config.json", lambda c: c.update(patch_size=1000), "has no features"),
        ("llava_next", "processor_config.json", lambda c: c.update(num_additional_image_tokens=-1),
         "num_additional_image_tokens is -1"),
        ("onevision", "processor_config.json", lambda c: c.update(vision_aspect_ratio="pad"),
         "vision_aspect_ratio of anyres_max_N (found 'pad')"),
        ("onevision", "processor_config.json", lambda c: c.pop("num_image_tokens"), "needs num_image_tokens"),
        ("idefics3", "preprocessor_config.json", lambda c: c.pop("max_image_size"), "needs max_image_size.longest_edge"),
        ("idefics3", "processor_config.json", lambda c: c.update(image_seq_len=0), "image_seq_len is 0"),
        # A pinpoint smaller than a tile: refused once for the config, not for each image that picks it.
        ("llava_next", "preprocessor_config.json", lambda c: c.update(image_grid_pinpoints=[[336, 672], [100, 336]]),
         "pinpoint (100, 336) (height, width) is smaller than a tile of 336x336"),
    ],
)
def test_a_tiling_processor_config_that_cannot_count_is_a_named_error(
    request, tmp_path, family, file, edit, message
):
    directory = (splitting_directory(tmp_path / "processor", "idefics3") if family == "idefics3"
                 else request.getfixturevalue(f"{family}_directory"))
    edited = edited_processor(directory, tmp_path, file, edit)
    with pytest.raises(InputError, match=re.escape(message)):
        processor_rule(edited)


ANYRES = dict(kind="anyres", placeholder="<image>", start="", end="", tokens=1, pinpoints=((32, 32),), tile_height=16,
              tile_width=16, feature_rows=2, feature_columns=2)
SPLIT = dict(kind="split", placeholder="<image>", start="", end="", tokens=1, tile_height=16, splitting=True,
             global_token="<global-img>")
GRID = dict(kind="grid", placeholder="<|image_pad|>", start="", end="", patch_size=14, merge_size=2, min_pixels=3136,
            max_pixels=12845056)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({**GRID, "pinpoints": ((336, 336),)}, "a rule of kind grid has no pinpoints"),
        ({**GRID, "splitting": False}, "a rule of kind grid has no splitting"),
        ({"kind": "fixed", "placeholder": "<image>", "start": "", "end": "", "tokens": 5, "tile_height": 16},
         "a rule of kind fixed has no tile_height"),
        ({**SPLIT, "tile_width": 16}, "a rule of kind split has no tile_width"),
        ({**SPLIT, "pinpoints": ((32, 32),)}, "a rule of kind split has no pinpoints"),
        ({**ANYRES, "resize_edge": 64}, "a rule of kind anyres has no resize_edge"),
        ({**ANYRES, "pinpoints": ((32, 32), (32, 8))}, "pinpoint (32, 8) (height, width) is smaller than a tile"),
        ({**ANYRES, "pinpoints": ((65536, 65536),), "feature_rows": 16, "feature_columns": 16},
         "its largest pinpoint gives up to 4295032833 placeholders"),
    ],
)
def test_a_rule_with_fields_it_does_not_count_with_is_refused(fields, message):
    """A manifest's rule is whole and nothing more: another kind's fields are refused (not silently dropped when
    written), and an anyres rule's pinpoints are each at least a tile and at most an image's placeholder limit."""
    from prepack.formats.images import ImageRule

    with pytest.raises(ValueError, match=re.escape(message)):
        ImageRule(**fields)


def png_bytes(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), "gray").save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "fields",
    [
        {**SPLIT, "tile_height": 1, "tokens": 65536},  # no resize_edge: tiles grow with the image's pixels
        {**GRID, "patch_size": 1, "merge_size": 1, "min_pixels": 2**31 - 1, "max_pixels": 2**31 - 1},
    ],
)
def test_an_image_of_more_placeholders_than_the_limit_is_refused_before_its_text(tmp_path, fields):
    """Each field of a rule within bounds, their product not: the image is refused by name before its text (a string
    of that many placeholders) is built or its count overflows the int32 tokens column, and nothing is written."""
    from prepack.formats.images import MAX_IMAGE_TOKENS, ImageRule
    from prepack.sources.images import _ImageWriter

    rule = ImageRule(**fields)
    with open(tmp_path / "scratch", "wb") as scratch:
        writer = _ImageWriter(scratch, tmp_path / "scratch", rule, ImageLimits())
        with pytest.raises(InputError, match=re.escape(f"c.jsonl, row 3, column images: the image (30x30) stands for "
                                                       f"{rule.placeholders(30, 30)} placeholder tokens, more than")):
            writer.number(png_bytes(30, 30), "c.jsonl, row 3, column images")
    assert rule.placeholders(30, 30) > MAX_IMAGE_TOKENS and (tmp_path / "scratch").stat().st_size == 0
    assert writer.tokens == []


def test_max_tiles_serves_both_tiling_kinds_within_what_each_searches():
    """`max_tiles` is InternVL's canvas bound (its arrangements searched in full, so at most 64) and LLaVA-OneVision's
    anyres_max_N (any count); each kind writes it, and no other kind's fields."""
    from prepack.formats.images import ImageRule

    tiles = dict(kind="tiles", placeholder="<I>", start="", end="", tokens=4, patch_size=28, min_tiles=1)
    with pytest.raises(ValueError, match="max_tiles 65 is more than 64"):
        ImageRule(**tiles, max_tiles=65)
    assert list(json.loads(ImageRule(**tiles, max_tiles=64).model_dump_json())) == [
        "kind", "placeholder", "start", "end", "patch_size", "merge_size", "min_pixels", "max_pixels", "tokens",
        "max_tiles", "min_tiles"]
    anyres = ImageRule(kind="anyres", placeholder="<I>", start="", end="", tokens=4, pinpoints=[[56, 56]],
                       tile_height=28, tile_width=28, feature_rows=2, feature_columns=2, max_tiles=100)
    written = json.loads(anyres.model_dump_json())
    assert written["max_tiles"] == 100 and "splitting" not in written and "min_tiles" not in written


def gemma4_directory(directory, max_soft_tokens: int = 70):
    """A Gemma 4 processor directory (4-pixel patches pooled 2x2, `max_soft_tokens` an image) and transformers' own
    Gemma4Processor over the same parts."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from tests.vision_inputs import gemma4_processor_directory

    parts = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=max_soft_tokens, pooling_kernel_size=2)
    return gemma4_processor_directory(directory, parts)


@pytest.fixture(scope="module")
def gemma4_processor(tmp_path_factory):
    return gemma4_directory(tmp_path_factory.mktemp("gemma4") / "proc")


@pytest.mark.parametrize("max_soft_tokens", [70, pytest.param(280, marks=pytest.mark.slow)])
def test_gemma4_placeholders_text_and_token_types_are_the_processors_own(gemma4_processor, tmp_path, max_soft_tokens):
    """Gemma 4: an image resized keeping its aspect ratio within the budget of max_soft_tokens x 2² patches becomes
    `<start_of_image>`, one `<image_soft_token>` per 2x2 patches, `<end_of_image>` (the tokenizer's boi, image and eoi
    tokens, as Gemma4Processor reads them); the expanded text, its ids and the count are Gemma4Processor's own, and
    VisionCollator's mm_token_type_ids are the processor's."""
    from prepack.training.vision_collate import VisionCollator, VisionSpec

    directory, processor = gemma4_processor if max_soft_tokens == 70 else gemma4_directory(tmp_path / "proc",
                                                                                           max_soft_tokens)
    rule, placeholder_id = processor_rule(directory)
    assert placeholder_id == processor.image_token_id
    collator = VisionCollator(VisionSpec("image blocks", placeholder_id, token_types="mm_token_type_ids",
                                         image_counts="num_soft_tokens_per_image"), processor.image_processor)
    counts = set()
    for data, size, out, ids in expanded_by_the_processor(processor, rule, "<image_soft_token>"):
        assert rule.placeholders(*size) == ids.count(placeholder_id)
        pack = {"input_ids": out["input_ids"][0], "cu_seqlens": np.array([0, len(ids)]), "images": [data]}
        assert collator([pack])["mm_token_type_ids"][0].tolist() == out["mm_token_type_ids"][0].tolist()
        counts.add(rule.placeholders(*size))
    assert len(counts) > 2  # the sizes exercise more than one grid


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([(16, 280, 3), (4, 70, 2), (14, 1120, 3)]))
def test_pooled_resize_is_transformers_own(height, width, sizes):
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    from prepack.formats.images import pooled_resize

    patch, tokens, kernel = sizes
    try:
        expected = get_aspect_ratio_preserving_size(height, width, patch, tokens * kernel**2, kernel)
    except ValueError:
        with pytest.raises(ValueError):
            pooled_resize(height, width, patch, tokens * kernel**2, kernel)
        return
    assert pooled_resize(height, width, patch, tokens * kernel**2, kernel) == expected


def test_gemma4_budgets_are_its_image_processors():
    from transformers.models.gemma4.image_processing_pil_gemma4 import _SUPPORTED_SOFT_TOKENS

    from prepack.sources.images import _GEMMA4_SOFT_TOKENS

    assert _GEMMA4_SOFT_TOKENS == _SUPPORTED_SOFT_TOKENS


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("preprocessor_config.json", {"max_soft_tokens": 100},
         "max_soft_tokens is 100; Gemma 4's image processor takes"),
        ("preprocessor_config.json", {"do_resize": False}, "do_resize is False"),
        ("preprocessor_config.json", {"pooling_kernel_size": 0}, "pooling_kernel_size is 0"),
        ("tokenizer_config.json", {"boi_token": None}, "no boi_token (a string, or"),
        ("tokenizer_config.json", {"image_token": 7, "eoi_token": ""}, "no image_token, eoi_token (a string, or"),
    ],
)
def test_a_gemma4_processor_that_cannot_count_is_a_named_error(gemma4_processor, tmp_path, file, edit, message):
    import shutil

    directory = shutil.copytree(gemma4_processor[0], tmp_path / "proc")
    config = json.loads((directory / file).read_text()) | edit
    (directory / file).write_text(json.dumps(config))
    with pytest.raises(InputError, match=re.escape(f"{directory / file}: {message}")):
        processor_rule(directory)


@pytest.mark.parametrize("form", ["content", "extra_special_tokens", "special_tokens_map"])
def test_gemma4_image_tokens_are_read_in_each_form_transformers_tokenizer_takes(gemma4_processor, tmp_path, form):
    """Gemma 4's image token written as an AddedToken ({"content": ...}), in an extra_special_tokens mapping (which
    wins over a top-level key) or in special_tokens_map.json: the tokenizer transformers loads has that image token,
    and prepack counts the same rule and placeholder id from it."""
    import shutil

    from transformers import AutoTokenizer

    directory = shutil.copytree(gemma4_processor[0], tmp_path / "proc")
    file = directory / "tokenizer_config.json"
    config = json.loads(file.read_text())
    image = config["image_token"]
    if form == "content":
        config["image_token"] = {"__type": "AddedToken", "content": image, "special": True}
    elif form == "extra_special_tokens":
        config |= {"image_token": config["boi_token"], "extra_special_tokens": {"image_token": image}}
    else:
        del config["image_token"]
        (directory / "special_tokens_map.json").write_text(json.dumps({"image_token": image}))
    file.write_text(json.dumps(config))
    assert AutoTokenizer.from_pretrained(directory).image_token == image
    assert processor_rule(directory) == processor_rule(gemma4_processor[0])


# LFM2-VL's tokens (LiquidAI's tokenizer has them as special tokens): its image's, its thumbnail's, its tiles'.
LFM2_VL_TOKENS = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>",
                  *(f"<|img_row_{row}_col_{column}|>" for row in range(1, 11) for column in range(1, 11)))
LFM2_VL_SETUPS = {
    "defaults": {},
    "no thumbnail": {"use_thumbnail": False},
    "not split": {"do_image_splitting": False},
    "small tiles": {"tile_size": 256, "min_tiles": 2, "max_tiles": 4, "min_image_tokens": 16, "max_image_tokens": 64},
    "patch 14": {"encoder_patch_size": 14, "downsample_factor": 3, "max_pixels_tolerance": 1.0, "max_tiles": 6,
                 "tile_size": 504},
}


def lfm2_vl_directory(directory, options: dict, processor_config: dict | None = None):
    from tests.vision_inputs import transformers_processor_directory

    config = {"image_processor_type": "Lfm2VlImageProcessor", **options}
    return transformers_processor_directory(directory, config, processor_config or {"processor_class": "Lfm2VlProcessor"},
                                            LFM2_VL_TOKENS)


# The sharp sizes THIN and EXTREME need not draw: the image processor's resized view (the image alone, or its thumbnail
# after its tiles) keeps a side at one token's pixels and so can outgrow the patches it pads each view to.
LFM2_VL_EXTREMES = [
    (1, 1025),  # refused with the defaults: a view of 1028 patches, 4 over the 1024 it pads each view to
    (8200, 1),  # accepted with the defaults: a view of exactly 1024 patches
    (1, 1),  # upscaled to the least tokens, and kept
    (20000, 32),  # split into tiles: refused for its thumbnail's 1600 patches with the defaults, kept without one
]
THIN = st.tuples(st.integers(1, 40), st.integers(1000, 65536)).flatmap(lambda sides: st.sampled_from([sides, sides[::-1]]))


@pytest.mark.slow  # the image processor on images of up to 3000x3000 (or 65536 wide and thin): about a second each
@pytest.mark.parametrize("setup", LFM2_VL_SETUPS)
def test_lfm2_vl_placeholders_and_text_are_the_processors_own(tmp_path, setup):
    """At sizes drawn at random, photographs' and extreme ones: the rule read from an LFM2-VL processor directory
    writes each image's text as transformers' Lfm2VlProcessor does (tiles with their rows and columns, thumbnail,
    image start and end), its Lfm2VlImageProcessor run on an image of that size beside another
    (`lfm2_vl_image_text`); where that processor fails (a view of more patches than it pads each view to: torch
    cannot stack it with the image's tiles or cat it with another image), the rule refuses the image, naming its
    size, its view's patches and the processor's limit."""
    from tests.vision_inputs import lfm2_vl_image_text

    directory = lfm2_vl_directory(tmp_path / "processor", LFM2_VL_SETUPS[setup])
    rule, placeholder_id = processor_rule(directory)
    processor_text = lfm2_vl_image_text(directory)
    from tokenizers import Tokenizer

    assert placeholder_id == Tokenizer.from_file(str(tmp_path / "processor" / "tokenizer.json")).token_to_id("<image>")
    split, refused = set(), set()

    @settings(max_examples=25, deadline=None)
    @given(st.one_of(st.tuples(st.integers(1, 3000), st.integers(1, 3000)), EXTREME, THIN,
                     st.sampled_from([(640, 480), (1300, 1200), (1024, 1024), (512, 512), (4000, 3000)])))
    @example((4000, 3000))
    @example((640, 480))
    def texts_agree(size):
        width, height = size
        expected = processor_text(width, height)
        if expected is None:
            refused.add(size)
            with pytest.raises(ValueError, match=rf"the {width}x{height} image .* patches of \d+, more than the \d+ "):
                rule.placeholders(width, height)
        else:
            assert rule.text(width, height) == expected
            assert rule.placeholders(width, height) == expected.count("<image>")
            split.add("<|img_row_1_col_1|>" in expected)

    for size in LFM2_VL_EXTREMES:
        texts_agree = example(size)(texts_agree)
    texts_agree()
    assert split == ({False} if setup == "not split" else {True, False})  # the sizes exercise both layouts
    assert refused  # and the processor's failures


@pytest.mark.parametrize(
    ("options", "size"),
    [
        ({"min_tiles": 5, "max_tiles": 5}, (2600, 1000)),  # a grid of 5 tiles: its arrangements' order decides
        ({}, (4000, 8)),  # a side below a patch, kept at one before the area is checked
    ],
    ids=["five tiles", "thin"],
)
def test_lfm2_vl_counts_where_its_rule_departs_from_the_others_are_the_processors(tmp_path, options, size):
    """The sizes and setups where LFM2-VL's rule differs from GOT-OCR2's canvas and from Qwen2-VL's resize: the
    rule's text is Lfm2VlProcessor's, its image processor run on an image of that size."""
    from tests.vision_inputs import lfm2_vl_image_text

    directory = lfm2_vl_directory(tmp_path / "processor", options)
    rule, _ = processor_rule(directory)
    assert rule.text(*size) == lfm2_vl_image_text(directory)(*size)


def test_prepare_images_refuses_an_image_lfm2_vls_processor_fails_on_by_name(tmp_path):
    """A 65536x1 image under LFM2-VL's default processor: its thumbnail would be 131072x32 pixels, 16384 patches, more
    than the 1024 Lfm2VlImageProcessor pads each view to; refused naming the file, row, column, size and limit."""
    directory = lfm2_vl_directory(tmp_path / "processor", LFM2_VL_SETUPS["defaults"])
    (tmp_path / "p").mkdir()
    Image.new("RGB", (65536, 1)).save(tmp_path / "p" / "thin.png")
    corpus = chats(tmp_path / "p", [with_image("thin.png")])
    with pytest.raises(InputError) as caught:
        prepare_image_chat(corpus, directory, tmp_path / "out")
    message = str(caught.value)
    assert f"{corpus}, row 0, column " in message
    assert "65536x1 image" in message and "131072x32" in message and "16384 patches of 16, more than the 1024" in message
    assert "with the image's tiles, and fails on it in a batch with any other image of another patch count" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("options", "processor_config", "message"),
    [
        ({"min_tiles": 5, "max_tiles": 3}, None, "preprocessor_config.json: min_tiles 5 is more than max_tiles 3"),
        # Lfm2VlProcessor counts a large image split into one tile as its thumbnail (56 placeholders at 374x350
        # here) while its image processor makes the tile (64 features): training's placeholder check would fail.
        ({"min_tiles": 1, "tile_size": 256, "max_image_tokens": 64}, None,
         "preprocessor_config.json: min_tiles 1 with do_image_splitting"),
        ({"max_pixels_tolerance": "2"}, None, "preprocessor_config.json: max_pixels_tolerance is '2'"),
        ({"use_thumbnail": 1}, None, "preprocessor_config.json: use_thumbnail is 1"),
        ({"tile_size": 0}, None, "preprocessor_config.json: tile_size is 0"),
        # transformers' Lfm2VlImageProcessor fails reshaping a tile of 512 pixels into patches of 14.
        ({"encoder_patch_size": 14}, None, "tile_size 512 is not a multiple of encoder_patch_size 14"),
        # a tile of 33 patches: Lfm2VlProcessor counts ceil(33/2)² = 289 placeholders, its model makes 16² features.
        ({"tile_size": 528}, None, "tile_size 528 is 33 patches of 16 a side, not a multiple of downsample_factor 2"),
        ({"max_tiles": 65}, None, "max_tiles 65 is more than 64"),
        ({}, {"use_image_special_tokens": False}, "processor_config.json: use_image_special_tokens is False"),
    ],
)
def test_an_lfm2_vl_processor_config_it_cannot_count_is_a_named_error(tmp_path, options, processor_config, message):
    with pytest.raises(InputError, match=re.escape(message)):
        processor_rule(lfm2_vl_directory(tmp_path / "processor", options, processor_config))


@pytest.mark.slow
def test_lfm2_vl_prepare_images_writes_the_processors_text_and_counts(tmp_path):
    """prepare-images with an LFM2-VL processor directory (small tiles, so that the photographs split): each image's
    text in corpus.parquet and its count in the image set are Lfm2VlProcessor's for the image's size."""
    from tests.vision_inputs import lfm2_vl_image_text

    directory = lfm2_vl_directory(tmp_path / "processor", LFM2_VL_SETUPS["small tiles"])
    (tmp_path / "p").mkdir()
    for name in PHOTOS:
        (tmp_path / "p" / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    corpus = chats(tmp_path / "p", [with_image(name) for name in PHOTOS])
    prepare_image_chat(corpus, directory, tmp_path / "out")
    expected = lfm2_vl_image_text(directory)
    sizes = [Image.open(SAMPLE_DATA / name).size for name in PHOTOS]
    contents = [row[0]["content"] for row in pq.read_table(tmp_path / "out" / "corpus.parquet")["messages"].to_pylist()]
    assert [content.removesuffix("Hi") for content in contents] == [expected(*size) for size in sizes]
    assert any("<|img_row_1_col_1|>" in content for content in contents)  # a photograph split into tiles
    image_set = read_image_set(tmp_path / "out" / "images")
    assert image_set.row_tokens().tolist() == [expected(*size).count("<image>") for size in sizes]
