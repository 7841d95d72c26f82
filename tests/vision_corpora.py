"""Image-chat corpora shaped like public VLM SFT data, made from the sample photographs of `tests.vision_inputs`.

The shapes are those of LLaVA-Instruct-150K and the ShareGPT exports LlamaFactory reads (`conversations` of
`human`/`gpt` turns with `<image>` markers and an `images` column of paths), mixed as SFT mixtures are:

- several turns (1-4 question/answer pairs), an optional `system` string;
- the `<image>` marker at the start of the first question with a newline after it (LLaVA's own layout), in
  the middle of a sentence, or at the end;
- rows with two or three images (markers in one turn or spread over turns, an image repeated in a row);
- rows with no image at all (text-only SFT rows mixed in);
- some rows as Hugging Face `messages` with `{"type": "image"}` content items instead;
- images of many sizes: the photographs as they are, crops, tiny ones (a few pixels a side), and very
  elongated ones (aspect ratios up to 150, below the 200 Qwen2-VL's resize rule refuses), as PNG and JPEG.

`real_shaped_corpus(directory, rows, seed)` writes `chats.jsonl` and its images under `directory` and returns
the path of the corpus; the records are also returned so that a test can render a sample as transformers'
processor would see it. The content is random but fixed by `seed`.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from tests.vision_inputs import PHOTOS, SAMPLE_DATA

__all__ = ["IMAGE_SIZES", "real_shaped_corpus"]

# (width, height) the photographs are resized to: tiny, small, square, elongated both ways, very elongated.
IMAGE_SIZES = ((5, 7), (12, 9), (64, 64), (300, 200), (600, 20), (14, 900), (1200, 8), (90, 2000))
_WORDS = ("the a photo of blue pack logo person shows what is in this picture describe it colour left right "
          "detail background woman uniform text box small large").split()


def _images(directory: Path, rng: np.random.Generator) -> list[str]:
    """The photographs as they are, and each resized to the sizes above (PNG, or JPEG for RGB), by path."""
    directory.mkdir(parents=True)
    names = []
    for number, name in enumerate(PHOTOS):
        (directory / name).write_bytes((SAMPLE_DATA / name).read_bytes())
        names.append(name)
        with Image.open(SAMPLE_DATA / name) as photo:
            photo = photo.convert("RGB")
            for width, height in IMAGE_SIZES:
                kind = "JPEG" if (number + width) % 2 else "PNG"
                resized = photo.resize((width, height))
                out = io.BytesIO()
                resized.save(out, format=kind)
                file = f"{Path(name).stem}-{width}x{height}.{kind.lower()}"
                (directory / file).write_bytes(out.getvalue())
                names.append(file)
    return [f"{directory.name}/{name}" for name in names]


def _sentence(rng: np.random.Generator, low: int = 3, high: int = 14) -> str:
    return " ".join(rng.choice(_WORDS, size=int(rng.integers(low, high))))


def _question(rng: np.random.Generator, images: int) -> str:
    """A question with `images` `<image>` markers: at the start with a newline (LLaVA), in the middle or at the end."""
    text = _sentence(rng) + "?"
    for _ in range(images):
        where = rng.choice(["start", "middle", "end"], p=[0.6, 0.25, 0.15])
        if where == "start":
            text = "<image>\n" + text
        elif where == "end":
            text = text + "\n<image>"
        else:
            words = text.split(" ")
            cut = int(rng.integers(0, len(words) + 1))
            text = " ".join([*words[:cut], "<image>", *words[cut:]])
    return text


def _record(rng: np.random.Generator, paths: list[str]) -> dict:
    images = int(rng.choice([0, 1, 1, 1, 2, 3], p=[0.2, 0.2, 0.2, 0.15, 0.15, 0.1]))
    chosen = [paths[int(i)] for i in rng.integers(0, len(paths), size=images)]  # repeats happen, as in real data
    turns = int(rng.integers(1, 5))
    # Which turn each image goes in: mostly the first, as in LLaVA; sometimes later ones.
    in_turn = np.sort(rng.choice(turns, size=images, p=None if turns == 1 else [0.7] + [0.3 / (turns - 1)] * (turns - 1)))
    questions = [_question(rng, int((in_turn == t).sum())) for t in range(turns)]
    answers = [_sentence(rng, 2, 30) + "." for _ in range(turns)]
    if rng.random() < 0.25:  # Hugging Face messages with content items
        messages = []
        for question, answer in zip(questions, answers):
            content, parts = [], question.replace("<image>\n", "<image>").split("<image>")
            for number, part in enumerate(parts):
                if number:
                    content.append({"type": "image"})
                if part:
                    content.append({"type": "text", "text": part})
            messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        return {"messages": messages, "images": chosen}
    record = {"conversations": [turn for question, answer in zip(questions, answers)
                                for turn in ({"from": "human", "value": question}, {"from": "gpt", "value": answer})],
              "images": chosen}
    if rng.random() < 0.3:
        record["system"] = _sentence(rng) + "."
    return record


def real_shaped_corpus(directory: Path, rows: int = 40, seed: int = 0) -> tuple[Path, list[dict]]:
    """`rows` records of the shapes above as `directory/chats.jsonl`, their images under `directory/photos`."""
    rng = np.random.default_rng(seed)
    paths = _images(Path(directory) / "photos", rng)
    records = [_record(rng, paths) for _ in range(rows)]
    corpus = Path(directory) / "chats.jsonl"
    corpus.write_text("".join(json.dumps(record) + "\n" for record in records))
    return corpus, records
