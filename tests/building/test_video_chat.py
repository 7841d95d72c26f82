"""Video+chat corpora: `prepare_image_chat` reads videos given as frames, counts their placeholders by the video
processor's rule, stores every frame once (sha256) among the image set's images, and the build serves them.

A video is its frames (tests/video_inputs.py: crops panning over a sample photograph, written as PNG files): a
list of frame paths in LlamaFactory's `videos` column with `<video>` markers, a `{"type": "video"}` content item,
or a directory of frames. A video file (mp4) is refused by name: prepack has no video decoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from tokenizers import Tokenizer

from prepack import enable_packing
from prepack.errors import FormatError, InputError, UsageError
from prepack.formats.images import IMAGE_SET_MANIFEST, VIDEOS_FILE, VIDEOS_SCHEMA, read_image_set
from prepack.model.tiny_vision_models import tiny_vision_model
from prepack.sources.images import prepare_image_chat, processor_rule, video_processor_rule
from prepack.training.video_frames import FrameVideoProcessor
from prepack.training.vision_collate import VisionCollator, VisionSpec
from prepack.training.vision_dataset import ImagePackedDataset
from tests.cli import WIDE, failure, run_prepack
from tests.model.test_vision import LOSS_TOLERANCE, TOLERANCE, run, targets
from tests.video_inputs import QWEN_VIDEO_TOKEN, VIDEOS, video_bytes, video_frames, video_processor_directory
from tests.vision_inputs import PHOTOS, QWEN_IMAGE_TOKENS, SAMPLE_DATA

MAX_LEN = 200


# The video processor's pixel bounds differ from the image processor's (QWEN_PIXELS), as in real checkpoints: a
# frame is counted with the video processor's.
VIDEO_PIXELS = {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 4}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return video_processor_directory(tmp_path_factory.mktemp("proc") / "processor", size=VIDEO_PIXELS)


def write_videos(directory) -> list[list[str]]:
    """Each video of VIDEOS as PNG frame files under directory/clips/vN/, named in frame order; their paths."""
    paths = []
    for number in range(len(VIDEOS)):
        folder = directory / "clips" / f"v{number}"
        folder.mkdir(parents=True)
        names = []
        for index, frame in enumerate(video_bytes(number)):
            (folder / f"frame{index:03d}.png").write_bytes(frame)
            names.append(f"clips/v{number}/frame{index:03d}.png")
        paths.append(names)
    (directory / "photos").mkdir()
    for name in PHOTOS:
        (directory / "photos" / name).write_bytes((SAMPLE_DATA / name).read_bytes())
    return paths


def video_records(paths: list[list[str]]) -> list[dict]:
    """Videos in the three corpus forms, one video twice (its frames stored once), an image, a text-only chat."""
    return [
        {"conversations": [{"from": "human", "value": "<video>What moves?"}, {"from": "gpt", "value": "The view."}],
         "videos": [paths[0]], "video_fps": 1.0},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": f"photos/{PHOTOS[1]}"},
                                                    {"type": "video", "video": "clips/v1"},
                                                    {"type": "text", "text": "Same?"}]},
                      {"role": "assistant", "content": "No."}], "video_fps": [0.5]},
        {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]},
        {"messages": [{"role": "user", "content": "<video> and <video>"}, {"role": "assistant", "content": "Two."}],
         "videos": [paths[2], paths[0]]},
    ]


def corpus_file(directory, records) -> object:
    corpus = directory / "chats.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    return corpus


@pytest.mark.slow
def test_videos_are_prepared_with_their_frames_stored_once(processor, tmp_path):
    paths = write_videos(tmp_path)
    corpus = corpus_file(tmp_path, video_records(paths))
    summary = prepare_image_chat(corpus, processor, tmp_path / "one")
    prepare_image_chat(corpus, processor, tmp_path / "two")
    for name in ("corpus.parquet", "images/images.arrow", "images/documents.arrow", f"images/{VIDEOS_FILE}",
                 f"images/{IMAGE_SET_MANIFEST}"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    image_set = read_image_set(summary.image_set, verify=True)
    frames = sum(count for _, count, _, _, _ in VIDEOS)
    assert summary.videos == 4 and summary.images == 1 + frames  # video 0 twice, its frames stored once
    rule, video_id = video_processor_rule(processor)
    assert image_set.manifest.video_placeholder_id == video_id
    expected = {0: [(0, 1.0)], 1: [(1, 0.5)], 2: [], 3: [(2, 2.0), (0, 2.0)]}  # (video, fps) per row
    texts = [str(row) for row in pq.read_table(summary.corpus).column("messages").to_pylist()]
    for row, videos in expected.items():
        got = image_set.videos_of(row)
        assert [(len(frames), fps) for frames, fps, _ in got] == [(VIDEOS[v][1], fps) for v, fps in videos]
        counts = [rule.placeholders(VIDEOS[v][1], VIDEOS[v][2], VIDEOS[v][3]) for v, _ in videos]
        assert [tokens for _, _, tokens in got] == counts
        assert texts[row].count(QWEN_VIDEO_TOKEN) == sum(counts)
    assert image_set.videos_of(3)[1][0].tolist() == image_set.videos_of(0)[0][0].tolist()
    assert image_set.row_video_tokens().tolist() == [texts[row].count(QWEN_VIDEO_TOKEN) for row in range(4)]


@pytest.mark.slow
def test_a_qwen3_video_is_one_run_a_step_after_its_time(tmp_path):
    processor = video_processor_directory(tmp_path / "processor", "qwen3",
                                          {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 24})
    paths = write_videos(tmp_path / "corpus")
    corpus = corpus_file(tmp_path / "corpus", [video_records(paths)[0]])
    summary = prepare_image_chat(corpus, processor, tmp_path / "out")
    rule, _ = video_processor_rule(processor)
    _, frames, width, height, _ = VIDEOS[0]
    text = pq.read_table(summary.corpus).column("messages").to_pylist()[0][0]["content"]
    assert text == rule.text(frames, width, height, 1.0) + "What moves?"
    assert text.startswith("<0.5 seconds><|vision_start|>") and text.count("seconds>") == 2


def test_a_set_without_videos_has_no_video_fields(processor, tmp_path):
    """An image corpus prepared with a processor that has a video processor: the image set of before."""
    write_videos(tmp_path)
    record = {"messages": [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "x"}],
              "images": [f"photos/{PHOTOS[0]}"]}
    summary = prepare_image_chat(corpus_file(tmp_path, [record]), processor, tmp_path / "out")
    manifest = json.loads((summary.image_set / IMAGE_SET_MANIFEST).read_text())
    assert sorted(manifest) == ["documents", "files", "image_set_version", "image_tokens", "images", "limits",
                                "placeholder_id", "references", "rule"]
    assert not (summary.image_set / VIDEOS_FILE).exists() and summary.videos == 0


@pytest.mark.parametrize("video_config", [{"video_processor_type": "LlavaOnevisionVideoProcessor"},
                                          {"video_processor_type": "Qwen3VLVideoProcessor", "cap_pixels_per_frame": True}],
                         ids=["unsupported processor", "capped frames"])
def test_an_image_corpus_ignores_a_video_processor_it_never_needs(tmp_path, video_config):
    """A processor folder whose video processor prepack cannot count for (LLaVA-OneVision's, SmolVLM's, a capped
    Qwen one) still prepares an image corpus: the video rule is read at the first video only."""
    from tests.vision_inputs import processor_directory

    write_videos(tmp_path)
    record = {"messages": [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "x"}],
              "images": [f"photos/{PHOTOS[0]}"]}
    corpus = corpus_file(tmp_path, [record])
    plain = prepare_image_chat(corpus, processor_directory(tmp_path / "plain"), tmp_path / "plain-out")
    with_video = processor_directory(tmp_path / "with-video")
    (with_video / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    summary = prepare_image_chat(corpus, with_video, tmp_path / "out")
    for name in ("corpus.parquet", "images/images.arrow", "images/documents.arrow", f"images/{IMAGE_SET_MANIFEST}"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "plain-out" / name).read_bytes(), name
    assert summary.videos == plain.videos == 0
    video = {"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
             "videos": ["clips/v0"]}
    with pytest.raises(InputError, match="video_preprocessor_config.json: "):
        prepare_image_chat(corpus_file(tmp_path, [record, video]), with_video, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    ("video", "message"),
    [
        ("clips/clip.mp4", r"'clips/clip.mp4' is not a list of frames or a directory of them; prepack reads a video "
                           r"as its frames \(it has no video decoder\)"),
        ("clips/empty", "holds no frame images"),
        (["clips/v0/frame000.png", "clips/v1/frame000.png"], r"frames are of 2 sizes"),
        ("../outside", "leads out of"),
        ("clips/v9", r"the video 'clips/v9' cannot be read \(no such file or directory\)"),
        ([], "a video without frames"),
    ],
    ids=["mp4", "empty directory", "two sizes", "outside", "missing", "no frames"],
)
def test_bad_videos_are_refused_by_row_and_column(processor, tmp_path, video, message):
    write_videos(tmp_path)
    (tmp_path / "clips" / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    (tmp_path / "clips" / "empty").mkdir()
    record = {"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
              "videos": [video]}
    with pytest.raises(InputError, match=f"chats.jsonl, row 0, column videos: .*{message}"):
        prepare_image_chat(corpus_file(tmp_path, [record]), processor, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_video_needs_a_video_processor_and_a_place(tmp_path):
    from tests.vision_inputs import processor_directory

    paths = write_videos(tmp_path)
    images_only = processor_directory(tmp_path / "processor")
    with pytest.raises(InputError, match="row 0, column videos: a video, and the processor directory has no video "
                                         "processor"):
        prepare_image_chat(corpus_file(tmp_path, video_records(paths)[:1]), images_only, tmp_path / "out")
    processor = video_processor_directory(tmp_path / "with-video")
    unplaced = {"messages": [{"role": "user", "content": "no marker"}, {"role": "assistant", "content": "x"}],
                "videos": [paths[0]]}
    with pytest.raises(InputError, match="row 0, column videos: 1 videos that no message places"):
        prepare_image_chat(corpus_file(tmp_path, [unplaced]), processor, tmp_path / "out")
    bad_rate = {**video_records(paths)[0], "video_fps": 0}
    with pytest.raises(InputError, match="row 0, column video_fps: 0; a frame rate is a positive number"):
        prepare_image_chat(corpus_file(tmp_path, [bad_rate]), processor, tmp_path / "out")


def test_a_video_over_the_images_per_record_is_refused_before_its_frames_are_read(processor, tmp_path):
    """The count is checked against the record's allowance first: a frame past it (here one that does not exist)
    is never opened, as an image past it is not."""
    from prepack.sources.images import ImageLimits

    paths = write_videos(tmp_path)
    record = {"messages": [{"role": "user", "content": "<image><video>?"}, {"role": "assistant", "content": "x"}],
              "images": [f"photos/{PHOTOS[0]}"], "videos": [[*paths[0][:2], "clips/v0/missing.png"]]}
    with pytest.raises(InputError, match="row 0, column videos: more than 3 images in a record"):
        prepare_image_chat(corpus_file(tmp_path, [record]), processor, tmp_path / "out",
                           limits=ImageLimits(max_images_per_document=3))
    assert not (tmp_path / "out").exists()


def test_more_rates_than_videos_are_refused(processor, tmp_path):
    paths = write_videos(tmp_path)
    record = {"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}],
              "videos": [paths[0]], "video_fps": [1.0, 2.0]}
    with pytest.raises(InputError, match="row 0, column video_fps: 2 rates for 1 videos; give one rate a video"):
        prepare_image_chat(corpus_file(tmp_path, [record]), processor, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tampered_video_count_is_caught(processor, tmp_path):
    paths = write_videos(tmp_path)
    summary = prepare_image_chat(corpus_file(tmp_path, video_records(paths)), processor, tmp_path / "out")
    manifest_file = summary.image_set / IMAGE_SET_MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["video_tokens"] += 1
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="video_tokens"):
        read_image_set(summary.image_set)


def built_batch_against_each_sample_alone(model, collator, dataset, image_set, batch) -> tuple[float, float, float]:
    """(largest logit difference, loss difference, largest gradient difference over the largest gradient) of the
    collated batch of every pack of `dataset` against each sample alone, read back from the corpus row it came from
    (its images and videos from the image set) and run through transformers' own path (test_video's alone_batch)."""
    from tests.model.test_video import alone_batch

    logits, loss, grads = run(model, batch)
    logit_diff, weighted, counted, alone_grads = 0.0, 0.0, 0, {}
    for row in range(len(dataset)):
        pack, rows = dataset[row], dataset.packs.source_rows(row)
        for document, (start, end) in enumerate(zip(pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:])):
            corpus_row = int(rows[document])
            videos = image_set.videos_of(corpus_row)
            sample = {"input_ids": pack["input_ids"][start:end].astype(np.int64),
                      "images": [image_set.data(int(n)) for n in image_set.images_of(corpus_row)],
                      "videos": [[image_set.data(int(f)) for f in frames] for frames, _, _ in videos],
                      "video_fps": [fps for _, fps, _ in videos]}
            labels = batch["labels"][row, start:end]
            alone_logits, alone_loss, sample_grads = run(model, alone_batch(collator, sample, labels))
            logit_diff = max(logit_diff, float((logits[row, start:end] - alone_logits[0]).abs().max()))
            weighted, counted = weighted + float(alone_loss) * targets(labels), counted + targets(labels)
            for name, grad in sample_grads.items():
                alone_grads[name] = alone_grads.get(name, 0) + grad
    largest = max(float(grad.abs().max()) for grad in grads.values())
    grad_diff = max(float((grads[name] - alone_grads[name]).abs().max()) for name in grads) / largest
    return logit_diff, abs(float(loss) - weighted / counted), grad_diff


@pytest.mark.slow
def test_a_video_corpus_builds_and_a_packed_batch_equals_each_sample_alone(processor, tmp_path):
    """prepare-images, `prepack build`, ImagePackedDataset serving videos and their rates, VisionCollator with
    FrameVideoProcessor, a tiny Qwen2.5-VL with the tokenizer's ids: each pack's samples equal alone."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    paths = write_videos(tmp_path)
    corpus = corpus_file(tmp_path, video_records(paths))
    done = run_prepack("prepare-images", corpus, "--processor", processor, "--out", tmp_path / "prepared", env=WIDE)
    assert done.returncode == 0 and ", 4 videos (their frames among the images)" in done.stdout, done.stderr
    summary = SimpleNamespace(corpus=tmp_path / "prepared" / "corpus.parquet", image_set=tmp_path / "prepared" / "images")
    mp4 = {"messages": [{"role": "user", "content": "<video>"}, {"role": "assistant", "content": "x"}],
           "videos": ["clip.mp4"]}
    (tmp_path / "clips" / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    refused = run_prepack("prepare-images", corpus_file(tmp_path / "clips", [mp4]), "--processor", processor, "--out",
                          tmp_path / "refused", env=WIDE)
    assert refused.returncode == 2 and "it has no video decoder" in failure(refused)
    build = tmp_path / "build"
    result = run_prepack("build", summary.corpus, "--tokenizer", processor, "--chat", "--max-len", MAX_LEN,
                         "--overflow", "error", "--out", build)
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_file(str(processor / "tokenizer.json"))
    start, image, end = (tokenizer.token_to_id(token) for token in QWEN_IMAGE_TOKENS)
    tokens = {"image_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end,
              "video_token_id": tokenizer.token_to_id(QWEN_VIDEO_TOKEN)}
    model = enable_packing(tiny_vision_model("qwen2_5_vl", vocab_size=tokenizer.get_vocab_size(), tokens=tokens))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(processor)
    image_set = read_image_set(summary.image_set)
    collator = VisionCollator(VisionSpec.of(model.config), image_processor, max_len=MAX_LEN, pad_token_id=50256,
                              video_processor=FrameVideoProcessor(image_processor, image_set.manifest.video_rule))
    dataset = ImagePackedDataset(build, summary.image_set)
    packs = [dataset[index] for index in range(len(dataset))]
    assert sum(len(pack["videos"]) for pack in packs) == 4 and sum(len(p["cu_seqlens"]) - 1 for p in packs) == 4
    assert sorted(rate for pack in packs for rate in pack["video_fps"]) == [0.5, 1.0, 2.0, 2.0]
    assert any(len(pack["cu_seqlens"]) > 2 for pack in packs)  # samples packed together
    batch = collator(packs)
    assert batch["second_per_grid_ts"].tolist() == [2 / rate for pack in packs for rate in pack["video_fps"]]
    logit_diff, loss_diff, grad_diff = built_batch_against_each_sample_alone(model, collator, dataset, image_set, batch)
    assert logit_diff < TOLERANCE
    assert loss_diff < LOSS_TOLERANCE and grad_diff < LOSS_TOLERANCE
    # verify --images: clean, and a set whose video placeholder is another token fails pack by pack
    from prepack.check.images import verify_images

    assert verify_images(build, summary.image_set) == []
    manifest_file = summary.image_set / IMAGE_SET_MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["video_placeholder_id"] = image
    manifest_file.write_text(json.dumps(manifest))
    problems = verify_images(build, summary.image_set)
    assert problems and all("video placeholder tokens" in problem.message for problem in problems)


@pytest.mark.parametrize(("processor_type", "module"), [
    ("Qwen2VLVideoProcessor", "transformers.models.qwen2_vl.video_processing_qwen2_vl"),
    ("Qwen3VLVideoProcessor", "transformers.models.qwen3_vl.video_processing_qwen3_vl"),
])
def test_a_video_config_that_names_only_its_processor_takes_transformers_defaults(processor, tmp_path, processor_type,
                                                                                   module):
    """A config may leave out any size: prepack's defaults are the class defaults in transformers' own source."""
    import shutil

    from tests.video_inputs import transformers_source

    copy = tmp_path / "processor"
    shutil.copytree(processor, copy)
    (copy / "video_preprocessor_config.json").write_text(json.dumps({"video_processor_type": processor_type}))
    rule, _ = video_processor_rule(copy)
    defaults = transformers_source(module, processor_type).defaults
    assert (rule.patch_size, rule.merge_size, rule.temporal_patch_size, rule.min_pixels, rule.max_pixels) == (
        defaults.patch_size, defaults.merge_size, defaults.temporal_patch_size, defaults.size["shortest_edge"],
        defaults.size["longest_edge"])
    (copy / "video_preprocessor_config.json").write_text(json.dumps({"video_processor_type": processor_type,
                                                                     "cap_pixels_per_frame": True}))
    with pytest.raises(InputError, match="cap_pixels_per_frame is set"):
        video_processor_rule(copy)


@pytest.mark.slow
def test_the_image_cap_counts_a_videos_frames(processor, tmp_path):
    """--max-images-per-pack counts a video's frames as images, as the collator's pixel limits and the set's
    max_images_per_document do: planner, verify and the per-row count agree."""
    from prepack import build
    from prepack.check.images import verify_images
    from prepack.training.dataset import PackedDataset

    paths = write_videos(tmp_path)
    summary = prepare_image_chat(corpus_file(tmp_path, video_records(paths)), processor, tmp_path / "prepared")
    image_set = read_image_set(summary.image_set)
    frames = [count for _, count, _, _, _ in VIDEOS]
    per_row = [frames[0], 1 + frames[1], 0, frames[2] + frames[0]]  # images and frames of video_records' rows
    assert image_set.row_images().tolist() == per_row
    cap = max(per_row)
    build(summary.corpus, tmp_path / "capped", max_len=MAX_LEN, tokenizer=processor, chat=True, overflow="error",
          max_images_per_pack=cap, images=summary.image_set)
    dataset = PackedDataset(tmp_path / "capped")
    packed = [sum(per_row[row] for row in dataset.source_rows(pack)) for pack in range(len(dataset))]
    assert max(packed) <= cap and sum(packed) == sum(per_row)
    assert verify_images(tmp_path / "capped", summary.image_set) == []
    with pytest.raises(InputError, match=f"row 3: {cap} images .* more than --max-images-per-pack {cap - 1}"):
        build(summary.corpus, tmp_path / "refused", max_len=MAX_LEN, tokenizer=processor, chat=True,
              overflow="error", max_images_per_pack=cap - 1, images=summary.image_set)
    manifest_file = summary.image_set / IMAGE_SET_MANIFEST
    manifest = json.loads(manifest_file.read_text())
    manifest["limits"]["max_images_per_document"] = cap - 1
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=f"row 3, column 'images': holds {cap} images .*more than the limit {cap - 1}"):
        read_image_set(summary.image_set)


# At the checkpoints' sizes (llava-hf/LLaVA-NeXT-Video-7B-hf: 336-pixel crops in patches of 14, 144 placeholders a
# frame; LanguageBind/Video-LLaVA-7B-hf: 224, 257), and at the tiny towers' (56 in 14: 4 and 17).
FRAME_VIDEO_SIZES = (
    pytest.param("llava_next_video", {"side": 336, "pinpoints": [[336, 672], [672, 336], [672, 672]]}, 144,
                 id="llava_next_video-checkpoint", marks=pytest.mark.slow),
    pytest.param("llava_next_video", {"side": 56}, 4, id="llava_next_video-tiny"),
    pytest.param("video_llava", {"side": 224}, 257, id="video_llava-checkpoint", marks=pytest.mark.slow),
    pytest.param("video_llava", {"side": 56}, 17, id="video_llava-tiny"),
)


@pytest.mark.parametrize(("model_type", "sizes", "per_frame"), FRAME_VIDEO_SIZES)
def test_frame_video_counts_are_the_processors_own(tmp_path, model_type, sizes, per_frame):
    """A video of any frame count and frame size, and an image, expand as transformers' LlavaNextVideoProcessor (or
    VideoLlavaProcessor) expands `<video>` and `<image>` (its own replace_video_token on the frames' pixels): the
    same tokens."""
    from tests.video_inputs import frame_video_directory, frame_video_processor

    directory, tokenizer = frame_video_directory(tmp_path / "processor", model_type, **sizes)
    rule, video_id = video_processor_rule(directory)
    reference = frame_video_processor(directory, model_type)
    assert rule.kind == "frames" and rule.tokens == per_frame and video_id == reference.video_token_id
    for frames, (width, height) in ((1, (120, 90)), (3, (90, 120)), (4, (7, 300)), (6, (400, 400))):
        video = [frame.resize((width, height)) for frame in video_frames(0)[:1]] * frames
        expected = reference(text="a<video>b", videos=[video])["input_ids"][0].tolist()
        assert tokenizer("a" + rule.text(frames, width, height, 2.0) + "b")["input_ids"] == expected, (frames, width)
        assert rule.placeholders(frames, width, height) == expected.count(video_id)
    image, _ = processor_rule(directory)
    photo = Image.open(SAMPLE_DATA / PHOTOS[0]).convert("RGB")
    expected = reference(text="a<image>b", images=[photo])["input_ids"][0].tolist()
    assert tokenizer("a" + image.text(*photo.size) + "b")["input_ids"] == expected


def test_frame_video_configs(tmp_path):
    """A config naming only its processor takes the class default crop (transformers' source of each); one without
    the crop (frames of their own shapes, which the towers do not take), or a LLaVA-NeXT-Video processor without
    patch_size, is refused by file and field."""
    from tests.video_inputs import frame_video_directory, transformers_source

    for model_type, named in (("video_llava", "VideoLlavaVideoProcessor"),
                              ("llava_next_video", "LlavaNextVideoVideoProcessor")):
        directory, _ = frame_video_directory(tmp_path / model_type, model_type,
                                             video_config={"video_processor_type": named})
        defaults = transformers_source(f"transformers.models.{model_type}.video_processing_{model_type}", named).defaults
        rule, _ = video_processor_rule(directory)
        patches = (defaults.crop_size["height"] // 14) * (defaults.crop_size["width"] // 14)
        assert defaults.do_center_crop
        assert rule.tokens == (patches // 4 if model_type == "llava_next_video" else patches + 1)
    config = directory / "video_preprocessor_config.json"
    config.write_text(json.dumps({"video_processor_type": "LlavaNextVideoVideoProcessor", "do_center_crop": False}))
    with pytest.raises(InputError, match="video_preprocessor_config.json: do_center_crop is off"):
        video_processor_rule(directory)
    config.write_text(json.dumps({"video_processor_type": "LlavaNextVideoVideoProcessor"}))
    (directory / "processor_config.json").write_text(json.dumps({"vision_feature_select_strategy": "default"}))
    with pytest.raises(InputError, match="processor_config.json: a LLaVA-NeXT-Video processor needs patch_size"):
        video_processor_rule(directory)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llava_next_video", "video_llava"])
def test_a_frame_video_corpus_builds_and_a_packed_batch_equals_each_sample_alone(tmp_path, model_type):
    """LLaVA-NeXT-Video and Video-LLaVA end to end: a corpus with frame lists and directories (videos of 4, 3 and 5
    frames, one video twice in a record), an image and a text-only chat -> `prepack prepare-images` -> `prepack build
    --chat` -> every sample in exactly one pack -> ImagePackedDataset, VisionCollator (the family's own image
    processor; every frame of the batch in one row of pixel_values_videos, each video's frames counted at its
    processor's rule) -> a tiny model with the tokenizer's ids: logits, loss and gradients equal each sample alone."""
    from transformers import AutoImageProcessor, AutoVideoProcessor

    from prepack.check.images import verify_images
    from tests.video_inputs import frame_video_directory

    processor, tokenizer = frame_video_directory(tmp_path / "processor", model_type)
    paths = write_videos(tmp_path)
    records = video_records(paths)
    records[3]["videos"] = [paths[0], paths[0]]  # transformers takes a sample's videos at one frame count
    done = run_prepack("prepare-images", corpus_file(tmp_path, records), "--processor", processor, "--out",
                       tmp_path / "prepared", env=WIDE)
    assert done.returncode == 0 and ", 4 videos (their frames among the images)" in done.stdout, done.stderr
    image_set = read_image_set(tmp_path / "prepared" / "images", verify=True)
    assert image_set.manifest.video_rule.kind == "frames" and image_set.manifest.images == 1 + 4 + 3  # frames once
    build = tmp_path / "build"
    result = run_prepack("build", tmp_path / "prepared" / "corpus.parquet", "--tokenizer", processor, "--chat",
                         "--max-len", MAX_LEN, "--overflow", "error", "--out", build)
    assert result.returncode == 0, result.stderr
    assert verify_images(build, image_set.directory) == []
    ids = {"image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
           "video_token_index": tokenizer.convert_tokens_to_ids("<video>")}
    model = enable_packing(tiny_vision_model(model_type, vocab_size=len(tokenizer), tokens=ids))
    collator = VisionCollator(VisionSpec.of(model.config), AutoImageProcessor.from_pretrained(processor),
                              max_len=MAX_LEN, pad_token_id=50256,
                              video_processor=AutoVideoProcessor.from_pretrained(processor))
    dataset = ImagePackedDataset(build, image_set.directory)
    packs = [dataset[index] for index in range(len(dataset))]
    rows = sorted(int(row) for index in range(len(dataset)) for row in dataset.packs.source_rows(index))
    assert rows == [0, 1, 2, 3] and any(len(pack["cu_seqlens"]) > 2 for pack in packs)  # each once, some together
    batch = collator(packs)
    frames = sum(len(frames) for row in rows for frames, _, _ in image_set.videos_of(row))
    assert batch["pixel_values_videos"].shape[:2] == (1, frames) == (1, 4 + 3 + 4 + 4)
    logit_diff, loss_diff, grad_diff = built_batch_against_each_sample_alone(model, collator, dataset, image_set, batch)
    assert logit_diff < TOLERANCE
    assert loss_diff < LOSS_TOLERANCE and grad_diff < LOSS_TOLERANCE


@pytest.fixture(scope="module")
def video_set(processor, tmp_path_factory):
    """The image set of video_records, prepared once: each test below tampers a copy."""
    directory = tmp_path_factory.mktemp("videos")
    summary = prepare_image_chat(corpus_file(directory, video_records(write_videos(directory))), processor,
                                 directory / "prepared")
    return summary.image_set


@pytest.fixture(scope="module")
def video_build(processor, video_set):
    """The build of video_set's corpus (what `prepack verify BUILD --images DIR` checks the set against)."""
    from prepack import build

    out = video_set.parent.parent / "build"
    build(video_set.parent / "corpus.parquet", out, max_len=MAX_LEN, tokenizer=processor, chat=True, overflow="error",
          num_proc=1)
    return out


def edited_manifest(image_set, change) -> None:
    manifest = json.loads((image_set / IMAGE_SET_MANIFEST).read_text())
    change(manifest)
    (image_set / IMAGE_SET_MANIFEST).write_text(json.dumps(manifest))


def rewritten_videos(image_set, change) -> None:
    """`change` (a function of videos.arrow's columns, as Python lists) applied to the file, and the manifest's size
    and sha256 of it made to match, as a careful forger would: only the recount of `_verify_videos` is left."""
    import pyarrow as pa

    from prepack.storage.files import write_record_batch

    columns = pa.ipc.open_stream((image_set / VIDEOS_FILE).read_bytes()).read_next_batch().to_pydict()
    change(columns)
    size, sha256 = write_record_batch(image_set / VIDEOS_FILE, pa.RecordBatch.from_pydict(columns, schema=VIDEOS_SCHEMA))
    edited_manifest(image_set, lambda manifest: next(entry for entry in manifest["files"] if entry["name"] == VIDEOS_FILE)
                    .update(bytes=size, sha256=sha256))


def a_frame_of_another_size(image_set) -> None:
    """Row 0's video (4 frames of 120x90) with its second frame one of video 1's (96x72), an image of the set."""
    other = int(read_image_set(image_set).videos_of(1)[0][0][0])

    def replaced(columns):
        columns["frames"][0][1] = other

    rewritten_videos(image_set, replaced)


def a_count_off_by_one(image_set) -> None:
    """Row 3's second video one placeholder more, and the manifest's video_tokens with it."""
    def one_more(columns):
        columns["tokens"][3][1] += 1

    rewritten_videos(image_set, one_more)
    edited_manifest(image_set, lambda manifest: manifest.update(video_tokens=manifest["video_tokens"] + 1))


def a_rule_of_no_count(image_set) -> None:
    """The video rule made Qwen3-VL's with a temporal patch of 8 frames: it counts no video of fewer (transformers'
    qwen3_vl smart_resize raises there), and these have 3 to 5."""
    edited_manifest(image_set, lambda manifest: manifest["video_rule"].update(kind="qwen3", temporal_patch_size=8))


@pytest.mark.slow  # the set prepared and built once: seconds
@pytest.mark.parametrize(("tamper", "where", "message"), [
    (a_frame_of_another_size, "row 0, column 'frames'", "a video's frames are of 2 sizes; a video's frames are of one size"),
    (a_count_off_by_one, "row 3, column 'tokens'",
     "records {more} placeholder tokens for a video; the rule gives {count} for 4 frames of 120x90"),
    (a_rule_of_no_count, "row 0, column 'frames'", "no placeholder count for a video: 4 frames, fewer than the temporal "
                                                   "patch of 8"),
], ids=["two sizes", "count", "no count"])
def test_a_video_that_only_the_recount_catches_is_refused_by_row_and_column(video_set, video_build, tmp_path, tamper,
                                                                            where, message):
    """A set consistent in every other way (files' sizes and sha256, the counts' sums, the images' own counts): the
    read passes, and `verify` (read_image_set's, and `prepack verify --images`'s) refuses the video by row and column."""
    import re
    import shutil

    from prepack.check.images import verify_images

    image_set = Path(shutil.copytree(video_set, tmp_path / "images"))
    count = read_image_set(image_set).manifest.video_rule.placeholders(*VIDEOS[0][1:4])  # video 0's, before
    message = message.format(count=count, more=count + 1)
    tamper(image_set)
    read_image_set(image_set)  # the cheaper checks pass
    with pytest.raises(FormatError, match=re.escape(f"{image_set / VIDEOS_FILE}: {where}: {message}")):
        read_image_set(image_set, verify=True)
    (problem,) = verify_images(video_build, image_set)
    assert (problem.file, f"row {problem.row}, column {problem.column!r}") == (str(image_set / VIDEOS_FILE), where)
    assert problem.message.startswith(message)


def sampling(processor_class):
    """A user's subclass of transformers' video processor `processor_class` that samples its own frames whatever
    the caller asks (its num_frames uniformly over each video, transformers' own sampling)."""

    class Sampling(processor_class):
        def preprocess(self, videos, **options):
            return super().preprocess(videos, **{**options, "do_sample_frames": True})

    return Sampling


@pytest.mark.parametrize("model_type", [pytest.param("llava_next_video", marks=pytest.mark.slow), "qwen2_vl"])
def test_a_video_processor_that_drops_frames_is_refused(model_type):
    """The set counted every frame of a video: a video processor that samples 2 of video 0's 4 frames (LLaVA-NeXT-
    Video's: 2 frames; Qwen2-VL's: 1 temporal step of 2 frames, not 2) is refused by what it made, not passed on to
    misplace the features."""
    from transformers import LlavaNextVideoVideoProcessor, Qwen2VLVideoProcessor

    from tests.model.test_video import QWEN2_VIDEO_SIZE, packs_of, setup

    model, collator, made = setup(model_type)
    pack = packs_of(made, ((0,),))[0]  # one video: 4 frames of 120x90
    if model_type == "llava_next_video":
        given = collator.video_processor
        processor = sampling(LlavaNextVideoVideoProcessor)(num_frames=2, size=given.size, crop_size=given.crop_size)
        message = "The video processor made [2] frames of the batch's videos of [4]; prepack counted each frame once."
    else:
        rule = collator.video_processor.rule
        processor = sampling(Qwen2VLVideoProcessor)(num_frames=2, size=QWEN2_VIDEO_SIZE, patch_size=rule.patch_size,
                                                    merge_size=rule.merge_size,
                                                    temporal_patch_size=rule.temporal_patch_size)
        message = ("The video processor made [1] temporal steps of the batch's videos of [4] frames (2 frames a "
                   "step, the last repeated: [2]); prepack counted each frame once.")
    with pytest.raises(UsageError) as refused:
        VisionCollator(collator.spec, collator.image_processor, pad_token_id=1, video_processor=processor)([pack])
    assert str(refused.value) == message
